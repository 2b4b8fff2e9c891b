"""The shop's one model: an order, and the id of the task that summarises it."""

from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=200)
    summary_task = models.CharField(max_length=100, blank=True)

    class Meta:
        app_label = "django_shop"

"""The shop's two routes."""

from django.urls import path

from producers.django_shop import views

urlpatterns = [
    path("orders", views.place_order),
    path("orders/<str:task_id>/events", views.summary_events),
]

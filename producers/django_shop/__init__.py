"""A Django shop that saves an order and queues its AI summary in one transaction.

The view writes the order and the task's outbox row in ``transaction.atomic()``: the summary is
published once the order is committed, and never for an order that was rolled back
(docs/how-to/outbox.md, PostgreSQL). A second page streams the summary as it is written, with
``app.sync.stream`` (docs/how-to/handlers.md). Run it beside a worker and a relay::

    weclaw-mq outbox migrate --postgres postgresql://postgres@127.0.0.1/postgres
    DJANGO_SETTINGS_MODULE=producers.django_shop.settings django-admin migrate --run-syncdb
    DJANGO_SETTINGS_MODULE=producers.django_shop.settings django-admin runserver
    weclaw-mq worker producers.shop_tasks:app
    weclaw-mq outbox relay --postgres postgresql://postgres@127.0.0.1/postgres

tests/integration/test_web_examples.py runs it on the real PostgreSQL, broker and Redis.
"""

"""The Django and Flask examples (producers.django_shop, producers.flask_shop) on the real
PostgreSQL, broker and Redis: a Django view saves an order and queues its summary in one
transaction, a rolled-back order queues nothing, and both frameworks stream the summary with
``app.sync`` while this test's loop runs the worker and the relay.

The web requests run in a thread (``asyncio.to_thread``), as a WSGI server's would: ``app.sync``
is for threads without an event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from producers import shop_tasks
from tests.conftest import settings_for, wait_until
from tests.integration.postgres_db import PgSchema
from weclaw_mq import App, ConfigurationError, TaskStatus
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.outbox.postgres import PostgresOutbox, migrate, run_relay
from weclaw_mq.outbox.relay import Relay

SUMMARY = "Order {n}: one {item}."


@pytest.fixture
async def shop(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    broker_url: str,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[App]:
    """The example's handler on a worker of this loop, and the web side's App (used only
    through ``sync``) in place of the example's, both on this test's queue."""
    monkeypatch.setattr(shop_tasks, "QUEUE", qname)
    worker = make_app()
    worker.handler(qname)(shop_tasks.summarise)
    await start_worker(worker)
    web = App("shop-web", settings=settings_for(broker_url, redis_url))
    web.handler(qname)(shop_tasks.summarise)  # so the web side checks payloads too
    monkeypatch.setattr(shop_tasks, "app", web)
    yield web
    await asyncio.to_thread(web.sync.close)


def sse_events(body: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in body.decode().splitlines()
        if line.startswith("data: ")
    ]


async def test_django_saves_the_order_and_queues_its_summary_in_one_transaction(
    shop: App, pg_schema: PgSchema, qname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "producers.django_shop.settings")
    monkeypatch.setenv("SHOP_DB_SCHEMA", pg_schema.name)
    await migrate(pg_schema.url)
    stop = asyncio.Event()
    relay = Relay(await PostgresOutbox.open(pg_schema.url), shop.settings, Metrics())
    relaying = asyncio.create_task(run_relay(relay, pg_schema.url, stop))

    def web() -> tuple[int, dict[str, Any], list[dict[str, Any]], int]:
        import django
        from django.core.management import call_command
        from django.db import connection, connections, transaction
        from django.test import Client

        django.setup()
        from producers.django_shop.models import Order

        try:
            call_command("migrate", run_syncdb=True, verbosity=0)
            client = Client()
            placed = client.post(
                "/orders", data=json.dumps({"item": "teapot"}), content_type="application/json"
            )
            body = placed.json()
            streamed = client.get(f"/orders/{body['task_id']}/events")
            events = sse_events(b"".join(streamed.streaming_content))  # type: ignore[arg-type]
            # A view that fails after its insert: neither the order nor its task exists.
            with pytest.raises(RuntimeError), transaction.atomic():
                Order.objects.create(item="ghost")
                shop.add_to_outbox(connection, qname, {"order_id": 0, "item": "ghost"})
                raise RuntimeError("the view failed")
            with pytest.raises(ConfigurationError, match=r"transaction\.atomic"):
                shop.add_to_outbox(connection, qname, {"order_id": 0, "item": "outside"})
            return placed.status_code, body, events, Order.objects.count()
        finally:
            connections.close_all()

    try:
        code, body, events, orders = await asyncio.wait_for(asyncio.to_thread(web), 90)
        final = await shop_final(shop, body["task_id"])
        await wait_until(lambda: pg_schema.count() == 0, 20, "the outbox to drain")
    finally:
        stop.set()
        await asyncio.wait_for(relaying, 30)
        await relay.outbox.close()

    assert code == 202 and orders == 1
    summary = SUMMARY.format(n=body["order"], item="teapot")
    assert "".join(e["data"] for e in events if e["kind"] == "chunk") == summary
    assert events[-1]["kind"] == "final" and events[-1]["result"] == summary
    assert final == (TaskStatus.SUCCEEDED, summary)
    assert relay.sent == 1  # the teapot's task only: the ghost's was rolled back


async def shop_final(shop: App, task_id: str) -> tuple[TaskStatus, Any]:
    state = await asyncio.to_thread(shop.sync.result, task_id, timeout_s=30)
    return state.status, state.result


async def test_flask_publishes_reports_and_streams_a_summary(shop: App) -> None:
    from producers.flask_shop import create_app

    client = create_app(shop).test_client()

    def web() -> tuple[int, int, list[dict[str, Any]], dict[str, Any]]:
        placed = client.post("/summaries", json={"order_id": 7, "item": "kettle"})
        refused = client.post("/summaries", json={"order_id": "seven"})
        task_id = placed.get_json()["task_id"]
        events = sse_events(client.get(f"/summaries/{task_id}/events").get_data())
        return (
            placed.status_code,
            refused.status_code,
            events,
            client.get(f"/summaries/{task_id}").get_json(),
        )

    placed, refused, events, status = await asyncio.wait_for(asyncio.to_thread(web), 60)

    summary = SUMMARY.format(n=7, item="kettle")
    assert (placed, refused) == (202, 422)
    assert "".join(e["data"] for e in events if e["kind"] == "chunk") == summary
    assert status == {"status": "succeeded", "result": summary}

"""A task published by the last release is run by today's worker: the messages of
``tests/unit/wire/wire_0.1.0.json`` (that release's ``App.prepare``, headers and properties as
it sent them) are published raw, with plain aio-pika, and today's worker runs each to a
succeeded record. The other direction is ``tests/unit/test_wire_compat.py``: today's
``App.prepare`` builds exactly the release's messages, so the release's worker reads them as
its own."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel

from weclaw_mq import App, Context, TaskStatus

RELEASED = json.loads(
    (Path(__file__).parents[1] / "unit" / "wire" / "wire_0.1.0.json").read_text()
)["messages"]


def _as_sent(recorded: dict[str, Any], task_id: str) -> aio_pika.Message:
    """The recorded message, with its times made current (the record holds their type)."""
    now_ms = int(time.time() * 1000)
    headers: dict[str, Any] = {
        k: now_ms + int(recorded["headers"]["x-weclaw-ttl-ms"]) if v == "<epoch ms>" else v
        for k, v in recorded["headers"].items()
    }
    if "x-weclaw-not-before" in headers:
        headers["x-weclaw-not-before"] = now_ms  # due now: the test waits for no delay
    return aio_pika.Message(
        recorded["body"].encode(),
        message_id=task_id,
        content_type=recorded["content_type"],
        delivery_mode=aio_pika.DeliveryMode(recorded["delivery_mode"]),
        expiration=recorded["expiration"],
        headers=headers,
    )


@pytest.mark.parametrize("case", sorted(RELEASED))
async def test_a_task_the_last_release_published_is_run_by_todays_worker(
    case: str,
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    seen: list[tuple[dict[str, Any], int, str | None]] = []

    @app.handler(qname)
    async def handle(task: dict[str, Any], ctx: Context) -> dict[str, Any]:
        seen.append((task, ctx.attempt, ctx.trace_id))
        return {"echo": task["prompt"]}

    await start_worker(app)
    task_id = f"released-{case}-{uuid.uuid4().hex[:8]}"
    await amqp.default_exchange.publish(_as_sent(RELEASED[case], task_id), routing_key=qname)

    state = await app.result(task_id, queue=qname, timeout_s=20)
    assert state.status is TaskStatus.SUCCEEDED
    assert state.result == {"echo": "hi"}
    assert seen == [({"prompt": "hi", "user": "u"}, 1, "trace-1")]

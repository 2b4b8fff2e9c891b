"""The console's dead-letter engine (``console.dead_letters``) and pages on a real DLQ: a
confirmed bulk action never acts on more dead letters than its preview counted, even when more
arrive between the preview and the confirmation; a look holds and serves a bounded preview of
each body, and the whole body comes on demand."""

from __future__ import annotations

import json
from collections.abc import Callable

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import queue_depth
from tests.integration.console_live import (  # noqa: F401
    LiveConsole,
    console_access,
    console_trace_url,
    live_console,
)
from weclaw_mq import App
from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_filter import EVERYTHING
from weclaw_mq.console import dead_letters
from weclaw_mq.console.dead_letters import BODY_PREVIEW_BYTES, Action, DeadLetters
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name


class Prompt(BaseModel):
    text: str


async def dead_letter(
    amqp: AbstractChannel, queue: str, body: bytes, task_id: str | None = None
) -> None:
    message = aio_pika.Message(
        body,
        message_id=task_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers={h.DEAD_LETTER_REASON: "rejected"},
    )
    await amqp.default_exchange.publish(message, routing_key=dlq_name(queue))


@pytest.fixture
async def dlq_app(make_app: Callable[..., App], qname: str) -> App:
    app = make_app()

    @app.handler(qname)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in these tests")

    await app.declare()
    return app


@pytest.mark.parametrize("action", ["purge", "requeue"])
async def test_a_confirmed_action_never_takes_more_than_its_preview_counted(
    dlq_app: App,
    qname: str,
    amqp: AbstractChannel,
    action: Action,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A preview bigger than this runs as its filter and the count it showed (not by task
    # ids): 2 here stands for the 1,000 of a real console, without writing 1,001 messages.
    monkeypatch.setattr(dead_letters, "EXACT_MAX", 2)
    for n in range(3):
        await dead_letter(amqp, qname, b"before-%d" % n)
    engine = DeadLetters(dlq_app)
    preview, selected = await engine.preview(action, qname, EVERYTHING)
    assert len(selected) == 3 and not preview.exact
    for n in range(5):  # more arrive before the operator confirms
        await dead_letter(amqp, qname, b"after-%d" % n)

    job = engine.start(preview.id)
    await engine.wait()

    assert job.state == "done", job.error
    acted = job.summary["removed" if action == "purge" else "moved"]
    assert acted == 3, job.summary
    left = [d.body for d in await dlq.inspect(dlq_app, qname, limit=None)]
    assert left == [b"after-%d" % n for n in range(5)]
    assert await queue_depth(amqp, qname) == (3 if action == "requeue" else 0)


# Three bodies of 256 KiB: what a page served whole before, and what it must not hold now.
BIG_BYTES = 256 * 1024
# Far above three previews and a page's markup, far below one big body.
PAGE_MAX_BYTES = 64 * 1024


async def test_a_look_holds_and_serves_a_preview_of_each_body_and_the_whole_on_demand(
    live_console: LiveConsole,  # noqa: F811
    amqp: AbstractChannel,
) -> None:
    q = live_console.queue
    bodies = {f"big-{n}": json.dumps({"text": "abc"[n] * BIG_BYTES}).encode() for n in range(3)}
    for task_id, body in bodies.items():
        await dead_letter(amqp, q, body, task_id)
    await dead_letter(amqp, q, b'{"text":"short"}', "small")

    # What one look keeps in memory: previews, however big the bodies.
    looked = await DeadLetters(live_console.console_app).look(q, EVERYTHING)
    assert [d.task_id for d in looked.shown] == [*bodies, "small"]
    assert all(len(d.body) <= BODY_PREVIEW_BYTES for d in looked.shown)
    assert [d.body_size for d in looked.shown] == [len(b) for b in bodies.values()] + [None]

    client = live_console.client
    answer = await client.get("/api/dead-letters", params={"queue": q})
    assert answer.status_code == 200, answer.text[:300]
    assert len(answer.content) < PAGE_MAX_BYTES, len(answer.content)
    *big, small = answer.json()["dead_letters"]
    for record, (task_id, body) in zip(big, bodies.items(), strict=True):
        assert record["task_id"] == task_id and record["body_truncated"] is True
        assert record["body"] is None and record["body_size"] == len(body)
        assert body.decode().startswith(record["body_preview"])
        assert len(record["body_preview"].encode()) <= BODY_PREVIEW_BYTES
    assert small["body"] == {"text": "short"} and small["body_truncated"] is False

    page = await client.get("/dead-letters", params={"queue": q})
    assert page.status_code == 200
    assert len(page.content) < PAGE_MAX_BYTES, len(page.content)
    assert page.text.count('class="whole-body"') == 3

    whole = await client.get(big[1]["body_url"])
    assert whole.status_code == 200
    assert whole.content == bodies["big-1"]
    assert whole.headers["content-type"].startswith("text/plain")
    assert whole.headers["x-content-type-options"] == "nosniff"
    absent = await client.get("/api/dead-letters/body", params={"queue": q, "task_id": "nope"})
    assert absent.status_code == 404
    unnamed = await client.get("/api/dead-letters/body", params={"queue": q})
    assert unnamed.status_code == 400 and "no task id" in unnamed.json()["error"]
    # A preview lists no body, and holds none while it counts.
    made, selected = await DeadLetters(live_console.console_app).preview("purge", q, EVERYTHING)
    assert len(made.task_ids) == 4 and all(d.body == b"" for d in selected)
    assert [d.body_size for d in selected] == [*map(len, bodies.values()), 16]
    # Looking changed nothing: every dead letter still there, whole and in order.
    kept = await dlq.inspect(live_console.console_app, q, limit=None)
    assert [d.body for d in kept] == [*bodies.values(), b'{"text":"short"}']

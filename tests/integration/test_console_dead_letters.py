"""The console's dead-letter engine (``console.dead_letters``) on a real DLQ: a confirmed bulk
action never acts on more dead letters than its preview counted, even when more arrive
between the preview and the confirmation."""

from __future__ import annotations

from collections.abc import Callable

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import queue_depth
from weclaw_mq import App
from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_filter import EVERYTHING
from weclaw_mq.console import dead_letters
from weclaw_mq.console.dead_letters import Action, DeadLetters
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name


class Prompt(BaseModel):
    text: str


async def dead_letter(amqp: AbstractChannel, queue: str, body: bytes) -> None:
    message = aio_pika.Message(
        body,
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

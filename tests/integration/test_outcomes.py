"""One outcome event per settled delivery: the counters equal what the broker was told.

Every end of a delivery (ack, duplicate, deferred, retried, dead-lettered by a move or by a
reject, given back after a failed move or at a hard stop, acked as cancelled) is counted once in
``weclaw_mq_messages_total{outcome}``. The test counts, beside it, every settle frame the
worker's channel sent the broker, and what the broker then holds in ``Q`` and ``Q.dlq``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiormq
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import outcome_count, queue_depth, wait_until
from tests.integration.raw_amqp import publish_undecodable
from weclaw_mq import App, RetryPolicy, TaskStatus
from weclaw_mq.contract.naming import dlq_name, ladder_queue_name
from weclaw_mq.observability.metrics import Outcome

# A message_id whose bytes are not UTF-8 once patched in: its properties cannot be decoded.
# Long enough that a deferred copy comes back after its twin finished (it then is a duplicate).
# A delay no other test uses: its shared delay queue is deleted below (and at the end).
DELAY = RetryPolicy(max_retries=1, delay_s=1.013)


class Job(BaseModel):
    kind: str


def _spy_on_settle_frames(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count every ack and nack frame sent to the broker (they still go through)."""
    frames: Counter[str] = Counter()
    ack, nack = aiormq.Channel.basic_ack, aiormq.Channel.basic_nack

    async def counted_ack(self: aiormq.Channel, *args: Any, **kwargs: Any) -> None:
        frames["ack"] += 1
        await ack(self, *args, **kwargs)

    async def counted_nack(self: aiormq.Channel, *args: Any, **kwargs: Any) -> None:
        frames["requeue" if kwargs.get("requeue", True) else "drop"] += 1
        await nack(self, *args, **kwargs)

    monkeypatch.setattr(aiormq.Channel, "basic_ack", counted_ack)
    monkeypatch.setattr(aiormq.Channel, "basic_nack", counted_nack)
    return frames


async def test_every_settled_delivery_is_counted_once_as_the_broker_saw_it(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
    broker_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frames = _spy_on_settle_frames(monkeypatch)
    app = make_app()
    started: list[str] = []
    release = asyncio.Event()
    redeclared = asyncio.Event()

    @app.handler(qname, retry=DELAY)
    async def handle(task: Job) -> dict[str, bool]:
        started.append(task.kind)
        if task.kind == "fail":
            raise RuntimeError("model down")
        if task.kind == "unmovable":
            if started.count("unmovable") > 1:
                await redeclared.wait()  # its delay queue is back
            raise RuntimeError("model down")
        if task.kind == "block":
            await release.wait()
        if task.kind == "hang":
            await asyncio.Event().wait()  # still running when the worker stops hard
        return {"ok": True}

    def count(outcome: Outcome) -> float:
        return outcome_count(app, qname, outcome)

    worker = await start_worker(app, concurrency=4, shutdown_grace_s=0)

    # acked, then a duplicate of it.
    ok = await app.publish(qname, Job(kind="ok"), task_id="ok-1")
    assert (await app.result(ok, timeout_s=10)).status is TaskStatus.SUCCEEDED
    await app.publish(qname, Job(kind="ok"), task_id="ok-1")
    await wait_until(lambda: count(Outcome.DUPLICATE) == 1, 10, "the duplicate")

    # cancelled before it was published: acked unrun.
    doomed = await app.cancel(f"cancel-{uuid.uuid4().hex}", queue=qname)
    await app.publish(qname, Job(kind="cancelled"), task_id=doomed.task_id)
    await wait_until(lambda: count(Outcome.CANCELLED) == 1, 10, "the cancelled task")
    assert "cancelled" not in started

    # retried once, then dead-lettered by a move.
    failed = await app.publish(qname, Job(kind="fail"), task_id="fail-1")
    assert (await app.result(failed, timeout_s=15)).status is TaskStatus.DEAD_LETTERED

    # deferred while its twin runs; back after the twin finished, it is a duplicate.
    await app.publish(qname, Job(kind="block"), task_id="block-1")
    await wait_until(lambda: "block" in started, 10, "the first copy to start")
    await app.publish(qname, Job(kind="block"), task_id="block-1")
    await wait_until(lambda: count(Outcome.DEFERRED) >= 1, 10, "the second copy deferred")
    release.set()
    await wait_until(lambda: count(Outcome.DUPLICATE) == 2, 15, "the deferred copy's return")

    # given back when its move fails (no delay queue to retry through), then retried and
    # dead-lettered once the delay queue is back.
    await amqp.queue_delete(ladder_queue_name(DELAY.delay_ms(1)))
    unmovable = await app.publish(qname, Job(kind="unmovable"), task_id="unmovable-1")
    await wait_until(lambda: count(Outcome.REQUEUED) == 1, 10, "the failed move's give back")
    await app.declare()
    redeclared.set()
    assert (await app.result(unmovable, timeout_s=15)).status is TaskStatus.DEAD_LETTERED

    # dead-lettered by a reject: properties the client cannot decode.
    await publish_undecodable(broker_url, qname, b'{"kind": "ok"}')
    await wait_until(lambda: count(Outcome.DEAD_LETTERED) == 3, 10, "the rejected message")

    # given back: running when the worker stops with no grace.
    await app.publish(qname, Job(kind="hang"), task_id="hang-1")
    await wait_until(lambda: "hang" in started, 10, "the hanging task to start")
    worker.stop()
    await wait_until(lambda: worker.in_flight == 0, 15, "the stop to give the task back")

    counted = {o: count(o) for o in Outcome}
    assert counted == {
        Outcome.ACKED: 2,
        Outcome.DUPLICATE: 2,
        Outcome.DEFERRED: counted[Outcome.DEFERRED],  # 1, or more on a slow machine
        Outcome.RETRIED: 2,
        Outcome.DEAD_LETTERED: 3,
        Outcome.REQUEUED: 2,
        Outcome.CANCELLED: 1,
    }
    # What the broker was told: one settle frame per counted outcome...
    assert frames["ack"] + frames["requeue"] + frames["drop"] == sum(counted.values())
    assert frames["requeue"] == counted[Outcome.REQUEUED]
    # ...and what it holds: the dead letters in Q.dlq, the task given back at the stop in Q.
    await wait_until(
        lambda: _depth_is(amqp, dlq_name(qname), counted[Outcome.DEAD_LETTERED]), 10, "the DLQ"
    )
    await wait_until(lambda: _depth_is(amqp, qname, 1), 10, "the hanging task back in its queue")


async def _depth_is(channel: AbstractChannel, queue: str, expected: float) -> bool:
    return await queue_depth(channel, queue) == expected

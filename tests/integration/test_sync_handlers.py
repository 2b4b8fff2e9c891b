"""Plain-``def`` handlers on the real broker and Redis (issue 28): they run in the worker's
threads, as many at once as its concurrency, and end every way an async handler ends: a
result, a ``Retry``, a ``Reject``, an invalid payload, a timeout (the call abandoned to its
thread, which stays counted as busy until it returns), a cancel, a stream, a follow-up task."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import outcome_count, queue_depth, wait_until
from weclaw_mq import App, CancelOutcome, Context, Reject, Retry, RetryPolicy, TaskStatus
from weclaw_mq.contract import headers as h
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.state import TaskState
from weclaw_mq.streaming import StreamEvent

FAST = RetryPolicy(max_retries=2, delay_s=0.05, multiplier=1)
# How long each call of the concurrency test blocks, as a slow SDK call would.
BLOCK_S = 2.0
# The bound of any wait of a handler on the test: never reached when the code is right.
HANDLER_WAIT_S = 60.0


@dataclass
class Kit:
    """The conftest fixtures these tests use, in one argument."""

    make_app: Callable[..., App]
    start_worker: Callable[..., Any]
    qname: str
    amqp: AbstractChannel


@pytest.fixture
def kit(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> Kit:
    return Kit(make_app, start_worker, qname, amqp)


async def test_a_blocking_handler_runs_eight_calls_at_once_at_concurrency_8(kit: Kit) -> None:
    app, qname = kit.make_app(), kit.qname
    calls: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    @app.handler(qname)
    def call_sdk(task: dict[str, int]) -> int:
        started = time.monotonic()
        time.sleep(BLOCK_S)  # a blocking SDK call: it holds its thread, not the event loop
        with lock:
            calls.append((started, time.monotonic(), threading.get_ident()))
        return task["n"]

    await kit.start_worker(app, concurrency=8)
    ids = [await app.publish(qname, {"n": n}) for n in range(8)]
    finals = [await app.result(task_id, timeout_s=30) for task_id in ids]

    assert [(f.status, f.result) for f in finals] == [(TaskStatus.SUCCEEDED, n) for n in range(8)]
    starts, ends, threads = zip(*calls, strict=True)
    # Every call started before any ended: all eight ran at once.
    assert max(starts) < min(ends), calls
    assert len(set(threads)) == 8 and threading.get_ident() not in threads


async def test_a_blocking_call_past_its_timeout_is_retried_then_dead_lettered_and_keeps_its_thread(
    kit: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    app, qname = kit.make_app(sync_threads=2), kit.qname
    release = threading.Event()
    stuck_attempts: list[int] = []
    later_started: list[float] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=1, delay_s=0.05), timeout_s=0.5)
    def never_answers(task: dict[str, int], ctx: Context) -> str:
        stuck_attempts.append(ctx.attempt)
        release.wait(HANDLER_WAIT_S)  # a blocking call with no timeout of its own
        return "too late"

    later = f"{qname}-later"

    # A short timeout and no retry: a wait for a thread that counted against it (or spent an
    # attempt) would dead-letter the task unstarted.
    @app.handler(later, timeout_s=0.5, retry=RetryPolicy(max_retries=0, delay_s=0.05))
    def answers(task: dict[str, int]) -> str:
        later_started.append(time.monotonic())
        return "answered"

    worker = await kit.start_worker(app, concurrency=2)
    threads = worker.sync_threads
    try:
        with caplog.at_level(logging.WARNING, "weclaw_mq.worker"):
            stuck = await app.publish(qname, {"n": 1})
            final = await app.result(stuck, timeout_s=20)
        assert (final.status, final.reason, final.attempt) == (
            TaskStatus.DEAD_LETTERED,
            "retries_exhausted",
            2,
        )
        assert final.error is not None and final.error.startswith("HandlerTimeout"), final.error
        assert stuck_attempts == [1, 2]
        abandoned = [m for m in caplog.messages if "abandoned in its thread at its timeout" in m]
        assert len(abandoned) == 2, caplog.messages
        # Both calls still run: each holds its thread, and the pool counts them.
        assert (threads.threads, threads.running, threads.abandoned) == (2, 2, 2)

        # No thread can come back: the next plain-def task is deferred unstarted, again and
        # again, without spending an attempt; /healthz says the pool is stuck.
        assert threads.stuck
        health = worker.health()
        assert not health.ok
        assert health.as_json()["sync_threads"] == {"size": 2, "stuck": 2}
        waiting = await app.publish(later, {"n": 2})
        await wait_until(
            lambda: outcome_count(app, later, Outcome.DEFERRED) >= 2, 20, what="two deferrals"
        )
        assert later_started == []
        # Its record says why it waits, not "running", and spent no attempt.
        shown = await app.status(waiting)
        assert shown is not None and shown.deferred is not None, shown
        assert (shown.status, shown.deferred.by) == (TaskStatus.QUEUED, "threads")
        assert "no sync thread free" in shown.deferred.why
        assert (threads.threads, threads.running) == (2, 2)  # never more than the pool's size
        released_at = time.monotonic()
    finally:
        release.set()
    answered = await app.result(waiting, timeout_s=20)
    assert (answered.status, answered.result, answered.attempt) == (
        TaskStatus.SUCCEEDED,
        "answered",
        1,
    )
    assert later_started[0] >= released_at  # it ran in a thread an abandoned call gave back
    await wait_until(lambda: threads.running == threads.abandoned == 0, 10, what="threads freed")
    assert not threads.stuck and worker.health().ok
    # What the abandoned calls returned in the end was dropped.
    state = await app.status(stuck)
    assert state is not None and (state.status, state.result) == (TaskStatus.DEAD_LETTERED, None)


async def _status_is(app: App, task_id: str, status: TaskStatus) -> bool:
    state = await app.status(task_id)
    return state is not None and state.status is status


class Job(BaseModel):
    do: Literal["ok", "retry", "reject", "raise", "unserialisable"]


def _decide(job: Job, ctx: Context) -> Any:
    """The same body for both forms of the handler."""
    if job.do == "retry" and ctx.attempt == 1:
        raise Retry("try again")
    if job.do == "reject":
        raise Reject("no retry can fix it")
    if job.do == "raise":
        raise ValueError("the SDK failed")
    if job.do == "unserialisable":
        return {"value": object()}
    return {"done": job.do, "attempt": ctx.attempt}


async def test_a_plain_def_ends_each_task_as_the_same_async_def_does(kit: Kit) -> None:
    app, qname, amqp = kit.make_app(), kit.qname, kit.amqp
    sync_queue, async_queue = f"{qname}-sync", f"{qname}-async"

    @app.handler(sync_queue, retry=FAST)
    def as_def(job: Job, ctx: Context) -> Any:
        return _decide(job, ctx)

    @app.handler(async_queue, retry=FAST)
    async def as_async_def(job: Job, ctx: Context) -> Any:
        return _decide(job, ctx)

    await kit.start_worker(app, concurrency=4)
    cases = ["ok", "retry", "reject", "raise", "unserialisable"]

    async def ends(queue: str) -> dict[str, tuple[Any, ...]]:
        ids = {do: await app.publish(queue, {"do": do}) for do in cases}
        invalid = f"{queue}-invalid"
        await amqp.default_exchange.publish(  # a foreign producer's body the model refuses
            aio_pika.Message(b'{"do": "dance"}', message_id=invalid, headers={h.TRACE_ID: "t"}),
            routing_key=queue,
        )
        ids["invalid"] = invalid
        finals = {do: await app.result(task_id, timeout_s=20) for do, task_id in ids.items()}
        return {do: _outcome(final) for do, final in finals.items()}

    as_sync, as_async = await asyncio.gather(ends(sync_queue), ends(async_queue))
    assert as_sync == as_async
    assert as_sync["ok"] == (TaskStatus.SUCCEEDED, None, 1, None, {"done": "ok", "attempt": 1})
    assert as_sync["retry"][:3] == (TaskStatus.SUCCEEDED, None, 2)
    assert as_sync["reject"][:3] == (TaskStatus.DEAD_LETTERED, "rejected", 1)
    assert as_sync["raise"][:4] == (
        TaskStatus.DEAD_LETTERED,
        "retries_exhausted",
        3,
        "ValueError: the SDK failed",
    )
    assert as_sync["invalid"][:3] == (TaskStatus.DEAD_LETTERED, "invalid_payload", 1)
    assert as_sync["unserialisable"][0] is TaskStatus.DEAD_LETTERED


def _outcome(final: TaskState) -> tuple[Any, ...]:
    return (final.status, final.reason, final.attempt, final.error, final.result)


async def test_a_cancelled_blocking_handler_ends_cancelled_and_sees_ctx_cancelled_in_its_thread(
    kit: Kit,
) -> None:
    app, qname = kit.make_app(), kit.qname
    started = threading.Event()
    saw_cancel: list[bool] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=3, delay_s=0.2))
    def generate(task: dict[str, int], ctx: Context) -> str:
        started.set()
        give_up = time.monotonic() + HANDLER_WAIT_S
        while not ctx.cancelled and time.monotonic() < give_up:
            time.sleep(0.01)  # one step of a long blocking job, then a look at ctx.cancelled
        saw_cancel.append(ctx.cancelled)
        return "the whole answer"

    worker = await kit.start_worker(app)
    task_id = await app.publish(qname, {"n": 1})
    await wait_until(started.is_set, 10, what="the handler running in its thread")

    answer = await app.cancel(task_id)
    assert answer.outcome is CancelOutcome.CANCELLED
    await wait_until(
        lambda: outcome_count(app, qname, Outcome.CANCELLED) == 1, 10, what="acked as cancelled"
    )
    await wait_until(lambda: saw_cancel, 10, what="the handler seeing ctx.cancelled")
    assert saw_cancel == [True]
    final = await app.result(task_id, timeout_s=1)
    assert (final.status, final.result) == (TaskStatus.CANCELLED, None)  # its return dropped
    assert outcome_count(app, qname, Outcome.RETRIED) == 0
    await wait_until(lambda: worker.sync_threads.running == 0, 10, what="its thread freed")
    assert worker.sync_threads.abandoned == 0
    assert await queue_depth(kit.amqp, qname) == 0


class Words(BaseModel):
    words: list[str]


async def _collect(events: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    async with asyncio.timeout(20):
        async for event in events:
            out.append(event)
    return out


async def test_a_blocking_handler_streams_with_emit_sync_and_publishes_with_publish_sync(
    kit: Kit,
) -> None:
    app, qname = kit.make_app(), kit.qname
    next_queue = f"{qname}-next"
    follow_ups: list[str] = []

    @app.handler(qname)
    def speak(task: Words, ctx: Context) -> dict[str, str]:
        for word in task.words:
            ctx.emit_sync(word)  # from the handler's thread, written by the worker's loop
        follow_ups.append(ctx.publish_sync(next_queue, {"text": " ".join(task.words)}))
        return {"text": " ".join(task.words)}

    @app.handler(next_queue)
    async def then(task: dict[str, str], ctx: Context) -> dict[str, str]:
        return {"text": task["text"], "trace_id": ctx.trace_id}

    await kit.start_worker(app)
    words = [f"w{i}" for i in range(12)]
    task_id = await app.publish(qname, Words(words=words), trace_id="trace-sync")
    events = await _collect(app.stream(task_id))

    assert [e.kind for e in events] == ["attempt"] + ["chunk"] * 12 + ["final"]
    assert [e.data for e in events if e.kind == "chunk"] == words
    assert (events[-1].status, events[-1].result) == ("succeeded", {"text": " ".join(words)})
    (follow_up,) = follow_ups
    after = await app.result(follow_up, timeout_s=10)
    assert after.result == {"text": " ".join(words), "trace_id": "trace-sync"}

"""The consume path end to end on the real broker: retries through delay queues, dead letters
with their reasons and headers, timeouts, trace propagation and log context."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from pydantic import BaseModel

from tests.conftest import next_message, outcome_count, queue_depth, wait_until
from weclaw_mq import App, Context, Reject, RetryPolicy
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.observability.tracing import TraceLogFilter

FAST = RetryPolicy(max_retries=2, delay_s=0.05, multiplier=1)


class Prompt(BaseModel):
    text: str


@dataclass
class Call:
    text: str
    task_id: str
    trace_id: str
    attempt: int
    started: float  # monotonic
    started_at: datetime  # wall clock, to compare with the failure-time headers
    headers: dict[str, Any]


def _record(calls: list[Call], task: Prompt, ctx: Context) -> None:
    calls.append(
        Call(
            text=task.text,
            task_id=ctx.task_id,
            trace_id=ctx.trace_id,
            attempt=ctx.attempt,
            started=time.monotonic(),
            started_at=datetime.now(UTC),
            headers=dict(ctx.headers),
        )
    )


def _headers(message: AbstractIncomingMessage) -> dict[str, Any]:
    # typed loosely on purpose: the assertions below check the values' types themselves
    return dict(message.headers or {})


async def _publish_raw(channel: AbstractChannel, queue: str, body: bytes, task_id: str) -> None:
    """Publish as a foreign producer would, bypassing App.publish's checks."""
    await channel.default_exchange.publish(
        aio_pika.Message(body, message_id=task_id, headers={h.TRACE_ID: f"trace-{task_id}"}),
        routing_key=queue,
    )


async def _recording_worker(
    make_app: Callable[..., App], start_worker: Callable[..., Any], queue: str
) -> tuple[App, list[Call]]:
    """A running worker whose handler on ``queue`` only records its calls."""
    app = make_app()
    calls: list[Call] = []

    @app.handler(queue, retry=FAST)
    async def summarise(task: Prompt, ctx: Context) -> None:
        _record(calls, task, ctx)

    await start_worker(app)
    return app, calls


async def test_handler_failing_twice_then_succeeding_runs_three_times_with_backoff(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    calls: list[Call] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=3, delay_s=0.2, multiplier=2))
    async def flaky(task: Prompt, ctx: Context) -> None:
        _record(calls, task, ctx)
        if ctx.attempt < 3:
            raise RuntimeError(f"model overloaded (attempt {ctx.attempt})")

    await start_worker(app)
    task_id = await app.publish(qname, Prompt(text="hello"), trace_id="trace-flaky")
    await wait_until(
        lambda: outcome_count(app, qname, "acked") == 1, 15, "the third attempt to ack"
    )

    assert [c.attempt for c in calls] == [1, 2, 3]
    assert {c.task_id for c in calls} == {task_id}
    assert {c.trace_id for c in calls} == {"trace-flaky"}
    assert {c.text for c in calls} == {"hello"}
    gap1 = calls[1].started - calls[0].started
    gap2 = calls[2].started - calls[1].started
    # The TTL starts after the failure, so a gap is never shorter than its delay; the upper
    # bound is loose because timings on a shared 2-core box are noisy.
    assert 0.2 <= gap1 < 1.5, f"first retry after {gap1:.3f} s, policy says 0.2 s"
    assert 0.4 <= gap2 < 2.0, f"second retry after {gap2:.3f} s, policy says 0.4 s"
    # the retried delivery says what went wrong last time
    assert calls[1].headers[h.ERROR_TYPE] == "RuntimeError"
    assert calls[1].headers[h.ERROR_MESSAGE] == "model overloaded (attempt 1)"
    assert calls[2].headers[h.ERROR_MESSAGE] == "model overloaded (attempt 2)"
    assert outcome_count(app, qname, "retried") == 2
    assert outcome_count(app, qname, "dead_lettered") == 0


async def test_failed_handler_lands_in_dlq_after_max_retries_with_the_failure_headers(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    calls: list[Call] = []

    @app.handler(qname, retry=FAST)
    async def broken(task: Prompt, ctx: Context) -> None:
        _record(calls, task, ctx)
        raise ValueError(f"cannot summarise {task.text!r}")

    await start_worker(app)
    task_id = await app.publish(qname, Prompt(text="doomed"), trace_id="trace-doomed")

    dead = await next_message(amqp, dlq_name(qname))
    failed_at = datetime.now(UTC)

    assert [c.attempt for c in calls] == [1, 2, 3]  # the first run plus max_retries=2
    assert dead.message_id == task_id
    assert Prompt.model_validate_json(dead.body) == Prompt(text="doomed")
    assert dead.content_type == "application/json"
    assert dead.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    hdrs = _headers(dead)
    assert hdrs[h.DEAD_LETTER_REASON] == "retries_exhausted"
    assert hdrs[h.ERROR_TYPE] == "ValueError"
    assert hdrs[h.ERROR_MESSAGE] == "cannot summarise 'doomed'"
    assert "ValueError: cannot summarise 'doomed'" in hdrs[h.ERROR_TRACEBACK]
    assert "in broken" in hdrs[h.ERROR_TRACEBACK]  # the frame of the user's handler
    assert hdrs[h.ATTEMPT] == 3
    assert hdrs[h.ORIGINAL_QUEUE] == qname
    assert hdrs[h.TRACE_ID] == "trace-doomed"
    first = datetime.fromisoformat(hdrs[h.FIRST_FAILURE_AT])
    last = datetime.fromisoformat(hdrs[h.LAST_FAILURE_AT])
    # the first failure time survives both hops through the delay queue
    assert calls[0].started_at <= first <= calls[1].started_at
    assert calls[2].started_at <= last <= failed_at
    # nothing is left behind anywhere else
    assert await queue_depth(amqp, qname) == 0
    await wait_until(
        lambda: outcome_count(app, qname, "dead_lettered") == 1, 5, "the DLQ move to ack"
    )


async def test_undecodable_body_goes_straight_to_dlq_and_the_worker_keeps_serving(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app, calls = await _recording_worker(make_app, start_worker, qname)
    garbage_id = f"{qname}-garbage"
    await _publish_raw(amqp, qname, b"\xff{not json", task_id=garbage_id)

    dead = await next_message(amqp, dlq_name(qname))
    assert dead.message_id == garbage_id
    assert dead.body == b"\xff{not json"  # kept byte for byte for the operator to inspect
    hdrs = _headers(dead)
    assert hdrs[h.DEAD_LETTER_REASON] == "undecodable"
    assert hdrs[h.ERROR_TYPE] == "weclaw_mq.UndecodableBody"
    assert hdrs[h.ATTEMPT] == 1
    assert hdrs[h.ORIGINAL_QUEUE] == qname
    assert hdrs[h.TRACE_ID] == f"trace-{garbage_id}"

    good = await app.publish(qname, Prompt(text="fine"))
    await wait_until(lambda: calls, 10, "the valid task after the garbage")
    assert [(c.task_id, c.text) for c in calls] == [(good, "fine")]


async def test_body_failing_the_model_goes_to_dlq_as_invalid_payload_without_running(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    _, calls = await _recording_worker(make_app, start_worker, qname)
    await _publish_raw(amqp, qname, b'{"prompt": "wrong field"}', task_id=f"{qname}-invalid")

    dead = await next_message(amqp, dlq_name(qname))
    hdrs = _headers(dead)
    assert dead.message_id == f"{qname}-invalid"
    assert hdrs[h.DEAD_LETTER_REASON] == "invalid_payload"
    assert hdrs[h.ERROR_TYPE] == "weclaw_mq.InvalidPayload"
    assert "text" in hdrs[h.ERROR_MESSAGE]  # names the missing field
    assert hdrs[h.ATTEMPT] == 1
    assert calls == []


async def test_handler_raising_reject_goes_to_dlq_after_one_attempt(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    calls: list[Call] = []

    @app.handler(qname, retry=FAST)
    async def moderate(task: Prompt, ctx: Context) -> None:
        _record(calls, task, ctx)
        raise Reject("prompt violates policy")

    await start_worker(app)
    task_id = await app.publish(qname, Prompt(text="forbidden"))

    dead = await next_message(amqp, dlq_name(qname))
    hdrs = _headers(dead)
    assert dead.message_id == task_id
    assert hdrs[h.DEAD_LETTER_REASON] == "rejected"
    assert hdrs[h.ERROR_TYPE] == "weclaw_mq.Reject"
    assert hdrs[h.ERROR_MESSAGE] == "prompt violates policy"
    assert hdrs[h.ATTEMPT] == 1
    assert [c.attempt for c in calls] == [1]
    assert outcome_count(app, qname, "retried") == 0


async def test_handler_running_past_its_timeout_is_cancelled_and_retried(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    calls: list[Call] = []
    cancelled = asyncio.Event()

    @app.handler(qname, retry=FAST, timeout_s=0.3)
    async def slow(task: Prompt, ctx: Context) -> None:
        _record(calls, task, ctx)
        if ctx.attempt == 1:
            try:
                await asyncio.Event().wait()  # a model call that never answers
            except asyncio.CancelledError:
                cancelled.set()
                raise

    await start_worker(app)
    task_id = await app.publish(qname, Prompt(text="slow"))
    await wait_until(
        lambda: outcome_count(app, qname, "acked") == 1, 10, "the second attempt to ack"
    )

    assert cancelled.is_set(), "the timed-out attempt was not cancelled"
    assert [c.attempt for c in calls] == [1, 2]
    assert {c.task_id for c in calls} == {task_id}
    assert calls[1].started - calls[0].started >= 0.3
    assert calls[1].headers[h.ERROR_TYPE] == "weclaw_mq.HandlerTimeout"
    assert "0.3 s" in calls[1].headers[h.ERROR_MESSAGE]


async def test_follow_up_task_published_from_a_handler_keeps_the_trace_id(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    second_queue = f"{qname}-next"
    first: list[Call] = []
    second: list[Call] = []
    follow_up_ids: list[str] = []

    @app.handler(qname, retry=FAST)
    async def step_one(task: Prompt, ctx: Context) -> None:
        _record(first, task, ctx)
        follow_up_ids.append(await ctx.publish(second_queue, Prompt(text=task.text + " -> 2")))

    @app.handler(second_queue, retry=FAST)
    async def step_two(task: Prompt, ctx: Context) -> None:
        _record(second, task, ctx)

    await start_worker(app)
    task_id = await app.publish(qname, Prompt(text="chain"), trace_id="trace-chain")
    await wait_until(lambda: second, 10, "the follow-up task to run")

    assert [c.trace_id for c in first + second] == ["trace-chain", "trace-chain"]
    assert second[0].text == "chain -> 2"
    assert second[0].task_id == follow_up_ids[0] != task_id
    assert second[0].attempt == 1


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_log_records_inside_a_handler_carry_the_task_identifiers(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    capture = _Capture()
    capture.addFilter(TraceLogFilter())
    user_log = logging.getLogger(f"tests.user.{qname}")
    user_log.setLevel(logging.INFO)
    user_log.addHandler(capture)
    ctx_log = logging.getLogger("weclaw_mq.handler")
    old_level = ctx_log.level
    ctx_log.setLevel(logging.INFO)
    ctx_log.addHandler(capture)
    try:

        @app.handler(qname, retry=FAST)
        async def chatty(task: Prompt, ctx: Context) -> None:
            user_log.info("any logger: %s", task.text)
            ctx.logger.info("ctx logger: %s", task.text)
            if ctx.attempt == 1:
                raise RuntimeError("once more")

        user_log.info("outside any task")
        await start_worker(app)
        task_id = await app.publish(qname, Prompt(text="hi"), trace_id="trace-logs")
        await wait_until(lambda: outcome_count(app, qname, "acked") == 1, 10, "the retry to ack")
    finally:
        user_log.removeHandler(capture)
        ctx_log.removeHandler(capture)
        ctx_log.setLevel(old_level)

    outside = next(r for r in capture.records if r.name == user_log.name)
    assert outside.getMessage() == "outside any task"
    assert (outside.trace_id, outside.task_id, outside.queue, outside.attempt) == ("-",) * 4  # type: ignore[attr-defined]
    ids = [
        (r.trace_id, r.task_id, r.queue, r.attempt)  # type: ignore[attr-defined]
        for r in capture.records
        if r.getMessage().endswith(": hi")
    ]
    assert ids == [
        ("trace-logs", task_id, qname, 1),
        ("trace-logs", task_id, qname, 1),
        ("trace-logs", task_id, qname, 2),
        ("trace-logs", task_id, qname, 2),
    ]

"""Task lifetime (TTL) on the real broker and Redis: a task that outlives its ``ttl_s`` ends in
``Q.dlq`` with reason ``expired`` and the status ``expired``, whoever expires it (RabbitMQ at
the head of Q, RabbitMQ in a delay queue, or a worker that receives it late), and is never
silently dropped. A DLQ requeue gives it a fresh lifetime."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel

from tests.conftest import queue_depth, wait_until
from weclaw_mq import App, Context, RetryPolicy, TaskState, TaskStatus
from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_message import DeadLetter
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms, now_ms
from weclaw_mq.contract.naming import dlq_name, ladder_queue_name, lane_queue_name

# Where a task is published: extra publish arguments per variant. Priority lanes add theirs
# here (e.g. pytest.param({"priority": "urgent"}, id="urgent")), and every test below then
# runs on every lane too.
# Where a task is published: Q (NORMAL) and the highest lane, so expiry is checked on every
# kind of queue a task can wait in (each lane and its own delay queues dead-letter to Q.dlq).
ROUTES = [pytest.param({}, id="Q"), pytest.param({"priority": "urgent"}, id="urgent-lane")]


def _lane(queue: str, route: dict[str, Any]) -> str:
    return lane_queue_name(queue, route.get("priority", "normal"))


SHORT_TTL_S = 0.3
# Long enough that nothing in a test expires by it.
LONG_TTL_S = 3600.0
# The first retry comes long after SHORT_TTL_S: a retry would land past the deadline.
SLOW_RETRY = RetryPolicy(max_retries=3, delay_s=5.0)


async def _in_dlq(channel: AbstractChannel, queue: str, n: int = 1) -> None:
    """Wait until ``Q.dlq`` holds ``n`` messages (a broker's expiry or a worker's move)."""

    async def there() -> bool:
        return await queue_depth(channel, dlq_name(queue)) == n

    await wait_until(there, 10, what=f"{n} message(s) in {dlq_name(queue)}")


async def _expired_in_dlq(app: App, queue: str, task_id: str) -> DeadLetter:
    """The task's dead letter, once ``Q.dlq`` holds it, with its status ``expired``."""
    dead = await dlq.find(app, queue, task_id)
    assert dead is not None, f"{task_id} is not in {dlq_name(queue)}"
    assert dead.reason == "expired"
    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.EXPIRED
    final = await app.result(task_id, timeout_s=5)
    assert final.status is TaskStatus.EXPIRED
    return dead


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("by", ["publish", "handler_default"])
async def test_a_task_nobody_consumes_expires_at_the_head_of_q_into_the_dlq(
    make_app: Callable[..., App], amqp: AbstractChannel, qname: str, by: str, route: dict[str, Any]
) -> None:
    app = make_app()

    @app.handler(
        qname, priorities=True, ttl_s=SHORT_TTL_S if by == "handler_default" else LONG_TTL_S
    )
    async def never_runs(task: dict[str, int]) -> None:
        raise AssertionError("no worker consumes in this test")

    await app.declare()
    extra = {"ttl_s": SHORT_TTL_S} if by == "publish" else {}
    task_id = await app.publish(qname, {"n": 1}, **extra, **route)
    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.QUEUED
    assert state.expires_at is not None

    # RabbitMQ itself dead-letters it: no worker runs.
    await _in_dlq(amqp, qname)
    assert await queue_depth(amqp, qname) == 0
    dead = await _expired_in_dlq(app, qname, task_id)
    assert dead.by_broker and dead.original_queue == _lane(qname, route)
    assert dead.headers[h.TTL_MS] == SHORT_TTL_S * 1000


@pytest.mark.parametrize("route", ROUTES)
async def test_a_task_whose_retry_would_come_after_its_deadline_expires_at_once(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
    route: dict[str, Any],
) -> None:
    app = make_app()
    attempts: list[int] = []

    @app.handler(qname, priorities=True, retry=SLOW_RETRY)
    async def fails(task: dict[str, int]) -> None:
        attempts.append(1)
        raise RuntimeError("the model is down")

    await start_worker(app)
    # Long enough for the worker to take it on a loaded machine, far shorter than the retry.
    task_id = await app.publish(qname, {"n": 1}, ttl_s=2.0, **route)

    final = await app.result(task_id, timeout_s=10)
    assert (final.status, final.reason) == (TaskStatus.EXPIRED, "expired")
    dead = await _expired_in_dlq(app, qname, task_id)
    assert not dead.by_broker
    assert dead.error_type == "weclaw_mq.TaskExpired"
    assert dead.error_message is not None and "the model is down" in dead.error_message
    assert attempts == [1]


@pytest.mark.parametrize("route", ROUTES)
async def test_a_task_that_expires_in_a_delay_queue_is_expired_by_the_worker_on_return(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
    route: dict[str, Any],
) -> None:
    """RabbitMQ dead-letters it from the delay queue back to Q (reason expired) and strips
    its ``expiration`` on the way: the deadline header is all that is left, and the worker
    that receives it enforces it."""
    app = make_app()
    ran: list[str] = []

    @app.handler(qname, priorities=True, retry=SLOW_RETRY)
    async def handle(task: dict[str, int]) -> None:
        ran.append("ran")

    await start_worker(app)
    # A task as a worker parks it (a deferral, or an older version's retry), shortly before
    # its deadline; with its queued record, as publish writes it.
    task_id = f"delay-{qname}"
    message = app.prepare(qname, {"n": 1}, task_id=task_id, ttl_s=SHORT_TTL_S, **route)
    store = app.results
    assert store is not None and message.headers is not None
    deadline = as_datetime(deadline_ms(message.headers))
    await store.record(
        TaskState(task_id=task_id, queue=qname, status=TaskStatus.QUEUED, expires_at=deadline)
    )
    # Through the delay queue's exchange, with its lane as routing key, as a worker parks it.
    delay_queue = ladder_queue_name(5000)
    exchange = await amqp.get_exchange(delay_queue, ensure=False)
    await exchange.publish(message, routing_key=_lane(qname, route))

    await _in_dlq(amqp, qname)
    dead = await _expired_in_dlq(app, qname, task_id)
    assert not dead.by_broker and dead.error_type == "weclaw_mq.TaskExpired"
    deaths = dead.headers[h.X_DEATH]
    assert deaths[0]["queue"] == delay_queue
    assert deaths[0]["reason"] == "expired"
    assert deaths[0]["routing-keys"] == [_lane(qname, route)]
    assert ran == []


@pytest.mark.parametrize("route", ROUTES)
async def test_a_worker_that_receives_a_task_past_its_deadline_dead_letters_it_unrun(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
    route: dict[str, Any],
) -> None:
    app = make_app()
    ran: list[str] = []

    @app.handler(qname, priorities=True)
    async def handle(task: dict[str, int]) -> None:
        ran.append("ran")

    await start_worker(app)
    # A copy back from a delay queue: the deadline header, no expiration (the broker
    # removed it), and the deadline already behind it.
    late = app.prepare(qname, {"n": 1}, **route)
    assert late.headers is not None and late.message_id is not None
    late.headers[h.EXPIRES_AT] = now_ms() - 1_000
    late.expiration = None
    await amqp.default_exchange.publish(late, routing_key=_lane(qname, route))

    await _in_dlq(amqp, qname)
    dead = await _expired_in_dlq(app, qname, late.message_id)
    assert dead.headers[h.DEAD_LETTER_REASON] == "expired"
    assert dead.headers[h.ERROR_TYPE] == "weclaw_mq.TaskExpired"
    assert ran == []


async def test_a_requeued_expired_task_gets_a_fresh_lifetime_and_runs(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
) -> None:
    app = make_app()
    ran: list[int] = []

    @app.handler(qname, priorities=True, ttl_s=SHORT_TTL_S)
    async def handle(task: dict[str, int]) -> int:
        ran.append(task["n"])
        return task["n"]

    await app.declare()
    task_id = await app.publish(qname, {"n": 7})
    await _in_dlq(amqp, qname)
    await _expired_in_dlq(app, qname, task_id)
    await start_worker(app)

    requeued_at = time.time()
    assert await dlq.requeue(app, qname) == 1
    final = await app.result(task_id, timeout_s=10)

    assert (final.status, final.result) == (TaskStatus.SUCCEEDED, 7)
    assert ran == [7]
    # The record's new deadline is the fresh one, not the one that passed.
    assert final.expires_at is not None and final.expires_at.timestamp() >= requeued_at


@pytest.mark.parametrize("route", ROUTES)
async def test_a_task_within_its_lifetime_is_retried_and_keeps_its_deadline(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    route: dict[str, Any],
) -> None:
    app = make_app()
    deadlines: list[object] = []

    @app.handler(qname, priorities=True, retry=RetryPolicy(max_retries=1, delay_s=0.05))
    async def flaky(task: dict[str, int], ctx: Context) -> str:
        deadlines.append(ctx.headers.get(h.EXPIRES_AT))
        if ctx.attempt == 1:
            raise RuntimeError("once")
        return "ok"

    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1}, ttl_s=LONG_TTL_S, **route)

    final = await app.result(task_id, timeout_s=10)
    assert final.status is TaskStatus.SUCCEEDED
    assert len(deadlines) == 2 and deadlines[0] == deadlines[1] and isinstance(deadlines[0], int)


async def test_publish_many_gives_every_task_the_lifetime_and_a_deadline_in_its_record(
    make_app: Callable[..., App], amqp: AbstractChannel, qname: str
) -> None:
    app = make_app()

    @app.handler(qname, priorities=True)
    async def never_runs(task: dict[str, int]) -> None:
        raise AssertionError("no worker consumes in this test")

    await app.declare()
    ids = await app.publish_many(qname, [{"n": 1}, {"n": 2}], ttl_s=SHORT_TTL_S)

    await _in_dlq(amqp, qname, 2)
    for task_id in ids:
        await _expired_in_dlq(app, qname, task_id)


@pytest.mark.parametrize("idempotent", [True, False], ids=["claimed", "unclaimed"])
async def test_a_task_a_worker_took_in_time_runs_past_its_deadline_and_never_reads_expired(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, idempotent: bool
) -> None:
    app = make_app()
    started = asyncio.Event()
    go_on = asyncio.Event()

    @app.handler(qname, priorities=True, idempotent=idempotent)
    async def slow(task: dict[str, int]) -> str:
        started.set()
        await go_on.wait()
        return "late but done"

    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1}, ttl_s=SHORT_TTL_S)
    await asyncio.wait_for(started.wait(), 10)
    state = await app.status(task_id)
    assert state is not None and state.expires_at is not None
    deadline = state.expires_at.timestamp()
    await wait_until(lambda: time.time() > deadline, 10, what="the task's deadline to pass")

    running = await app.status(task_id)
    assert running is not None and running.status is TaskStatus.RUNNING
    go_on.set()
    final = await app.result(task_id, timeout_s=10)
    assert (final.status, final.result) == (TaskStatus.SUCCEEDED, "late but done")

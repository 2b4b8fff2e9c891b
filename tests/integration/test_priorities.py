"""Priorities on the real broker. This machine's RabbitMQ 3.10.8 has no quorum priorities, so
the default topology runs the lane plan: ``Q.lane.urgent``, ``Q.lane.high`` and Q, served by
``worker.lanes``; a classic handler queue runs the native plan (``x-max-priority``)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import queue_depth, wait_until
from tests.private_servers import PrivateRedis
from weclaw_mq import (
    App,
    Context,
    InvalidPriorityError,
    Priority,
    Reject,
    Retry,
    RetryPolicy,
    TaskStatus,
    UnroutableError,
)
from weclaw_mq.admin import dlq
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name, ladder_queue_name, lane_queue_name
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.wire.topology import dlq_arguments, queue_declarations

BACKLOG = 300
# Stands for the handler's work: long enough that a lane's next task reaches its spare
# consumer (one round trip) before the running one ends.
WORK_S = 0.01


class Job(BaseModel):
    n: int


def _levels_started(app: App, qname: str, started: list[str], *, work_s: float = WORK_S) -> None:
    @app.handler(qname, priorities=True, retry=RetryPolicy(max_retries=0, delay_s=0.05))
    async def work(task: Job, ctx: Context) -> None:
        started.append(str(ctx.headers.get(h.PRIORITY, "normal")))
        await asyncio.sleep(work_s)


async def _backlog(app: App, qname: str, normal: int, high: int, urgent: int) -> None:
    """Queued before any worker runs, NORMAL first: the worst case for the higher levels."""
    await app.declare()
    await app.publish_many(qname, [Job(n=i) for i in range(normal)])
    await app.publish_many(qname, [Job(n=i) for i in range(high)], priority="high")
    await app.publish_many(qname, [Job(n=i) for i in range(urgent)], priority=Priority.URGENT)


def _overtaken_before_last(started: list[str], level: str, lower: set[str]) -> int:
    """How many tasks of ``lower`` levels started before the last task of ``level``."""
    last = max(i for i, s in enumerate(started) if s == level)
    return sum(1 for s in started[:last] if s in lower)


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_under_a_backlog_urgent_starts_before_high_before_normal(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    concurrency: int,
) -> None:
    app = make_app(priority_starvation_limit=10_000)  # the rule is tested on its own below
    started: list[str] = []
    _levels_started(app, qname, started)
    high = urgent = 20
    await _backlog(app, qname, BACKLOG - high - urgent, high, urgent)

    await start_worker(app, concurrency=concurrency)
    await wait_until(
        lambda: started.count("urgent") == urgent and started.count("high") == high,
        30,
        "every HIGH and URGENT task to start",
    )

    # Only the first free slots (taken as tasks arrive) may go to a lower level: from then
    # on every freed slot goes to the highest lane with a task waiting.
    slack = concurrency + 2
    assert _overtaken_before_last(started, "urgent", {"high", "normal"}) <= slack, started
    assert _overtaken_before_last(started, "high", {"normal"}) <= slack, started
    assert started.count("normal") <= 2 * slack, started


async def test_a_worker_holds_at_most_concurrency_plus_one_task_per_lane(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    release = asyncio.Event()
    running: list[int] = []

    @app.handler(qname, priorities=True)
    async def work(task: Job) -> None:
        running.append(task.n)
        await release.wait()

    await _backlog(app, qname, 100, 10, 10)
    concurrency, lanes = 3, 3
    await start_worker(app, concurrency=concurrency)
    await wait_until(lambda: len(running) == concurrency, 10, "the slots to fill")

    names = [qname, lane_queue_name(qname, "high"), lane_queue_name(qname, "urgent")]

    async def held_and_consumers() -> tuple[int, int]:
        ready = consumers = 0
        for name in names:
            result = (await amqp.declare_queue(name, passive=True)).declaration_result
            ready += result.message_count or 0
            consumers += result.consumer_count or 0
        return 120 - ready, consumers

    # Each lane consumer has prefetch 1: consumers bound what the worker holds.
    await wait_until(
        lambda: _equals(held_and_consumers(), (concurrency + lanes, concurrency + lanes)),
        10,
        "each lane's spare consumer to take its one waiting task",
    )
    release.set()


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def _at_least(value: Awaitable[int], least: int) -> bool:
    return await value >= least


async def _parked_in_the_lanes_shared_delay_queue(
    amqp: AbstractChannel, qname: str, delay_ms: int
) -> None:
    """The task's copy waits in the vhost's delay queue, which every lane shares: it goes back
    by its routing key, its lane (``_returned_to``). Other tests may park there too: at
    least ours, and not in any lane."""
    await wait_until(
        lambda: _at_least(queue_depth(amqp, ladder_queue_name(delay_ms)), 1),
        5,
        "the copy in the delay queue",
    )


def _returned_to(headers: Mapping[str, Any]) -> list[Any] | None:
    """The routing keys a delivery was dead-lettered back by (its last x-death), if any."""
    deaths = headers.get(h.X_DEATH)
    return deaths[0]["routing-keys"] if deaths else None


async def test_normal_is_not_starved_one_lower_task_after_k_higher_ones(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
) -> None:
    k = 3
    app = make_app(priority_starvation_limit=k)
    started: list[str] = []
    _levels_started(app, qname, started)
    await _backlog(app, qname, 10, 0, 40)

    await start_worker(app, concurrency=1)
    await wait_until(lambda: started.count("normal") >= 6, 20, "six NORMAL starts")

    normal_at = [i for i, s in enumerate(started) if s == "normal"]
    # While URGENT tasks keep waiting, NORMAL still gets one start after at most K urgent
    # ones (+1: the start during which its own next task was still on its way).
    assert normal_at[0] <= k + 2, started
    gaps = [b - a - 1 for a, b in itertools.pairwise(normal_at)]
    assert all(gap <= k + 1 for gap in gaps), started
    assert "urgent" in started[normal_at[-1] :] or started.count("urgent") < 40, started


async def test_a_retried_task_waits_in_its_lanes_delay_queue_and_keeps_its_priority(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    seen: list[tuple[int, Any]] = []
    policy = RetryPolicy(max_retries=1, delay_s=1.0, multiplier=1)

    @app.handler(qname, priorities=True, retry=policy)
    async def work(task: Job, ctx: Context) -> None:
        seen.append((ctx.attempt, ctx.headers.get(h.PRIORITY), _returned_to(ctx.headers)))
        if ctx.attempt == 1:
            raise Retry("model busy")

    await start_worker(app, concurrency=1)
    task_id = await app.publish(qname, Job(n=1), priority="high")

    await _parked_in_the_lanes_shared_delay_queue(amqp, qname, 1000)

    state = await app.result(task_id, timeout_s=10)
    assert state.status is TaskStatus.SUCCEEDED
    high = lane_queue_name(qname, "high")
    assert seen == [(1, "high", None), (2, "high", [high])]


async def test_a_dlq_redrive_sends_the_task_back_to_its_lane(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()

    @app.handler(qname, priorities=True)
    async def work(task: Job) -> None:
        raise Reject("not now")

    worker = await start_worker(app, concurrency=1)
    await app.publish(qname, Job(n=1), priority=Priority.URGENT)
    await wait_until(lambda: _equals(queue_depth(amqp, dlq_name(qname)), 1), 10, "the dead letter")
    worker.stop()
    await wait_until(lambda: not worker.ready.is_set(), 10, "the worker to stop")

    assert await dlq.requeue(app, qname) == 1

    assert await queue_depth(amqp, lane_queue_name(qname, "urgent")) == 1
    assert await queue_depth(amqp, qname) == 0


async def test_a_classic_handler_queue_orders_by_native_priority(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    started: list[str] = []

    @app.handler(qname, queue_type="classic", priority="high")
    async def work(task: Job, ctx: Context) -> None:
        started.append(str(ctx.headers.get(h.PRIORITY, "normal")))

    await app.declare()
    await app.publish_many(qname, [Job(n=i) for i in range(20)], priority="normal")
    await app.publish_many(qname, [Job(n=i) for i in range(2)])  # the handler's default
    await app.publish(qname, Job(n=0), priority="urgent")

    await start_worker(app, concurrency=1)
    await wait_until(lambda: len(started) == 23, 10, "every task")
    assert started[:3] == ["urgent", "high", "high"], started
    # No lanes: one classic queue with x-max-priority.
    with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
        await amqp.declare_queue(lane_queue_name(qname, "high"), passive=True)


async def test_an_unknown_priority_is_refused_before_anything_is_sent(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    app = make_app()

    @app.handler(qname, priorities=True)
    async def work(task: Job) -> None:
        return None

    await app.declare()
    with pytest.raises(InvalidPriorityError):
        await app.publish(qname, Job(n=1), priority="critical")
    with pytest.raises(ValueError, match="priority"):
        await app.publish_many(qname, [Job(n=1)], priority=3)  # type: ignore[arg-type]
    assert await queue_depth(amqp, qname) == 0


async def test_an_upgrade_from_the_topology_without_lanes_only_adds_queues(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    """Today's topology is exactly what a broker with native priorities gets (no lanes):
    an existing deployment's Q, delay queues and DLQ keep their arguments, a worker of this
    version declares the lanes beside them, and old producers' tasks are NORMAL."""
    app = make_app()
    seen: list[Any] = []

    @app.handler(qname, priorities=True)
    async def work(task: Job, ctx: Context) -> None:
        seen.append(ctx.headers.get(h.PRIORITY))

    spec = app.handlers[qname].queue_spec()
    # The queues of a deployment from before priorities: Q, its delay queues, its DLQ.
    for name, args in queue_declarations(spec, ServerVersion(4, 3, 0)):
        if name == dlq_name(qname):
            args = dlq_arguments(ServerVersion(3, 10, 8))
        await amqp.declare_queue(name, durable=True, arguments=args)  # type: ignore[arg-type]
        assert not name.startswith(lane_queue_name(qname, "high"))
    # A producer sending priorities before any worker upgraded: refused, nothing lost.
    with pytest.raises(UnroutableError, match="declare"):
        await app.publish(qname, Job(n=1), priority="high")
    # An old producer's task, queued before the upgrade.
    await amqp.default_exchange.publish(
        aio_pika.Message(b'{"n": 7}', message_id="old-1", delivery_mode=2), routing_key=qname
    )

    await start_worker(app, concurrency=1)  # declares: no PRECONDITION_FAILED on Q
    await wait_until(lambda: len(seen) == 1, 10, "the old task")
    assert seen == [None]  # no header: NORMAL
    await app.publish(qname, Job(n=2), priority="high")
    await wait_until(lambda: len(seen) == 2, 10, "a HIGH task through the new lane")
    assert seen[1] == "high"


class TestDeferral:
    """A task deferred (its guard cannot be claimed: Redis is down, the default ``defer``
    policy) waits in its own lane's delay queue. Redis is the test's own."""

    @pytest.fixture
    def redis_url(self, private_redis: PrivateRedis) -> str:
        return private_redis.url

    async def test_a_deferred_task_waits_in_its_lanes_delay_queue_and_keeps_its_priority(
        self,
        make_app: Callable[..., App],
        start_worker: Callable[..., Any],
        qname: str,
        amqp: AbstractChannel,
        private_redis: PrivateRedis,
    ) -> None:
        app = make_app(result_store_patience_s=30)
        seen: list[Any] = []

        @app.handler(
            qname, priorities=True, retry=RetryPolicy(max_retries=1, delay_s=1.0, multiplier=1)
        )
        async def work(task: Job, ctx: Context) -> None:
            seen.append((ctx.headers.get(h.PRIORITY), _returned_to(ctx.headers)))

        await start_worker(app, concurrency=1)
        await asyncio.to_thread(private_redis.stop)
        task_id = await app.publish(qname, Job(n=1), priority="urgent")

        await _parked_in_the_lanes_shared_delay_queue(amqp, qname, 1000)
        assert seen == []

        await asyncio.to_thread(private_redis.start)
        assert (await app.result(task_id, timeout_s=15)).status is TaskStatus.SUCCEEDED
        # Its last return came by the delay queue, to its lane (it may have hopped more
        # than once while Redis was down).
        assert seen == [("urgent", [lane_queue_name(qname, "urgent")])]

"""The circuit breaker on the real broker: an upstream that is down for a few seconds pauses the
queue (its consumers cancelled, every lane's), a probe after each cool-down, and the queue
closes and consumes again once the upstream answers; no task reaches the DLQ because of the
outage, and the attempts it cost stay within ``Breaker.attempts_bound``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import (
    close_connections,
    consuming_connection,
    outcome_count,
    queue_depth,
    wait_until,
)
from weclaw_mq import App, Breaker, Context, RetryPolicy, UpstreamDown
from weclaw_mq.console.overview import Overview
from weclaw_mq.contract.naming import dlq_name, lane_queue_name

OUTAGE_S = 6.0
TASKS = 10
CONCURRENCY = 2
BREAKER = Breaker(failures=3, window_s=10.0, cooldown_s=1.5)


class Job(BaseModel):
    n: int


async def consumer_count(channel: AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    count = declared.declaration_result.consumer_count
    assert count is not None
    return count


def breaker_sample(app: App, name: str, labels: dict[str, str]) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


async def _equals(value: Awaitable[dict[str, int]], options: tuple[dict[str, int], ...]) -> bool:
    return await value in options


# quorum: this broker (3.10) runs priority lanes (worker.lanes); classic: one consumer.
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_an_outage_pauses_the_queue_probes_and_closes_without_dead_letters(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
    queue_type: str,
) -> None:
    app = make_app(worker_beat_s=0.2)  # the heartbeat says which breakers are open
    loop = asyncio.get_running_loop()
    recovered_at: list[float] = []  # when the upstream answers again (first call + OUTAGE_S)
    failed: list[int] = []
    done: dict[int, int] = {}  # task -> the attempt it succeeded at

    # Three attempts at 0.3 s apart: without the breaker, each task would spend them all
    # within a second of the outage and land in the DLQ.
    @app.handler(
        qname,
        retry=RetryPolicy(max_retries=2, delay_s=0.3, multiplier=1.0),
        breaker=BREAKER,
        queue_type=queue_type,
        priorities=queue_type == "quorum",  # lanes exist only for handlers that take priorities
    )
    async def call_model(task: Job, ctx: Context) -> int:
        if not recovered_at:
            recovered_at.append(loop.time() + OUTAGE_S)
        await asyncio.sleep(0.05)
        if loop.time() < recovered_at[0]:
            failed.append(task.n)
            raise UpstreamDown("503 from the model API")
        done[task.n] = ctx.attempt
        return task.n

    await app.declare()
    await app.publish_many(qname, [Job(n=i) for i in range(TASKS)])
    await start_worker(app, concurrency=CONCURRENCY)
    queues = [qname]
    if queue_type == "quorum":
        queues += [lane_queue_name(qname, "high"), lane_queue_name(qname, "urgent")]

    async def paused() -> bool:
        return all([await consumer_count(amqp, q) == 0 for q in queues])

    await wait_until(paused, 5, what="every consumer of the queue cancelled by the breaker")
    state = {"queue": qname, "state": "open"}
    assert breaker_sample(app, "weclaw_mq_breaker_state", state) == 1
    assert loop.time() < recovered_at[0], "the pause must come during the outage"
    overview = Overview(app, fresh_s=0)

    async def breaker_states() -> dict[str, int]:
        rows = (await overview.document())["queues"]
        return dict(rows[0]["breaker_states"])

    # The console's overview shows it, from the worker's heartbeat (open, or half open
    # while a probe runs).
    await wait_until(
        lambda: _equals(breaker_states(), ({"open": 1}, {"half_open": 1})),
        5,
        "the overview showing the open breaker",
    )

    await wait_until(lambda: len(done) == TASKS, OUTAGE_S + 10, what="every task done")

    async def consuming() -> bool:
        return all([await consumer_count(amqp, q) >= 1 for q in queues])

    await wait_until(consuming, 5, what="the consumers back after the breaker closed")
    assert breaker_sample(app, "weclaw_mq_breaker_state", {"queue": qname, "state": "closed"}) == 1
    await wait_until(lambda: _equals(breaker_states(), ({},)), 5, "the overview: closed")
    # Opened once, then reopened by at least one failed probe (the outage outlasts a cool-down).
    assert breaker_sample(app, "weclaw_mq_breaker_opened_total", {"queue": qname}) >= 2
    assert outcome_count(app, qname, "dead_lettered") == 0
    assert await queue_depth(amqp, dlq_name(qname)) == 0
    bound = BREAKER.attempts_bound(CONCURRENCY, OUTAGE_S)
    print(f"failed attempts during the outage: {len(failed)} (bound {bound})")
    assert BREAKER.failures <= len(failed) <= bound, (len(failed), bound)
    # Tasks parked or given back while the breaker was open spent no attempt: each succeeded
    # at the attempt after its failures (a parked one would show a higher number).
    assert done == {n: 1 + failed.count(n) for n in range(TASKS)}


async def test_an_open_breaker_outlives_a_reconnect_and_a_stop_leaves_every_task_queued(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
) -> None:
    app = make_app(qname)
    calls: list[int] = []

    @app.handler(
        qname,
        retry=RetryPolicy(max_retries=5, delay_s=0.2, multiplier=1.0),
        breaker=Breaker(failures=2, window_s=10.0, cooldown_s=60.0),
        queue_type="classic",  # one consumer: the reconnect consumes it again
    )
    async def call_model(task: Job) -> None:
        calls.append(task.n)
        raise UpstreamDown("the model API is down")

    await app.declare()
    await app.publish_many(qname, [Job(n=i) for i in range(TASKS)])
    worker = await start_worker(app, concurrency=CONCURRENCY)

    async def paused() -> bool:
        return await consumer_count(amqp, qname) == 0

    await wait_until(paused, 5, what="the queue paused by the breaker")
    spent = len(calls)
    assert spent <= Breaker(failures=2).attempts_bound(CONCURRENCY, 0.0)

    # The connection dies: the new session starts consuming, and the open breaker pauses it.
    assert await asyncio.to_thread(close_connections, consuming_connection(qname)) == 1
    reconnects = {"role": "worker"}
    await wait_until(
        lambda: (
            breaker_sample(app, "weclaw_mq_reconnects_total", reconnects) >= 1
            and worker.ready.is_set()
        ),
        10,
        what="the worker reconnected",
    )
    await wait_until(paused, 5, what="the queue paused again after the reconnect")
    assert breaker_sample(app, "weclaw_mq_breaker_state", {"queue": qname, "state": "open"}) == 1
    assert len(calls) == spent, "no handler may run while the breaker is open"

    worker.stop()

    async def all_queued() -> bool:
        return worker.in_flight == 0 and await queue_depth(amqp, qname) == TASKS

    # Each task is in Q: never run, or back from its delay queue (retried once at most).
    await wait_until(all_queued, 5, what="every task back in its queue")
    assert await queue_depth(amqp, dlq_name(qname)) == 0

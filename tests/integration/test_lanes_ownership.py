"""One owner per lane consumer, and the net for a delivery held without a handler (issue 24
item 4: a worker showed two complete consumer sets, one of them holding C + 1 tasks that no
scheduler ran). On the real broker: a consumer that no scheduler owns is cancelled and its
tasks run elsewhere; a delivery held unstarted while a slot is free is given back, logged
and counted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import wait_until
from weclaw_mq import App
from weclaw_mq.contract.naming import lane_queue_name
from weclaw_mq.worker.incoming import consume
from weclaw_mq.worker.lane_consumers import BULK_TAG

CONCURRENCY = 2
LANES = 3


class Job(BaseModel):
    n: int


async def _consumers(amqp: AbstractChannel, qname: str) -> int:
    total = 0
    for name in (qname, lane_queue_name(qname, "high"), lane_queue_name(qname, "urgent")):
        result = (await amqp.declare_queue(name, passive=True)).declaration_result
        total += result.consumer_count or 0
    return total


async def test_a_bulk_consumer_no_scheduler_owns_is_cancelled_and_its_tasks_run(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    done: set[int] = set()

    @app.handler(qname, priorities=True)
    async def work(task: Job) -> None:
        done.add(task.n)

    worker = await start_worker(app, concurrency=CONCURRENCY)
    await wait_until(lambda: _is(_consumers(amqp, qname), LANES), 10, "bulk mode")
    scheduler = worker._schedulers[0]
    assert scheduler.bulk and scheduler._consumers.bulk_queue is not None
    # A second bulk consumer on the worker's bulk channel that the scheduler did not open:
    # the orphaned set of the report (prefetch C + 1, the scheduler's callback).
    await consume(
        scheduler._consumers.bulk_queue, scheduler._on_bulk, consumer_tag=f"{BULK_TAG}stray"
    )
    assert await _consumers(amqp, qname) == LANES + 1

    tasks = 40
    await app.publish_many(qname, [Job(n=i) for i in range(tasks)])
    await wait_until(lambda: done == set(range(tasks)), 20, "every task to run")
    # The stray consumer was cancelled at its first delivery; the worker's own set remains.
    await wait_until(lambda: _is(_consumers(amqp, qname), LANES), 10, "the stray consumer to go")


async def test_a_delivery_held_unstarted_while_a_slot_is_free_is_given_back(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(held_delivery_s=0.5)
    done: set[int] = set()

    @app.handler(qname, priorities=True)
    async def work(task: Job) -> None:
        done.add(task.n)

    worker = await start_worker(app, concurrency=CONCURRENCY)
    scheduler = worker._schedulers[0]
    # An injected scheduler bug: nothing is chosen to start, so the delivery waits with
    # every slot free (what the report's orphaned consumer did to its C + 1 tasks).
    stalled = asyncio.Event()
    stalled.set()
    choose = scheduler._choose

    def stuck_choose() -> str | None:
        return None if stalled.is_set() else choose()

    scheduler._choose = stuck_choose  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="weclaw_mq.worker")
    [task_id] = await app.publish_many(qname, [Job(n=1)])
    counter = app.metrics.held_deliveries.labels(qname)
    await wait_until(lambda: counter.value >= 1, 10, "the held delivery to be given back")
    warnings = [r.getMessage() for r in caplog.records]
    assert any(task_id in w and "held" in w for w in warnings), warnings
    assert done == set()
    stalled.clear()
    scheduler._fill()  # the next sweep or delivery would; no need to wait for it
    await wait_until(lambda: done == {1}, 10, "the given-back task to run")


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)

"""The lanes' bulk mode (``worker.lanes``) on the real broker: while the upper lanes are quiet
the lowest lane is served by one prefetch-(C + 1) consumer. The bound holds (counted on the
broker), an URGENT task published into a busy bulk-mode worker starts at the next completion,
the switches to per-consumer mode and back lose nothing and run nothing twice, and a lost
connection in bulk mode loses nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import close_connections, consuming_connection, wait_until
from weclaw_mq import App, Priority
from weclaw_mq.contract.naming import lane_queue_name

CONCURRENCY = 3
LANES = 3


class Job(BaseModel):
    n: int


def _names(qname: str) -> list[str]:
    return [qname, lane_queue_name(qname, "high"), lane_queue_name(qname, "urgent")]


async def _ready_and_consumers(amqp: AbstractChannel, qname: str) -> tuple[int, int]:
    ready = consumers = 0
    for name in _names(qname):
        result = (await amqp.declare_queue(name, passive=True)).declaration_result
        ready += result.message_count or 0
        consumers += result.consumer_count or 0
    return ready, consumers


async def test_bulk_mode_holds_the_bound_and_an_urgent_task_starts_at_the_next_completion(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    started: list[tuple[str, int]] = []
    finished: list[tuple[str, int]] = []
    tokens: asyncio.Queue[None] = asyncio.Queue()

    @app.handler(qname, priorities=True)
    async def work(task: Job) -> None:
        level = "urgent" if task.n >= 1000 else "normal"
        started.append((level, task.n))
        await tokens.get()  # each token lets one running task finish
        finished.append((level, task.n))

    normal = 40
    await app.declare()
    await app.publish_many(qname, [Job(n=i) for i in range(normal)])
    await start_worker(app, concurrency=CONCURRENCY)
    await wait_until(lambda: len(started) == CONCURRENCY, 10, "the slots to fill")

    published = [normal]

    async def state() -> tuple[int, int]:
        """Messages the worker holds (running included), consumers."""
        ready, consumers = await _ready_and_consumers(amqp, qname)
        return published[0] - ready, consumers

    # Bulk mode: one consumer holds C + 1 NORMAL tasks, each upper lane has one armed.
    await wait_until(
        lambda: _equals(state(), (CONCURRENCY + 1, LANES)), 10, "bulk mode to hold C + 1"
    )

    # An URGENT task into the busy worker: held by its lane's consumer, it starts as the
    # next slot frees (the bulk consumer's waiting NORMAL task does not overtake it).
    await app.publish(qname, Job(n=1000), priority=Priority.URGENT)
    published[0] += 1
    await wait_until(
        lambda: _equals(state(), (CONCURRENCY + 2, LANES)),
        10,
        "the URGENT task to be held",
    )
    tokens.put_nowait(None)
    await wait_until(lambda: len(started) == CONCURRENCY + 1, 10, "the next start")
    assert started[-1] == ("urgent", 1000), started

    # Per-consumer mode now; every task ends, once each.
    for _ in range(normal + 1):
        tokens.put_nowait(None)
    await wait_until(lambda: len(finished) == normal + 1, 20, "every task to finish")

    # Idle, upper lanes quiet: back to bulk mode (three consumers), then a second batch.
    await wait_until(
        lambda: _equals(_ready_and_consumers(amqp, qname), (0, LANES)),
        10,
        "bulk mode again",
    )
    await app.publish_many(qname, [Job(n=i) for i in range(normal, 2 * normal)])
    for _ in range(normal):
        tokens.put_nowait(None)
    await wait_until(lambda: len(finished) == 2 * normal + 1, 20, "the second batch")
    counts = Counter(n for _, n in started)
    assert set(counts) == set(range(2 * normal)) | {1000}
    assert max(counts.values()) == 1, counts


async def test_a_connection_lost_in_bulk_mode_loses_no_task(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app(qname)
    finished: set[int] = set()
    gate = asyncio.Event()

    @app.handler(qname, priorities=True)
    async def work(task: Job) -> None:
        await gate.wait()
        finished.add(task.n)

    tasks = 30
    await app.declare()
    await app.publish_many(qname, [Job(n=i) for i in range(tasks)])
    worker = await start_worker(app, concurrency=CONCURRENCY)
    await wait_until(
        lambda: _equals(_ready_and_consumers(amqp, qname), (tasks - CONCURRENCY - 1, LANES)),
        10,
        "bulk mode to hold C + 1",
    )
    assert await asyncio.to_thread(close_connections, consuming_connection(qname)) == 1
    gate.set()
    # The held tasks go back (their acks cannot be sent); the new session consumes in bulk
    # mode again and every task finishes.
    await wait_until(lambda: finished == set(range(tasks)), 20, "every task to finish")
    await wait_until(
        lambda: _equals(_ready_and_consumers(amqp, qname), (0, LANES)),
        10,
        "bulk mode after the reconnect",
    )
    assert worker.ready.is_set()


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)

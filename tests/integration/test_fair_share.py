"""Fair share across tenants on the real broker and Redis: a tenant's backlog holds one lane,
another tenant's task starts within concurrency + 1 completions (``policy.fair_share``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import close_apps, outcome_count, queue_depth, settings_for, wait_until
from weclaw_mq import App, Priority
from weclaw_mq.contract.naming import dlq_name, fair_key, fair_lane_name, fair_tenant_key
from weclaw_mq.policy.fair_share import Fair, hashed_lane
from weclaw_mq.state.fair_book import FairBook, MemoryFairBook, RedisFairBook

# Long enough that a lane's next task reaches its spare consumer before the running one ends,
# and that a published task reaches its worker within one completion (a few ms under load).
WORK_S = 0.05


class Ask(BaseModel):
    tenant: str
    n: int = 0


def _recording(
    app: App, qname: str, events: list[tuple[str, str]], fair: Fair | None, **options: Any
) -> None:
    """A handler that logs ("start" | "end", tenant) for every task, in order."""

    @app.handler(qname, tenant=lambda task: task.tenant, fair=fair, **options)
    async def answer(task: Ask) -> None:
        events.append(("start", task.tenant))
        await asyncio.sleep(WORK_S)
        events.append(("end", task.tenant))


def _completions_before_start(
    events: list[tuple[str, str]], before: int, queued: int, tenant: str
) -> int:
    """Tasks that ended after ``queued`` (an index into ``events``: when the publish was
    confirmed) before ``tenant``'s first start after ``before`` (when it was published)."""
    start = events.index(("start", tenant), before)
    return sum(1 for kind, _ in events[queued:start] if kind == "end")


def _started_since(events: list[tuple[str, str]], before: int, *tenants: str) -> bool:
    return all(("start", t) in events[before:] for t in tenants)


async def _small_behind_big(
    app: App,
    qname: str,
    events: list[tuple[str, str]],
    start_worker: Callable[..., Any],
    backlog: int,
    concurrency: int,
) -> int:
    """Queue ``backlog`` tasks of "big", start a worker, and once it is under way publish one
    task of "small": the completions between that publish's confirm and its start."""
    await app.declare()
    await app.publish_many(qname, [Ask(tenant="big", n=i) for i in range(backlog)])
    await start_worker(app, concurrency=concurrency)
    await wait_until(lambda: len(events) >= backlog // 5, 20, "the backlog to be under way")
    # Counted from the broker's confirm: from when the task is queued.
    before = len(events)
    await app.publish(qname, Ask(tenant="small"))
    queued = len(events)
    await wait_until(lambda: _started_since(events, before, "small"), 30, "the small task")
    return _completions_before_start(events, before, queued, "small")


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_another_tenants_task_starts_within_concurrency_plus_one_completions(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    concurrency: int,
) -> None:
    app = make_app()
    events: list[tuple[str, str]] = []
    _recording(app, qname, events, Fair(lanes=4))
    waited = await _small_behind_big(app, qname, events, start_worker, 200, concurrency)
    assert waited <= concurrency + 1, events
    # The backlog is still there: the task did not just come after it.
    assert sum(1 for kind, who in events if kind == "start" and who == "big") < 150


async def test_without_fair_share_the_task_waits_for_the_backlog(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
) -> None:
    """The control: the same run on one queue, so the bound above is fair share's doing."""
    app = make_app()
    events: list[tuple[str, str]] = []
    _recording(app, qname, events, None)
    assert await _small_behind_big(app, qname, events, start_worker, 100, 4) >= 70


async def test_priorities_come_before_fair_lanes(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
) -> None:
    app = make_app()
    events: list[tuple[str, str]] = []
    _recording(app, qname, events, Fair(lanes=3), priorities=True)
    await app.declare()
    await app.publish_many(qname, [Ask(tenant="big", n=i) for i in range(200)])
    await app.publish_many(qname, [Ask(tenant="other", n=i) for i in range(100)])
    concurrency = 2
    await start_worker(app, concurrency=concurrency)
    await wait_until(lambda: len(events) >= 40, 20, "the backlogs to be under way")
    # Both backlogs take turns: neither waits for the other to drain.
    started = [who for kind, who in events if kind == "start"]
    assert {"big", "other"} <= set(started[:12]), started[:12]

    before = len(events)
    await asyncio.gather(
        app.publish(qname, Ask(tenant="vip"), priority=Priority.URGENT),
        app.publish(qname, Ask(tenant="small")),
    )
    queued = len(events)
    await wait_until(
        lambda: _started_since(events, before, "vip", "small"), 20, "the vip and small tasks"
    )
    after = events[before:]
    assert _completions_before_start(events, before, queued, "vip") <= concurrency + 1, after
    assert _completions_before_start(events, before, queued, "small") <= concurrency + 2, after


async def test_a_worker_writes_the_brokers_lane_counts_for_the_producers(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
    redis_url: str,
) -> None:
    app = make_app()
    release = asyncio.Event()

    @app.handler(qname, tenant=lambda task: task.tenant, fair=Fair(lanes=3))
    async def answer(task: Ask) -> None:
        await release.wait()

    await app.declare()
    await app.publish_many(qname, [Ask(tenant="big", n=i) for i in range(30)])
    await app.publish_many(qname, [Ask(tenant="mid", n=i) for i in range(10)])
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        # Counted by the producers as they published: "big" first into Q (all empty, Q on
        # a tie), "mid" into the next empty lane.
        book = await client.hgetall(fair_key(qname))
        assert {k: int(v) for k, v in book.items()} == {"n:0": 30, "n:1": 10}

        await start_worker(app, concurrency=2)

        async def ready(index: int) -> int:
            queue = await amqp.declare_queue(fair_lane_name(qname, index), passive=True)
            return int(queue.declaration_result.message_count or 0)

        async def book_is_the_brokers() -> bool:
            counts = [await ready(i) for i in range(3)]
            book = await client.hgetall(fair_key(qname))
            written = [int(book.get(f"n:{i}", -1)) for i in range(3)]
            # The worker holds some (running and one waiting per lane): below what was sent.
            return written == counts and counts[0] < 30 and counts[1] < 10

        await wait_until(book_is_the_brokers, 10, "the book to hold the broker's counts")
    finally:
        release.set()
        await client.aclose()


async def test_with_redis_away_a_publish_hashes_the_tenant_and_loses_nothing(
    broker_url: str,
    redis_url: str,
    qname: str,
    amqp: AbstractChannel,
) -> None:
    # Results on, in a Redis that is not there: the fair book cannot answer.
    app = App("test", settings=settings_for(broker_url, "redis://127.0.0.1:1/0"))

    @app.handler(qname, tenant=lambda task: task.tenant, fair=Fair(lanes=4), idempotent=False)
    async def answer(task: Ask) -> None:
        return None

    try:
        await app.declare()
        tenants = ["acme", "globex", "initech", "umbrella"]
        for tenant in tenants:
            await app.publish(qname, Ask(tenant=tenant))
        expected = [0, 0, 0, 0]
        for tenant in tenants:
            expected[hashed_lane(tenant, 4)] += 1
        counts = []
        for index in range(4):
            queue = await amqp.declare_queue(fair_lane_name(qname, index), passive=True)
            counts.append(int(queue.declaration_result.message_count or 0))
        assert counts == expected
        assert len(set(hashed_lane(t, 4) for t in tenants)) > 1  # not all in one lane
    finally:
        await close_apps([app], broker_url, redis_url)


async def _book_rules(book: FairBook, queue: str) -> None:
    assert await book.assign(queue, 4, ["big"] * 3, 60_000) == [0, 0, 0]
    assert await book.assign(queue, 4, ["small", "mid", "big"], 60_000) == [1, 2, 0]
    # Every lane busy: a new tenant shares the least loaded one (small's, 1 task).
    assert await book.assign(queue, 4, ["x"], 60_000) == [3]
    assert await book.assign(queue, 4, ["y"], 60_000) == [1]
    # The broker says Q emptied: big's next task takes the emptiest lane (Q again).
    await book.counted(queue, [0, 2, 1, 1], 60_000)
    assert await book.assign(queue, 4, ["big"], 60_000) == [0]
    await book.counted(queue, [5, 0, 1, 1], 60_000)
    assert await book.assign(queue, 4, ["big", "z"], 60_000) == [0, 1]


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_the_fair_book_keeps_a_tenant_on_its_lane_while_it_has_tasks_waiting(
    redis_url: str, qname: str, kind: str
) -> None:
    """The same rules in Redis (one script for every producer) and in one process."""
    if kind == "memory":
        await _book_rules(MemoryFairBook(), qname)
        return
    client = aioredis.Redis.from_url(redis_url)
    try:
        await _book_rules(RedisFairBook(client), qname)
        assert 0 < await client.pttl(fair_key(qname)) <= 60_000
        assert 0 < await client.pttl(fair_tenant_key(qname, "big")) <= 60_000
    finally:
        keys = [k async for k in client.scan_iter(f"{fair_key(qname)}*")]
        await client.delete(*keys)
        await client.aclose()


async def test_a_producer_reuses_a_tenants_lane_and_still_counts_every_task(
    make_app: Callable[..., App], qname: str, redis_url: str
) -> None:
    """One round trip for a tenant's first publish; the next ones within a second reuse its
    lane and add to the book's count in the background, and another producer agrees."""
    first, second = make_app(), make_app()
    for app in (first, second):

        @app.handler(qname, tenant=lambda task: task.tenant, fair=Fair(lanes=3))
        async def answer(task: Ask) -> None: ...

    await first.declare()
    await first.publish(qname, Ask(tenant="busy"))  # Q: all lanes empty
    await first.publish(qname, Ask(tenant="other"))  # the next empty lane
    for _ in range(9):
        await first.publish(qname, Ask(tenant="busy"))
    await second.publish(qname, Ask(tenant="busy"))  # asks the book: still Q
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:

        async def counted() -> bool:
            book = await client.hgetall(fair_key(qname))
            return {k: int(v) for k, v in book.items()} == {"n:0": 11, "n:1": 1}

        await wait_until(counted, 5, "every publish counted in the book")
    finally:
        await client.aclose()


async def test_busy_tenants_turns_give_no_task_back_to_its_queue(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    """Four backlogs and a handler that returns at once: the lanes' turns are as fast as they
    get. No delivery goes back to its queue: each return counts toward the delivery limit
    (returns showed in the benchmark's process, 11 and one dead letter in 3,000, and in a
    loaded suite run, 7; the model test ``FairOnlyLanesModel`` checks it for any timing)."""
    app = make_app()
    done: list[str] = []

    @app.handler(qname, tenant=lambda task: task.tenant, fair=Fair(lanes=4), idempotent=False)
    async def answer(task: Ask) -> None:
        done.append(task.tenant)

    await app.declare()
    for tenant in ("a", "b", "c", "d"):
        await app.publish_many(qname, [Ask(tenant=tenant, n=i) for i in range(750)])
    await start_worker(app, concurrency=10)
    # acked, not run: a handler returns before its ack is counted
    await wait_until(lambda: outcome_count(app, qname, "acked") == 3000, 90, "every task acked")
    assert outcome_count(app, qname, "requeued") == 0
    assert len(done) == 3000
    assert await queue_depth(amqp, dlq_name(qname)) == 0

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
from weclaw_mq.state import fair_book
from weclaw_mq.state.fair_book import FairBook, Landing, MemoryFairBook, RedisFairBook

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
    book = RedisFairBook(client)
    try:
        # Counted by the producers as they published: "big" first into Q (all empty, Q on
        # a tie), "mid" into the next empty lane.
        assert await book.loads(qname, 3) == [30, 10, 0]

        await start_worker(app, concurrency=2)

        async def ready(index: int) -> int:
            queue = await amqp.declare_queue(fair_lane_name(qname, index), passive=True)
            return int(queue.declaration_result.message_count or 0)

        async def book_is_the_brokers() -> bool:
            counts = [await ready(i) for i in range(3)]
            # The worker holds some (running and one waiting per lane): below what was sent.
            return await book.loads(qname, 3) == counts and counts[0] < 30 and counts[1] < 10

        await wait_until(book_is_the_brokers, 10, "the book to hold the broker's counts")
    finally:
        release.set()
        await client.aclose()


async def test_a_tenant_whose_task_ran_is_not_sent_back_behind_a_backlog_on_its_old_lane(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    redis_url: str,
) -> None:
    """Issue 38, cause (a), end to end: "light"'s one task ran on Q, then "heavy"'s backlog
    was placed on Q (the emptiest, Q on a tie); light's next task goes to an empty lane and
    starts within C + 1 completions, not after heavy's backlog."""
    app = make_app()
    events: list[tuple[str, str]] = []
    release = asyncio.Event()

    @app.handler(qname, tenant=lambda task: task.tenant, fair=Fair(lanes=4))
    async def answer(task: Ask) -> None:
        events.append(("start", task.tenant))
        if task.tenant == "heavy":
            await release.wait()
        events.append(("end", task.tenant))

    client = aioredis.Redis.from_url(redis_url)
    book = RedisFairBook(client)
    try:
        await app.declare()
        await start_worker(app, concurrency=1)
        await app.publish(qname, Ask(tenant="light"))
        await wait_until(lambda: ("end", "light") in events, 20, "light's first task")

        async def counted_empty() -> bool:  # a worker's count after light's task started
            return await book.loads(qname, 4) == [0, 0, 0, 0]

        await wait_until(counted_empty, 10, "the workers' count of the empty lanes")
        await app.publish_many(qname, [Ask(tenant="heavy", n=i) for i in range(200)])
        await wait_until(lambda: ("start", "heavy") in events, 20, "heavy's backlog to start")
        before = len(events)
        await app.publish(qname, Ask(tenant="light", n=1))
        queued = len(events)
        release.set()
        await wait_until(lambda: _started_since(events, before, "light"), 30, "light's task")
        assert _completions_before_start(events, before, queued, "light") <= 2, events[before:]
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


async def _published(
    book: FairBook, queue: str, tenants: list[str], lanes: int = 4, landed: bool = True
) -> list[int]:
    """A producer's publish of one task per entry of ``tenants``: the book's lanes, then the
    broker's answer told to the book. Each task's lane, in order."""
    placed = await book.assign(queue, lanes, tenants, 60_000)
    batches = {t: (lane, batch) for t, (lane, batch) in zip(tenants, placed, strict=True)}
    landings = [
        Landing(t, lane, tenants.count(t) if landed else 0, batch)
        for t, (lane, batch) in batches.items()
    ]
    await book.settled(queue, lanes, landings, 60_000)
    return [lane for lane, _ in placed]


async def _counted(book: FairBook, queue: str, ready: list[int]) -> None:
    """A worker's count with nothing moving: the landings, then the broker's ``ready``."""
    covered = await book.landed(queue, len(ready))
    await book.counted(queue, ready, covered, 60_000)


async def _book_rules(book: FairBook, queue: str) -> None:
    assert await _published(book, queue, ["big"] * 3) == [0, 0, 0]
    assert await _published(book, queue, ["small", "mid", "big"]) == [1, 2, 0]
    # Every lane busy: a new tenant shares the least loaded one (small's, 1 task).
    assert await _published(book, queue, ["x"]) == [3]
    assert await _published(book, queue, ["y"]) == [1]
    assert await book.loads(queue, 4) == [4, 2, 1, 1]
    # The broker says Q emptied: big's tasks all started, its next one takes the emptiest
    # lane (Q again).
    await _counted(book, queue, [0, 2, 1, 1])
    assert await _published(book, queue, ["big"]) == [0]
    await _counted(book, queue, [5, 0, 1, 1])
    assert await _published(book, queue, ["big", "z"]) == [0, 1]
    # A refused publish: its batch no longer counts, nothing landed.
    assert await _published(book, queue, ["w"], landed=False) == [1]
    assert await book.loads(queue, 4) == [6, 1, 1, 1]


async def _redis_or_memory(kind: str, redis_url: str) -> tuple[FairBook, aioredis.Redis | None]:
    if kind == "memory":
        return MemoryFairBook(), None
    client = aioredis.Redis.from_url(redis_url)
    return RedisFairBook(client), client


async def _forget(client: aioredis.Redis | None, queue: str) -> None:
    if client is not None:
        keys = [k async for k in client.scan_iter(f"{fair_key(queue)}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_the_fair_book_keeps_a_tenant_on_its_lane_while_it_has_tasks_waiting(
    redis_url: str, qname: str, kind: str
) -> None:
    """The same rules in Redis (one script for every producer) and in one process."""
    book, client = await _redis_or_memory(kind, redis_url)
    try:
        await _book_rules(book, qname)
        if client is not None:
            assert 0 < await client.pttl(fair_key(qname)) <= 60_000
            assert 0 < await client.pttl(fair_tenant_key(qname, "big")) <= 60_000
    finally:
        await _forget(client, qname)


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_a_tenant_whose_tasks_started_leaves_its_lane_to_another_tenants_backlog(
    redis_url: str, qname: str, kind: str
) -> None:
    """Issue 38, cause (a): the book asked whether the LANE had tasks waiting, so a tenant
    whose one task had started was sent back to its old lane, behind another tenant's
    backlog placed there since, while another lane stood empty."""
    book, client = await _redis_or_memory(kind, redis_url)
    try:
        assert await _published(book, qname, ["light"]) == [0]
        await _counted(book, qname, [0, 0, 0, 0])  # light's task started: Q is empty
        assert await _published(book, qname, ["heavy"] * 999) == [0] * 999  # Q on a tie
        await _counted(book, qname, [999, 0, 0, 0])
        # light has no task waiting: the emptiest lane, not Q behind heavy's 999.
        assert await _published(book, qname, ["light"]) == [1]
        # While its task waits there, it keeps that lane (its tasks stay in order)...
        assert await _published(book, qname, ["light"]) == [1]
        await _counted(book, qname, [999, 1, 0, 0])
        assert await _published(book, qname, ["light"]) == [1]
        # ...and heavy keeps Q while its backlog waits.
        assert await _published(book, qname, ["heavy"]) == [0]
    finally:
        await _forget(client, qname)


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_a_count_read_before_a_producers_batch_landed_does_not_wipe_it(
    redis_url: str, qname: str, kind: str
) -> None:
    """Issue 38, cause (b): a worker wrote a broker count it had read before a producer's
    batch of 2,000 landed over the producer's +2,000, so the next tenant was placed on the
    "empty" lane holding the whole batch."""
    book, client = await _redis_or_memory(kind, redis_url)
    try:
        # A worker reads the landings and the broker: every lane empty...
        covered = await book.landed(qname, 4)
        ready = [0, 0, 0, 0]
        # ...meanwhile a producer's batch of 2,000 is placed, and is on its way...
        placed = await book.assign(qname, 4, ["batch"] * 2000, 60_000)
        lane, batch = placed[0]
        assert lane == 0
        # ...when the worker writes what it read.
        await book.counted(qname, ready, covered, 60_000)
        assert await book.loads(qname, 4) == [2000, 0, 0, 0]
        assert await _published(book, qname, ["next"]) == [1]
        # A second worker reads the landings and the broker (the batch not there yet); the
        # batch lands, its producer tells the book; then the worker writes what it read.
        covered = await book.landed(qname, 4)
        ready = [0, 1, 0, 0]
        await book.settled(qname, 4, [Landing("batch", 0, 2000, batch)], 60_000)
        await book.counted(qname, ready, covered, 60_000)
        assert await book.loads(qname, 4) == [2000, 1, 0, 0]
        assert await _published(book, qname, ["third"]) == [2]
        # A quiet count: the broker's truth again.
        await _counted(book, qname, [2000, 1, 1, 0])
        assert await book.loads(qname, 4) == [2000, 1, 1, 0]
    finally:
        await _forget(client, qname)


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_a_slow_workers_older_count_does_not_replace_a_newer_one(
    redis_url: str, qname: str, kind: str
) -> None:
    book, client = await _redis_or_memory(kind, redis_url)
    try:
        await _published(book, qname, ["a"] * 5)
        old = await book.landed(qname, 4)  # a slow worker reads, then stalls
        await _published(book, qname, ["a"] * 5)
        await _counted(book, qname, [3, 0, 0, 0])  # a newer count: 7 of 10 taken
        await book.counted(qname, [5, 0, 0, 0], old, 60_000)  # the slow one's, ignored
        assert await book.loads(qname, 4) == [3, 0, 0, 0]
    finally:
        await _forget(client, qname)


async def test_a_batch_whose_producer_never_answers_stops_counting_at_its_deadline(
    redis_url: str, qname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that died between its assignment and its confirm: its batch makes the lane
    look busy for ``FLYING_MS``, not for a day."""
    monkeypatch.setattr(fair_book, "FLYING_MS", 200)
    client = aioredis.Redis.from_url(redis_url)
    book = RedisFairBook(client)
    try:
        await book.assign(qname, 4, ["gone"] * 50, 60_000)
        assert await book.loads(qname, 4) == [50, 0, 0, 0]

        async def forgotten() -> bool:
            return await book.loads(qname, 4) == [0, 0, 0, 0]

        await wait_until(forgotten, 10, "the batch's deadline")
        # Its tenant is not held to the lane either.
        await _published(book, qname, ["other"])
        assert await _published(book, qname, ["gone"]) == [1]
    finally:
        await _forget(client, qname)


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
            return await RedisFairBook(client).loads(qname, 3) == [11, 1, 0]

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

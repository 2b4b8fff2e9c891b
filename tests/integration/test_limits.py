"""Per-key concurrency and rate limits (``limit=Limit(...)``), on the real broker and Redis.

Several in-process workers stand for a fleet (each has its own Redis pool and broker
connection, as separate processes would); the dead-worker case uses a real process killed
with SIGKILL. The handlers count themselves in Redis (INCR/DECR), independently of the
limiter's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import (
    delete_queues,
    forget_task_keys,
    outcome_count,
    settings_for,
    wait_until,
)
from tests.integration.fixture_apps.worker_app import build_app, read_events
from tests.integration.processes import FIXTURE_APP, queue_names, spawn_cli_worker
from tests.private_servers import PrivateRedis
from weclaw_mq import App, Context, Limit, RetryPolicy, TaskStatus
from weclaw_mq.contract.naming import LIMIT_KEY_PREFIX, limit_keys
from weclaw_mq.observability.metrics import Outcome

# INCR a running count and keep its maximum, in one step: the handlers' own witness.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


class Job(BaseModel):
    user: str
    n: int = 0


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def counters(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A prefix for this test's counter keys, deleted afterwards."""
    prefix = f"test-limits:{uuid.uuid4().hex[:8]}"
    yield prefix
    keys = [k async for k in redis_client.scan_iter(f"{prefix}:*", count=1000)]
    if keys:
        await redis_client.delete(*keys)


async def _forget_limit_keys(client: aioredis.Redis, queue: str) -> None:
    # They expire by themselves (one lease / one period); a test leaves none behind anyway.
    keys = [
        k async for k in client.scan_iter(f"{LIMIT_KEY_PREFIX}:{len(queue)}:{queue}:*", count=1000)
    ]
    if keys:
        await client.delete(*keys)


def _deferrals(app: App, queue: str, kind: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_limit_deferrals_total", {"queue": queue, "limit": kind}
    )
    return value or 0.0


async def test_per_key_concurrency_holds_one_key_and_lets_the_others_flow(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    redis_client: aioredis.Redis,
    counters: str,
    qname: str,
) -> None:
    """50 tasks of one key and 50 of others, concurrency 2 per key, 4 workers x 4 slots."""
    app = make_app()
    enter = redis_client.register_script(_ENTER)
    done: dict[str, float] = {}  # task user/n -> when it finished (monotonic)
    attempts: list[int] = []

    @app.handler(qname, limit=Limit(key=lambda job: job.user, concurrency=2))
    async def work(job: Job, ctx: Context) -> None:
        running, most = f"{counters}:running:{job.user}", f"{counters}:max:{job.user}"
        await enter(keys=[running, most])
        try:
            await asyncio.sleep(0.1)
        finally:
            await redis_client.decr(running)
        attempts.append(ctx.attempt)
        done[f"{job.user}/{job.n}"] = time.monotonic()

    await app.declare()
    for _ in range(4):
        await start_worker(app, concurrency=4)
    try:
        # The control: the 50 others alone.
        t0 = time.monotonic()
        await app.publish_many(qname, [Job(user=f"c{i}") for i in range(50)])
        await wait_until(lambda: len(done) == 50, 20, "the control tasks")
        control_s = max(done.values()) - t0

        # The hot key's 50 first in the queue, then the others behind them.
        done.clear()
        t0 = time.monotonic()
        await app.publish_many(qname, [Job(user="hot", n=i) for i in range(50)])
        await app.publish_many(qname, [Job(user=f"u{i}") for i in range(50)])
        await wait_until(lambda: len(done) == 100, 40, "every task")
        others_s = max(t for k, t in done.items() if not k.startswith("hot/")) - t0
        hot_s = max(t for k, t in done.items() if k.startswith("hot/")) - t0

        assert int(await redis_client.get(f"{counters}:max:hot") or 0) == 2
        assert int(await redis_client.get(f"{counters}:max:u0") or 0) == 1
        # 25 rounds of 0.1 s at best: the limit did hold the hot key back...
        assert hot_s >= 2.5, hot_s
        # ...and the others, queued behind all 50, were not held up by it: they were all done
        # while the hot key, two at a time, still had a fifth of its tasks to run (a count,
        # not a time: it holds on a loaded machine too). The control's time is printed.
        others_end = t0 + others_s
        hot_done = sum(1 for k, t in done.items() if k.startswith("hot/") and t <= others_end)
        print(f"others {others_s:.2f} s (alone {control_s:.2f} s), hot key {hot_s:.2f} s")
        assert hot_done <= 40, (hot_done, others_s, control_s)
        # Deferred, never failed: every run was its task's first attempt.
        assert attempts == [1] * 150
        assert _deferrals(app, qname, "concurrency") > 0
        # Every slot was released (the holders' entries are gone).
        slots, _ = limit_keys(qname, 0, "hot")
        await wait_until(
            lambda: _zero(redis_client, slots),
            5,
            "the hot key's slots to be free",
        )
    finally:
        await _forget_limit_keys(redis_client, qname)


async def _zero(client: aioredis.Redis, key: str) -> bool:
    return int(await client.zcard(key)) == 0


async def test_rate_limit_keeps_starts_per_second_within_it(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    redis_client: aioredis.Redis,
    qname: str,
) -> None:
    app = make_app()
    starts: list[float] = []
    attempts: list[int] = []

    @app.handler(qname, limit=Limit(key=lambda job: job.user, rate=5, per_s=1.0))
    async def work(job: Job, ctx: Context) -> None:
        if job.user == "hot":
            starts.append(time.monotonic())
        attempts.append(ctx.attempt)

    await app.declare()
    await start_worker(app, concurrency=5)
    await start_worker(app, concurrency=5)
    try:
        await app.publish_many(qname, [Job(user="hot", n=i) for i in range(15)])
        await app.publish_many(qname, [Job(user=f"u{i}") for i in range(10)])
        await wait_until(lambda: len(attempts) == 25, 20, "every task")
        starts.sort()
        # No window of a second holds more than 5 starts (0.9 s: the handler starts a few ms
        # after Redis admitted it, by a delay that varies).
        busiest = max(sum(1 for t in starts if s <= t < s + 0.9) for s in starts)
        assert busiest <= 5, starts
        # The limit, not something slower, set the pace: 15 starts need 2 s at 5/s.
        assert 1.9 <= starts[-1] - starts[0] <= 6.0, starts
        assert attempts == [1] * 25
        assert _deferrals(app, qname, "rate") > 0
    finally:
        await _forget_limit_keys(redis_client, qname)


async def test_a_start_refused_by_one_limit_of_a_list_takes_back_what_the_others_admitted(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    redis_client: aioredis.Redis,
    qname: str,
) -> None:
    app = make_app()
    release = asyncio.Event()
    started: list[int] = []

    # The refusing limit first: the later one, asked in the same round trip, is taken back too.
    @app.handler(qname, limit=[Limit(key=lambda j: j.user, concurrency=1), Limit(concurrency=10)])
    async def work(job: Job) -> None:
        started.append(job.n)
        await release.wait()

    await start_worker(app, concurrency=3)
    everyone, _ = limit_keys(qname, 1, None)
    try:
        await app.publish_many(qname, [Job(user="a", n=i) for i in range(3)])
        await wait_until(lambda: _deferrals(app, qname, "concurrency") >= 2, 10, "2 deferrals")
        # The global limit admitted the refused starts first; each was taken back, so it
        # holds only the one running task.
        assert len(started) == 1
        assert int(await redis_client.zcard(everyone)) == 1
        release.set()
        await wait_until(lambda: len(started) == 3, 15, "every task")
    finally:
        release.set()
        await _forget_limit_keys(redis_client, qname)


async def test_a_key_function_that_fails_on_a_task_dead_letters_it_unrun(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
) -> None:
    app = make_app()
    ran: list[int] = []

    @app.handler(qname, limit=Limit(key=lambda job: {"n": 1}[job.user], concurrency=1))
    async def work(job: Job) -> None:
        ran.append(job.n)

    await start_worker(app)
    task_id = await app.publish(qname, Job(user="nobody"))
    state = await app.result(task_id, timeout_s=10)
    assert state.status is TaskStatus.DEAD_LETTERED
    assert state.reason == "invalid_payload"
    assert state.error is not None and "key function raised KeyError" in state.error
    assert ran == []


class TestRedisDown:
    @pytest.fixture
    def redis_url(self, private_redis: PrivateRedis) -> str:
        """This test's apps count their limits in a Redis of its own, which it stops."""
        return private_redis.url

    async def test_a_limited_task_waits_in_a_delay_queue_until_redis_answers(
        self,
        make_app: Callable[..., App],
        start_worker: Callable[..., Any],
        private_redis: PrivateRedis,
        qname: str,
    ) -> None:
        # No guard and no results: the limit is the only thing that needs Redis.
        app = make_app(results_enabled=False)
        ran: list[int] = []

        @app.handler(
            qname, idempotent=False, retry=RetryPolicy(delay_s=0.2), limit=Limit(concurrency=1)
        )
        async def work(job: Job) -> None:
            ran.append(job.n)

        await start_worker(app)
        await asyncio.to_thread(private_redis.stop)
        await app.publish(qname, Job(user="a", n=1))
        await wait_until(lambda: outcome_count(app, qname, Outcome.DEFERRED) >= 2, 10, "deferrals")
        assert ran == [], "a limited task ran while Redis could not count it"
        await asyncio.to_thread(private_redis.start)
        await wait_until(lambda: ran == [1], 15, "the task to run once Redis answers")


@pytest.fixture
async def queues_to_delete(broker_url: str) -> AsyncIterator[list[str]]:
    """Queues deleted at teardown, after ``start_worker``'s workers stopped (requested before
    it, so torn down after it): a live worker's consumer-cancel recovery declares a queue
    deleted under it again."""
    names: list[str] = []
    yield names
    await delete_queues(broker_url, names)


async def test_a_killed_worker_frees_its_slot_after_the_lease(
    broker_url: str,
    redis_url: str,
    redis_client: aioredis.Redis,
    queues_to_delete: list[str],
    start_worker: Callable[..., Any],
    qname: str,
    tmp_path: Path,
) -> None:
    lease_s = 2.0
    settings = settings_for(broker_url, redis_url, guard_lease_s=lease_s)
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    # One task at a time in the whole handler, across every worker.
    app = build_app(qname, settings=settings, record_dir=record_dir, limit=Limit(concurrency=1))
    slots, _ = limit_keys(qname, 0, None)
    worker = spawn_cli_worker(
        FIXTURE_APP,
        settings=settings,
        app_env={
            "TEST_QUEUE": qname,
            "TEST_RECORD_DIR": str(record_dir),
            "TEST_HANDLER_SLEEP_S": "60",
            "TEST_LIMIT_CONCURRENCY": "1",
        },
        log_path=tmp_path / "worker.log",
    )
    try:
        await app.declare()
        await worker.wait_consuming()
        held = await app.publish(qname, {"text": "hold"})
        await wait_until(
            lambda: any(e.task_id == held for e in read_events(record_dir)), 20, "the start"
        )
        assert int(await redis_client.zcard(slots)) == 1
        worker.kill()
        killed = time.monotonic()

        # A worker of the same handler (whose calls are quick) gets the next task: it waits
        # for the dead worker's slot, which frees once its lease lapsed.
        waiting = await app.publish(qname, {"text": "next"})
        await start_worker(app, concurrency=2)

        def started() -> bool:
            return any(e.task_id == waiting for e in read_events(record_dir))

        await wait_until(started, lease_s + 10, "the next task to start")
        waited = time.monotonic() - killed
        # Not before the lease could lapse (renewed every lease/3), and soon after it did
        # (the next deferral: at most 1 s, the first estimate of a slot's hold).
        assert lease_s * 2 / 3 - 0.2 <= waited <= lease_s + 3.0, waited
        assert _deferrals(app, qname, "concurrency") > 0
    finally:
        worker.kill()
        await app.close()
        queues_to_delete.extend(queue_names(app))
        await forget_task_keys(redis_url, [qname])
        await _forget_limit_keys(redis_client, qname)


async def test_a_task_deferred_by_a_limit_says_why_in_its_status_and_logs_its_first_deferral(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    redis_client: aioredis.Redis,
    qname: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app()
    release = asyncio.Event()
    started: list[int] = []

    @app.handler(qname, limit=Limit(key=lambda j: j.user, concurrency=1))
    async def work(job: Job) -> None:
        started.append(job.n)
        await release.wait()

    caplog.set_level("DEBUG", logger="weclaw_mq.worker")
    await start_worker(app, concurrency=2)
    try:
        first = await app.publish(qname, Job(user="a", n=1))
        await wait_until(lambda: started == [1], 10, "the first task running")
        held = await app.publish(qname, Job(user="a", n=2))

        def parked() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "over its concurrency limit" in r.getMessage()]

        async def deferred_twice() -> bool:
            # The record is written before the move, the log line after it: wait for both.
            state = await app.status(held)
            on_record = state is not None and state.deferred is not None
            return on_record and state.deferred.count >= 2 and len(parked()) >= 2

        await wait_until(deferred_twice, 20, "two deferrals on the record and in the log")
        state = await app.status(held)
        assert state is not None and state.deferred is not None
        assert state.status is TaskStatus.QUEUED
        assert (state.deferred.by, state.deferred.why) == ("limit", "over its concurrency limit")
        assert state.deferred.next_try_at is not None
        assert state.deferred.next_try_at > state.updated_at
        levels = [r.levelname for r in parked()]
        assert levels[0] == "INFO" and set(levels[1:]) == {"DEBUG"}, levels
        release.set()
        final = await app.result(held, timeout_s=20)
        assert final.status is TaskStatus.SUCCEEDED and final.deferred is None
        assert (await app.result(first, timeout_s=20)).status is TaskStatus.SUCCEEDED
    finally:
        release.set()
        await _forget_limit_keys(redis_client, qname)

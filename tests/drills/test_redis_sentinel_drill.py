"""The task state fails over with Redis Sentinel: kill -9 of the Redis primary mid-stream.

A private Sentinel set (one primary, one replica, three Sentinels, quorum two, the primary
declared down after ``SENTINEL_DOWN_AFTER_MS``) holds the guard and the results; a real worker
process (``--concurrency 8``) on the shared broker reaches them through
``redis+sentinel://``. 500 tasks are published, and once 150 have run the primary is
SIGKILLed. The Sentinels promote the replica; meanwhile the worker parks the tasks it cannot
claim in a delay queue and keeps trying to store the results of those that ran. Every task
must run, none more than the bound allows, and the results must be readable from the new
primary (see ``bounds.SENTINEL_LOST_WRITES_BOUND`` for why either may miss a few).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import delete_queues, require_redis_binaries, wait_until
from tests.drills import bounds, drill_app
from tests.drills.conftest import DrillReport, drill_settings
from tests.integration.processes import (
    all_empty,
    broker_queue_counts,
    end_state_problems,
    fresh_ready_counts,
    queue_names,
)
from tests.private_servers import PrivateSentinelSet, PrivateServers
from weclaw_mq import App, TaskStatus
from weclaw_mq.state.redis_clients import open_client

TASKS = 500
KILL_AFTER = 150
CONCURRENCY = bounds.SENTINEL_DRILL_CONCURRENCY
STATUS_CHUNK = 50


async def _statuses(app: App, ids: list[str]) -> Counter[str]:
    found: Counter[str] = Counter()
    for start in range(0, len(ids), STATUS_CHUNK):
        states = await asyncio.gather(*(app.status(t) for t in ids[start : start + STATUS_CHUNK]))
        found.update(s.status.value if s is not None else "unknown" for s in states)
    return found


async def _failed_over(sentinels: PrivateSentinelSet, killed_at: float) -> tuple[float, float]:
    """Seconds from the kill until (a majority of the Sentinels name the replica as the
    primary, a write through ``redis+sentinel://`` is accepted)."""
    replica = sentinels.replica.port
    majority = len(sentinels.sentinels) // 2 + 1

    async def promoted() -> bool:
        ports = await asyncio.gather(
            *(asyncio.to_thread(sentinels.primary_port, s) for s in sentinels.sentinels)
        )
        return sum(p == replica for p in ports) >= majority

    await wait_until(promoted, bounds.SENTINEL_FAILOVER_BOUND_S, "the Sentinels to promote")
    promoted_s = time.monotonic() - killed_at
    client = open_client(drill_settings("amqp://unused", sentinels.url, redis_timeout_s=1))

    async def writable() -> bool:
        try:
            return bool(await client.set(f"weclaw-drill:{uuid.uuid4()}", "1", px=60_000))
        except Exception:  # the old primary's address, or a Sentinel still deciding
            return False

    try:
        await wait_until(writable, bounds.SENTINEL_FAILOVER_BOUND_S, "a write to be accepted")
    finally:
        await client.aclose()
    return promoted_s, time.monotonic() - killed_at


@pytest.mark.drill
async def test_redis_primary_killed_mid_stream_fails_over_and_loses_no_task(
    broker_url: str, private_servers: PrivateServers, tmp_path: Path, drill_report: DrillReport
) -> None:
    require_redis_binaries("redis-server")
    sentinels = PrivateSentinelSet(
        private_servers,
        private_servers.folder("sentinel-set"),
        down_after_ms=bounds.SENTINEL_DOWN_AFTER_MS,
    )
    queue = f"drill-sentinel-{uuid.uuid4().hex[:8]}"
    effects = tmp_path / "effects.log"
    # Leases of 2 s (a claim lost with the primary frees its task soon), deferred tasks back
    # in 0.2 s, and a second of patience per Redis command.
    settings = drill_settings(broker_url, sentinels.url, redis_timeout_s=1)
    app = drill_app.build_app(queue, settings=settings, effects=effects)
    worker = None
    try:
        try:
            sentinels.start()
        except RuntimeError as e:
            pytest.fail(f"the private Sentinel set: {e}", pytrace=False)
        started = time.perf_counter()
        await app.declare()
        ids = [str(uuid.uuid4()) for _ in range(TASKS)]
        await drill_app.publish_jobs(app, queue, ids)
        worker = drill_app.spawn_worker(
            queue=queue,
            settings=settings,
            effects=effects,
            log_path=tmp_path / "worker.log",
            concurrency=CONCURRENCY,
            sleep_s=0.01,
        )
        await worker.wait_consuming()
        await wait_until(
            lambda: len(drill_app.read_effects(effects)) >= KILL_AFTER, 30, f"{KILL_AFTER} runs"
        )
        ran_at_kill = len(drill_app.read_effects(effects))
        killed_at = time.monotonic()
        sentinels.primary.kill9()
        promoted_s, writable_s = await _failed_over(sentinels, killed_at)

        await wait_until(
            lambda: set(drill_app.read_effects(effects)) >= set(ids), 60, "every task to run"
        )
        names = queue_names(app)
        await wait_until(lambda: all_empty(broker_url, names), 30, "the queues to drain")

        async def succeeded() -> bool:
            counts = await _statuses(app, ids)
            return counts[TaskStatus.SUCCEEDED.value] >= TASKS - bounds.SENTINEL_LOST_WRITES_BOUND

        await wait_until(succeeded, 30, "the results to be readable from the new primary")
        problems: list[str] = []

        async def broker_end_state() -> bool:
            nonlocal problems
            problems = end_state_problems(await broker_queue_counts(names), names, {})
            return not problems

        try:
            await wait_until(broker_end_state, 30, "the broker's end state")
        except AssertionError:
            raise AssertionError(f"end state on the broker: {'; '.join(problems)}") from None
        code, stuck = await drill_app.stop_worker(worker)
        assert code == 0, worker.describe()
        assert stuck == 0, drill_app.stuck_at_stop(stuck)
        left = await fresh_ready_counts(broker_url, names)
        assert left == dict.fromkeys(names, 0), f"left in the queues: {left}"

        runs = drill_app.read_effects(effects)
        statuses = await _statuses(app, ids)
        missing_results = TASKS - statuses[TaskStatus.SUCCEEDED.value]
        duplicates = sum(c - 1 for c in runs.values() if c > 1)
        lost = len(set(ids) - set(runs))
        deferred = worker.log().count("the task store is down")
        drill_report.add(
            f"kill -9 of the Redis primary (Sentinel, concurrency {CONCURRENCY})",
            published=TASKS,
            confirmed=len(ids),
            processed=len(set(runs) & set(ids)),
            lost=lost,
            duplicated=duplicates,
            seconds=time.perf_counter() - started,
            queue="weclaw_mq (quorum) + Redis Sentinel",
            notes=f"killed after {ran_at_kill} runs; replica promoted {promoted_s:.1f} s and "
            f"writes accepted {writable_s:.1f} s after the kill "
            f"({bounds.sentinel_failover_bound_text()}); {deferred} deliveries deferred while "
            f"Redis was down; results missing {missing_results}, duplicates {duplicates} "
            f"({bounds.sentinel_lost_writes_bound_text()}); broker: {len(names)} queues, "
            "0 unacked, 0 in the DLQ (and 0 ready after the worker's exit)",
        )
        assert lost == 0, f"{lost} task(s) never ran"
        assert duplicates <= bounds.SENTINEL_LOST_WRITES_BOUND, f"{duplicates} duplicate run(s)"
        assert missing_results <= bounds.SENTINEL_LOST_WRITES_BOUND, f"statuses: {statuses}"
        assert writable_s <= bounds.SENTINEL_FAILOVER_BOUND_S
    finally:
        if worker is not None:
            worker.kill()
        await app.close()
        await delete_queues(broker_url, queue_names(app))
        sentinels.stop()

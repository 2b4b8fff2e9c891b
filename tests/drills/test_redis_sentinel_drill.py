"""The task state fails over with Redis Sentinel: kill -9 of the Redis primary mid-stream.

A private Sentinel set (one primary, one replica, three Sentinels, quorum two, the primary
declared down after ``SENTINEL_DOWN_AFTER_MS``) holds the guard and the results; a real worker
process (``--concurrency 8``) on the shared broker reaches them through
``redis+sentinel://``. 500 tasks are published, and once 150 have run the primary is
SIGKILLed. The Sentinels promote the replica; meanwhile the worker parks the tasks it cannot
claim in a delay queue and keeps trying to store the results of those that ran. Every task
must run, none more than the bound allows, and the results must be readable from the new
primary (see ``bounds.SENTINEL_LOST_WRITES_BOUND`` for why either may miss a few).

The same kill under long runs (issue 40): two workers run 12 long runs of memoized steps
(``fixture_apps/long_sentinel_app.py``) with a watch of 1 s and a heartbeat of 1 s, all in
flight when the primary dies. Every task must succeed, each run end once, the steps called
before the kill be replayed (extra calls within ``bounds.SENTINEL_LONG_RUN_EXTRA_STEPS_BOUND``)
and the broker end clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import delete_queues, require_redis_binaries, wait_until
from tests.drills import bounds, drill_app
from tests.drills.conftest import DrillReport, drill_settings
from tests.integration.fixture_apps import long_sentinel_app
from tests.integration.fixture_apps.steps_app import read_calls
from tests.integration.processes import (
    WorkerProcess,
    all_empty,
    broker_queue_counts,
    end_state_problems,
    fresh_ready_counts,
    queue_names,
    spawn_cli_worker,
)
from tests.private_servers import PrivateSentinelSet, PrivateServers
from weclaw_mq import App, ResultTimeoutError, TaskStatus
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


# -- long runs: the primary killed while their steps are being recorded ----------------------

LONG_RUNS = bounds.SENTINEL_LONG_RUNS
LONG_WORKERS = 2
LONG_CONCURRENCY = LONG_RUNS // LONG_WORKERS  # every run in flight at once
LONG_STEPS = 10
LONG_STEP_S = 0.3
# Steps called by every run before the kill: mid-run, with steps both behind and ahead.
LONG_KILL_AT_STEP = 3
# How long a run may take to end after the failover (about 3 s of steps are left to each).
LONG_FINISH_WITHIN_S = 60.0


def _long_calls(record_dir: Path) -> dict[str, Counter[str]]:
    """Per kind (start, step, end, and "retry": a start of attempt 2 or later): how many lines
    each task id wrote to the calls log."""
    found: dict[str, Counter[str]] = {
        "start": Counter(),
        "step": Counter(),
        "end": Counter(),
        "retry": Counter(),
    }
    for line in read_calls(record_dir):
        kind, task_id, *rest = line.split()
        found[kind][task_id] += 1
        if kind == "start" and int(rest[2]) > 1:
            found["retry"][task_id] += 1
    return found


async def _final(app: App, task_id: str) -> TaskStatus | None:
    """The task's final status, or None if it has none within ``LONG_FINISH_WITHIN_S``."""
    try:
        return (await app.result(task_id, timeout_s=LONG_FINISH_WITHIN_S)).status
    except ResultTimeoutError:
        return None


@pytest.mark.drill
async def test_redis_primary_killed_under_long_runs_they_resume_and_replay_their_steps(
    broker_url: str, private_servers: PrivateServers, tmp_path: Path, drill_report: DrillReport
) -> None:
    require_redis_binaries("redis-server")
    sentinels = PrivateSentinelSet(
        private_servers,
        private_servers.folder("sentinel-long"),
        down_after_ms=bounds.SENTINEL_DOWN_AFTER_MS,
    )
    queue = f"drill-sentinel-long-{uuid.uuid4().hex[:8]}"
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    # A watch copy every second and a heartbeat of a second: the failover outlasts both, so
    # the copies that come back meanwhile find the task store down, and right after it
    # heartbeats that may have lapsed.
    settings = drill_settings(
        broker_url,
        sentinels.url,
        redis_timeout_s=1,
        long_run_watch_s=bounds.SENTINEL_LONG_RUN_WATCH_S,
        guard_heartbeat_ttl_s=bounds.SENTINEL_LONG_RUN_HEARTBEAT_S,
    )
    app = long_sentinel_app.build_app(queue, settings=settings, record_dir=record_dir)
    names = queue_names(app)
    workers: list[WorkerProcess] = []
    try:
        try:
            sentinels.start()
        except RuntimeError as e:
            pytest.fail(f"the private Sentinel set: {e}", pytrace=False)
        started = time.perf_counter()
        await app.declare()
        for n in range(LONG_WORKERS):
            workers.append(
                spawn_cli_worker(
                    "tests.integration.fixture_apps.long_sentinel_app:app",
                    settings=settings,
                    app_env={"TEST_QUEUE": queue, "TEST_RECORD_DIR": str(record_dir)},
                    log_path=tmp_path / f"worker-{n}.log",
                    concurrency=LONG_CONCURRENCY,
                )
            )
        for worker in workers:
            await worker.wait_consuming()
        job = long_sentinel_app.SentinelJob(steps=LONG_STEPS, step_s=LONG_STEP_S)
        ids = [await app.publish(queue, job) for _ in range(LONG_RUNS)]

        def all_mid_run() -> bool:
            steps = _long_calls(record_dir)["step"]
            return all(steps[t] >= LONG_KILL_AT_STEP for t in ids)

        await wait_until(all_mid_run, 30, f"every run to call {LONG_KILL_AT_STEP} steps")
        before = _long_calls(record_dir)["step"]
        killed_at = time.monotonic()
        sentinels.primary.kill9()
        promoted_s, writable_s = await _failed_over(sentinels, killed_at)

        # Measured first, asserted after: the numbers are printed whatever went wrong.
        finals = dict(zip(ids, await asyncio.gather(*(_final(app, t) for t in ids)), strict=True))
        problems: list[str] = []

        async def broker_end_state() -> bool:
            nonlocal problems
            problems = end_state_problems(await broker_queue_counts(names), names, {})
            return not problems

        with contextlib.suppress(AssertionError):
            await wait_until(broker_end_state, 30, "the broker's end state")
        stops = [await drill_app.stop_worker(w) for w in workers]
        left = await fresh_ready_counts(broker_url, names)

        calls = _long_calls(record_dir)
        extra_steps = sum(calls["step"][t] for t in ids) - LONG_RUNS * LONG_STEPS
        steps_before = sum(before[t] for t in ids)
        again = sum(calls["start"][t] - 1 for t in ids)
        retried = sum(calls["retry"][t] for t in ids)
        runs_again = (
            f"runs started again {again} ({retried} as a retry, {again - retried} resumed by "
            "a watch copy)"
        )
        not_succeeded = {t: f for t, f in finals.items() if f is not TaskStatus.SUCCEEDED}
        ended = {t: calls["end"][t] for t in ids if calls["end"][t] != 1}
        dlq = sum(n for q, n in left.items() if q.endswith(".dlq"))
        print(
            f"\nlong runs under a Sentinel failover: replica promoted {promoted_s:.1f} s and "
            f"writes accepted {writable_s:.1f} s after the kill; {steps_before} step calls "
            f"before it; extra step calls {extra_steps} "
            f"({bounds.sentinel_long_run_extra_steps_bound_text()}); {runs_again}; "
            f"not succeeded {not_succeeded}; ended other than once {ended}; left after the "
            f"workers' exit {left}"
        )
        drill_report.add(
            f"kill -9 of the Redis primary (Sentinel) under {LONG_RUNS} long runs",
            published=LONG_RUNS,
            confirmed=len(ids),
            processed=sum(1 for t in ids if calls["end"][t] >= 1),
            lost=len(not_succeeded),
            duplicated=sum(c - 1 for t in ids if (c := calls["end"][t]) > 1),
            seconds=time.perf_counter() - started,
            queue="weclaw_mq (quorum) + Redis Sentinel",
            notes=f"killed after {steps_before} step calls; writes accepted {writable_s:.1f} s "
            f"after the kill ({bounds.sentinel_failover_bound_text()}); extra step calls "
            f"{extra_steps} ({bounds.sentinel_long_run_extra_steps_bound_text()}); "
            f"{runs_again}; {dlq} in the DLQ after the workers' exit",
        )
        assert not not_succeeded, f"no final success: {not_succeeded}"
        assert not ended, f"runs that did not end exactly once: {ended}"
        assert extra_steps <= bounds.SENTINEL_LONG_RUN_EXTRA_STEPS_BOUND, calls["step"]
        assert not problems, f"end state on the broker: {'; '.join(problems)}"
        assert left == dict.fromkeys(names, 0), f"left in the queues: {left}"
        for worker, (code, stuck) in zip(workers, stops, strict=True):
            assert code == 0, worker.describe()
            assert stuck == 0, drill_app.stuck_at_stop(stuck)
        assert writable_s <= bounds.SENTINEL_FAILOVER_BOUND_S
    finally:
        for worker in workers:
            worker.kill()
        await app.close()
        await delete_queues(broker_url, names)
        sentinels.stop()

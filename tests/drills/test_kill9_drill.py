"""The drill weclaw_mq was born from: kill -9 the worker mid-stream, three times, lose nothing.

1000 tasks are published, then a real worker process (``--concurrency 8``) is SIGKILLed each
time the completion count passes a random threshold and started again; the last one finishes
the queue. Every task must end ``succeeded``. Duplicates are allowed only for the tasks a
killed worker had in flight (at most its prefetch, 8, per kill).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.conftest import delete_queues, forget_task_keys, settings_for, wait_until
from tests.drills import bounds
from tests.drills.conftest import DrillReport
from tests.integration.fixture_apps import guard_app
from tests.integration.processes import (
    WorkerProcess,
    all_empty,
    broker_queue_counts,
    end_state_problems,
    fresh_ready_counts,
    queue_names,
)
from weclaw_mq import App, TaskStatus
from weclaw_mq.contract.naming import GUARD_KEY_PREFIX, queue_key_pattern, task_keys

TASKS = 1000
KILLS = bounds.KILL9_KILLS
CONCURRENCY = bounds.KILL9_CONCURRENCY
PUBLISH_CHUNK = 50
STATUS_CHUNK = 50
MIN_RUN = 40
# Short leases and delays: a killed worker's claims lapse, and its tasks come back, in
# seconds instead of the production 30 s.
LEASE_S = 2.0
RETRY_DELAY_S = 0.2


async def _publish_all(app: App, queue: str, count: int) -> list[str]:
    # Concurrent publishes share one confirmed channel: chunks keep the confirms pipelined.
    ids: list[str] = []
    for start in range(0, count, PUBLISH_CHUNK):
        chunk = range(start, min(start + PUBLISH_CHUNK, count))
        ids += await asyncio.gather(*(app.publish(queue, guard_app.Job(n=n)) for n in chunk))
    return ids


async def _statuses(app: App, ids: list[str]) -> Counter[str]:
    found: Counter[str] = Counter()
    # Chunks below the Redis client's pool size (100 connections, and it raises when full).
    for start in range(0, len(ids), STATUS_CHUNK):
        chunk = ids[start : start + STATUS_CHUNK]
        states = await asyncio.gather(*(app.status(t) for t in chunk))
        found.update(s.status.value if s is not None else "unknown" for s in states)
    return found


def duplicates_per_kill(runs: list[str], killed_at: list[int]) -> list[int]:
    """For each kill, how many tasks the killed worker completed that ran again later.

    One worker runs at a time, and ``killed_at[k]`` is the length of the runs list right
    after worker k died: ``runs[killed_at[k-1]:killed_at[k]]`` are worker k's completions.
    A task it completed but had not yet settled (in flight at the kill) runs again later.
    """
    counts = []
    start = 0
    for end in killed_at:
        later = set(runs[end:])
        counts.append(len(set(runs[start:end]) & later))
        start = end
    return counts


async def _forget(client: aioredis.Redis, queue: str, record_key: str, ids: list[str]) -> None:
    keys = guard_app.record_keys(record_key) + [k for t in ids for k in task_keys(queue, t)]
    pattern = queue_key_pattern(GUARD_KEY_PREFIX, queue)
    keys += [k async for k in client.scan_iter(match=pattern, count=500)]
    for start in range(0, len(keys), 500):
        await client.delete(*keys[start : start + 500])


@pytest.mark.drill
async def test_worker_killed_three_times_mid_stream_loses_no_task(
    broker_url: str, redis_url: str, tmp_path: Path, drill_report: DrillReport
) -> None:
    # Printed with the results; set DRILL_SEED to replay a run's kill points.
    seed = int(os.environ.get("DRILL_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    thresholds = sorted(rng.sample(range(100, 800), KILLS))
    queue = f"drill-kill9-{uuid.uuid4().hex[:8]}"
    record_key = f"weclaw-test:{queue}"
    runs_key = guard_app.runs_key(record_key)
    settings = settings_for(
        broker_url,
        redis_url,
        guard_lease_s=LEASE_S,
        retry_delay_s=RETRY_DELAY_S,
        result_ttl_s=600,
        done_ttl_s=600,
    )
    publisher = guard_app.build_app(queue, settings=settings, record_key=record_key)
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
    workers: list[WorkerProcess] = []
    ids: list[str] = []
    killed_at: list[int] = []

    def spawn() -> WorkerProcess:
        worker = guard_app.spawn_worker(
            queue=queue,
            record_key=record_key,
            settings=settings,
            log_path=tmp_path / f"worker-{len(workers)}.log",
            concurrency=CONCURRENCY,
            sleep_min_s=0.005,
            sleep_max_s=0.02,
        )
        workers.append(worker)
        return worker

    async def completions() -> int:
        return int(await client.llen(runs_key))

    started = time.perf_counter()
    try:
        await publisher.declare()
        ids = await _publish_all(publisher, queue, TASKS)
        publish_s = time.perf_counter() - started

        for planned in thresholds:
            # Every worker completes some tasks before its kill, so it dies mid-stream with
            # its prefetch full rather than right after it connected.
            threshold = max(planned, (killed_at[-1] if killed_at else 0) + MIN_RUN)
            worker = spawn()
            await worker.wait_consuming()

            async def passed(threshold: int = threshold, worker: WorkerProcess = worker) -> bool:
                return await completions() >= threshold or worker.popen.poll() is not None

            await wait_until(passed, 30, f"{threshold} completions")
            assert worker.popen.poll() is None, f"worker died by itself: {worker.describe()}"
            worker.kill()
            assert worker.popen.returncode == -signal.SIGKILL
            killed_at.append(await completions())

        last = spawn()
        await last.wait_consuming()

        async def all_completed() -> bool:
            return len(set(await client.lrange(runs_key, 0, -1))) >= TASKS

        await wait_until(all_completed, 40, f"all {TASKS} tasks to complete")

        async def all_succeeded() -> bool:
            return (await _statuses(publisher, ids))[TaskStatus.SUCCEEDED.value] == TASKS

        await wait_until(all_succeeded, 20, f"all {TASKS} results to be stored")

        await wait_until(
            lambda: all_empty(broker_url, queue_names(publisher)), 20, "the queues to drain"
        )
        # The broker's word, while the last worker still holds its channel: nothing unacked,
        # nothing ready in the task queue, its delay queues or its DLQ.
        names = queue_names(publisher)
        problems: list[str] = []

        async def broker_end_state() -> bool:
            nonlocal problems
            problems = end_state_problems(await broker_queue_counts(names), names, {})
            return not problems

        try:
            await wait_until(broker_end_state, 30, "the broker's end state")
        except AssertionError:
            raise AssertionError(f"end state on the broker: {'; '.join(problems)}") from None
        last.signal(signal.SIGTERM)
        assert await last.wait_exit(30) == 0, last.describe()
        # The statistics above may be 5 s old; read afresh with the worker gone, a delivery
        # it had left unacked would be ready again.
        left = await fresh_ready_counts(broker_url, names)
        assert left == dict.fromkeys(names, 0), f"left in the queues: {left}"
        elapsed_s = time.perf_counter() - started

        statuses = await _statuses(publisher, ids)
        run_list = [guard_app.as_text(r) for r in await client.lrange(runs_key, 0, -1)]
        runs = Counter(run_list)
        recovered = statuses[TaskStatus.SUCCEEDED.value]
        duplicated = {t: c for t, c in runs.items() if c > 1}
        duplicates = sum(c - 1 for c in duplicated.values())
        per_kill = duplicates_per_kill(run_list, killed_at)
        drill_report.add(
            f"kill -9 of the worker x{KILLS} (concurrency {CONCURRENCY})",
            published=TASKS,
            confirmed=len(ids),
            processed=recovered,
            lost=TASKS - recovered,
            duplicated=duplicates,
            seconds=elapsed_s,
            notes=f"duplicates per kill {per_kill} ({bounds.kill9_bound_text(KILLS)}); "
            f"seed {seed}; killed at completions {killed_at}; publish {publish_s:.1f} s; "
            f"broker: {len(names)} queues, 0 unacked, 0 in the DLQ (and 0 ready after the "
            "worker's exit); every status succeeded",
        )
        assert set(runs) == set(ids), "a task never completed"
        assert recovered == TASKS, f"statuses: {dict(statuses)}"
        # Every duplicate is a task in flight at a kill, at most the prefetch of each kill.
        assert sum(per_kill) == duplicates, f"duplicates not caused by a kill: {duplicated}"
        assert all(d <= bounds.KILL9_DUPLICATES_PER_KILL for d in per_kill), (
            f"duplicates per kill {per_kill} above {bounds.KILL9_DUPLICATES_PER_KILL}"
        )
    finally:
        for worker in workers:
            worker.kill()
        await publisher.close()
        await delete_queues(broker_url, queue_names(publisher))
        await _forget(client, queue, record_key, ids)
        await forget_task_keys(redis_url, [queue])  # and the task index's entries
        await client.aclose()

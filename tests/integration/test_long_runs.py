"""Long runs (``long_running=True``, ``worker.long_runs``) on the real broker and Redis, with
workers in processes of their own: the delivery is acked as the run begins and a watch copy
keeps the task on the broker; a worker killed with SIGKILL has its run resumed by another
within the watch period plus the heartbeat TTL, its steps not run again; a worker stopped with
SIGTERM hands its run over at once; a retried long run leaves no stale copy that runs it again;
a worker runs no more long runs than its concurrency. The consumer timeout itself is outlived
on a private node (``tests/drills/test_long_run_drill.py``)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import delete_queues, forget_task_keys, settings_for, wait_until
from tests.integration.fixture_apps.long_app import LongJob, build_app
from tests.integration.fixture_apps.steps_app import read_calls
from tests.integration.processes import (
    broker_queue_counts,
    queue_names,
    spawned_workers,
)
from tests.private_servers import PrivateRedisCluster
from weclaw_mq import App, TaskStatus
from weclaw_mq.state import Claim, TaskState
from weclaw_mq.state.watches import WatchStep

# A watch copy every second (the 1 s delay queue) and a heartbeat that lapses in 0.5 s: a
# killed worker's run resumes within 1.5 s plus a delivery.
WATCH_S = 1.0
HEARTBEAT_S = 0.5
RESUME_BOUND_S = WATCH_S + HEARTBEAT_S
# A stopped worker's run resumed through the hand-over's copy: a delivery and a worker's
# start of the handler, far inside the 16 s watch period that test runs with.
HAND_OVER_BOUND_S = 8.0
# The worker registry's beat, which a running task's status reads as its heartbeat.
BEAT_S = 0.5


@pytest.fixture
async def long_fleet(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> AsyncIterator[tuple[App, Callable[..., Any]]]:
    """The long-run fixture app (to publish and read) and a starter of its workers in
    processes of their own (killed by pid at teardown, then the queues and keys go)."""
    settings = settings_for(
        broker_url,
        redis_url,
        guard_heartbeat_ttl_s=HEARTBEAT_S,
        long_run_watch_s=WATCH_S,
        shutdown_grace_s=120,
        worker_beat_s=BEAT_S,
    )
    app = build_app(qname, settings=settings, record_dir=tmp_path)
    await app.declare()
    env = {"TEST_QUEUE": qname, "TEST_RECORD_DIR": str(tmp_path)}
    app_path = "tests.integration.fixture_apps.long_app:app"
    try:
        with spawned_workers(app_path, settings=settings, app_env=env, log_dir=tmp_path) as start:
            yield app, start
    finally:
        await app.close()
        await delete_queues(broker_url, queue_names(app))
        await forget_task_keys(redis_url, [qname])


def _lines(record_dir: Path, kind: str) -> list[list[str]]:
    return [line.split() for line in read_calls(record_dir) if line.startswith(kind + " ")]


async def test_a_long_run_holds_no_delivery_and_ends_with_nothing_left_on_the_broker(
    long_fleet: tuple[App, Callable[..., Any]], tmp_path: Path, qname: str
) -> None:
    app, start = long_fleet
    worker = start()
    await worker.wait_consuming()
    task_id = await app.publish(qname, LongJob(steps=30, step_s=0.5))
    # 6 s into the run: past the broker's statistics interval (5 s), so its count below was
    # taken while the run went on.
    await wait_until(lambda: len(_lines(tmp_path, "step")) >= 12, 30, "twelve steps")

    # Mid-run: nothing unacked on the handler's queue (the broker's word), the watch copy
    # parked and coming back.
    counts = await broker_queue_counts([qname])
    assert counts[qname].unacked == 0, counts
    # Its status: running, with the time its worker last beat (its registry record lives three
    # beats, so no older than that).
    running = await app.status(task_id)
    assert running is not None and running.status is TaskStatus.RUNNING, running
    assert running.heartbeat_at is not None, running
    age_s = (datetime.now(UTC) - running.heartbeat_at).total_seconds()
    assert age_s <= 3 * BEAT_S + 0.5, (age_s, running)
    final = await app.result(task_id, timeout_s=30)
    assert final.status is TaskStatus.SUCCEEDED, (final, worker.describe())
    assert final.result == {"sum": 30 + sum(range(30)), "attempt": 1}
    assert [line[1] for line in _lines(tmp_path, "step")] == [str(i) for i in range(30)]
    assert len(_lines(tmp_path, "start")) == 1  # the watch copies parked; none ran it again

    # The last watch copy comes back to a task that is done and is acked: nothing is left.
    await wait_until(
        lambda: "a finished task seen again" in worker.log() or "parked" in worker.log(),
        10,
        "the watch copy to come back",
    )

    async def empty() -> bool:
        counts = await broker_queue_counts(queue_names(app))
        return all(c.ready == 0 and c.unacked == 0 for c in counts.values())

    await wait_until(empty, 30, "every queue of the handler empty")


async def test_a_run_whose_worker_was_killed_resumes_elsewhere_within_the_bound(
    long_fleet: tuple[App, Callable[..., Any]], tmp_path: Path, qname: str
) -> None:
    app, start = long_fleet
    first = start()
    second = start()
    await first.wait_consuming()
    await second.wait_consuming()
    task_id = await app.publish(qname, LongJob(steps=6, step_s=0.3, kill_after=2))
    killed = [w for w in (first, second) if await _exited(w)]
    assert len(killed) == 1, (first.describe(), second.describe())
    killed_at = (tmp_path / "killed").stat().st_mtime

    final = await app.result(task_id, timeout_s=30)
    assert final.status is TaskStatus.SUCCEEDED, (final, first.describe(), second.describe())
    starts = _lines(tmp_path, "start")
    assert len(starts) == 2, starts
    resumed_in = float(starts[1][2]) - killed_at
    # Within the watch period plus the heartbeat TTL, plus a second for the deliveries.
    assert resumed_in <= RESUME_BOUND_S + 1.0, resumed_in
    # Steps 0..2 were recorded before the kill: the resumed run replays them.
    assert [line[1] for line in _lines(tmp_path, "step")] == [str(i) for i in range(6)]
    assert final.attempt == 1  # a resumed run is the same attempt
    print(f"resumed {resumed_in:.2f} s after the kill (bound {RESUME_BOUND_S + 1.0:.1f} s)")


async def _exited(worker: Any) -> bool:
    try:
        return await worker.wait_exit(15) == -9
    except AssertionError:
        return False


async def test_a_stopped_worker_hands_its_long_run_over_at_once(
    long_fleet: tuple[App, Callable[..., Any]], tmp_path: Path, qname: str
) -> None:
    app, start = long_fleet
    # A watch copy every 16 s (the default): a resume within a few seconds of the stop can
    # only be the hand-over's copy.
    workers = [start(long_run_watch_s=16.0), start(long_run_watch_s=16.0)]
    for worker in workers:
        await worker.wait_consuming()
    task_id = await app.publish(qname, LongJob(steps=20, step_s=0.4))
    await wait_until(lambda: len(_lines(tmp_path, "step")) >= 2, 20, "two steps")
    (first,) = [w for w in workers if str(w.pid) == _lines(tmp_path, "start")[0][1]]
    (second,) = [w for w in workers if w is not first]

    stopped_at = time.time()
    first.signal(signal.SIGTERM)
    # Not the 120 s grace: the long run was handed over, not waited for.
    assert await first.wait_exit(15) == 0, first.describe()
    assert "handing over 1 long run(s)" in first.log(), first.describe()
    final = await app.result(task_id, timeout_s=60)
    assert final.status is TaskStatus.SUCCEEDED, (final, second.describe())
    starts = _lines(tmp_path, "start")
    assert len(starts) == 2 and starts[1][1] == str(second.pid), starts
    resumed_in = float(starts[1][2]) - stopped_at
    assert resumed_in < HAND_OVER_BOUND_S, (resumed_in, second.describe())
    steps = [line[1] for line in _lines(tmp_path, "step")]
    # Each step once, but the one the stop interrupted (at least once per step).
    assert sorted(set(steps), key=int) == [str(i) for i in range(20)] and len(steps) <= 21, steps
    print(f"handed over: resumed {resumed_in:.2f} s after SIGTERM (watch period 16 s)")


async def test_a_retried_long_run_leaves_no_watch_copy_that_runs_it_again(
    long_fleet: tuple[App, Callable[..., Any]], tmp_path: Path, qname: str
) -> None:
    app, start = long_fleet
    worker = start()
    await worker.wait_consuming()
    task_id = await app.publish(qname, LongJob(steps=3, step_s=0.2, retry_after=1))
    final = await app.result(task_id, timeout_s=30)
    assert final.status is TaskStatus.SUCCEEDED, (final, worker.describe())
    assert final.result == {"sum": 3 + 3, "attempt": 2}
    # The first attempt's watch copy comes back after its retry began or ended: stale, or the
    # task done; either way acked unrun. Two runs, never a third.
    await wait_until(
        lambda: (
            "watch copy no longer needed" in worker.log()
            or "a finished task seen again" in worker.log()
        ),
        15,
        "the first attempt's watch copy to come back",
    )
    assert [s[4] for s in _lines(tmp_path, "start")] == ["1", "2"]


async def test_a_worker_runs_no_more_long_runs_than_its_concurrency(
    long_fleet: tuple[App, Callable[..., Any]], tmp_path: Path, qname: str
) -> None:
    app, start = long_fleet
    worker = start(concurrency=1)
    await worker.wait_consuming()
    ids = [await app.publish(qname, LongJob(steps=3, step_s=0.3)) for _ in range(3)]
    finals = await asyncio.gather(*(app.result(i, timeout_s=60) for i in ids))
    assert all(f.status is TaskStatus.SUCCEEDED for f in finals), (finals, worker.describe())
    # Each run began after the one before it ended: never two at once in this worker.
    events = sorted(
        [(float(s[2]), 1) for s in _lines(tmp_path, "start")]
        + [(float(e[2]), -1) for e in _lines(tmp_path, "end")]
    )
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    assert peak == 1, events


async def test_watch_copies_claim_in_their_tasks_slot_on_every_node_of_a_cluster(
    redis_cluster: PrivateRedisCluster,
) -> None:
    from tests.integration.test_redis_cluster import QUEUE, _ids_on_every_node, _store

    store = _store(redis_cluster.url)
    try:
        for task_id in _ids_on_every_node(redis_cluster, per_node=1):
            running = TaskState(task_id=task_id, queue=QUEUE, status=TaskStatus.RUNNING)
            first = await store.watch(QUEUE, task_id, 0, WatchStep.START)
            claim = await store.claim(QUEUE, task_id, "a", running=running, watch=first)
            assert claim is Claim.ACQUIRED
            assert await store.claim(QUEUE, task_id, "b", watch=first) is Claim.BUSY
            assert await store.watch(QUEUE, task_id, first, WatchStep.END) == -first
            await store.release(QUEUE, task_id, "a")
            assert await store.claim(QUEUE, task_id, "c", watch=first) is Claim.STALE
            # A retry's copy carries no generation: it claims, and its run starts past the end.
            assert await store.claim(QUEUE, task_id, "d", running=running) is Claim.ACQUIRED
            assert await store.watch(QUEUE, task_id, 0, WatchStep.START) == first + 1
    finally:
        await store.close()

"""Kill -9 of workers at random points of many long runs (issue 40).

Long runs (``long_running=True``) of 10 memoized steps and a streamed reply that continues
from what an earlier run streamed (``tests/integration/fixture_apps/long_kill_app.py``) go to
a fleet of worker processes on the drills' private node and Redis, while a worker with runs in
flight, chosen at random, is SIGKILLed at random times and started again each time (the seed
is printed; ``WECLAW_DRILL_SEED`` replays it). The publisher keeps at most ``WINDOW`` runs in
flight, no more than one worker's concurrency, so a surviving worker always has room for every
run of a killed one: the resume bound measures the watch, not a queue of waiting tasks.

Asserted, from what the handler appended to its calls file (outside the worker) and what the
broker and Redis say:
- every task ``succeeded``, its ``succeeded`` record written once (its timeline), its result
  whole;
- a run starts again only after the worker of its previous run was killed (no stale copy ran
  it, no two runs at once), and every run a kill hit was resumed within
  ``long_run_watch_s + guard_heartbeat_ttl_s`` + slack (``bounds.LONG_RUN_RESUME_BOUND_S``);
- each step's real calls <= 1 + the kills that hit its run while it was the step in progress,
  so the extra step calls are at most the runs in flight at the kills;
- each reader's stream (``App.stream``) holds one "attempt" marker and every word once, in
  order, no gap;
- the end state on the broker: the handler's queue, its DLQ and the vhost's delay ladder
  empty, nothing unacked, and nothing ready once the workers stopped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import delete_queues, forget_task_keys, wait_until
from tests.drills import bounds
from tests.drills.conftest import DrillReport, RabbitNode, drill_settings
from tests.integration.fixture_apps.long_kill_app import KillJob, Line, build_app, lines, words
from tests.integration.processes import (
    LIST_QUEUES_ARGS,
    WorkerProcess,
    fresh_ready_counts,
    queue_names,
    spawn_cli_worker,
)
from weclaw_mq import App, Settings, TaskStatus
from weclaw_mq.admin import dlq
from weclaw_mq.contract.naming import is_shared_name
from weclaw_mq.streaming.events import StreamEvent

APP_PATH = "tests.integration.fixture_apps.long_kill_app:app"
WATCH_S = bounds.LONG_RUN_WATCH_S
HEARTBEAT_S = bounds.LONG_RUN_HEARTBEAT_S
RESUME_BOUND_S = bounds.LONG_RUN_RESUME_BOUND_S
WORKERS = 2
CONCURRENCY = 8
# Runs in flight at most: no more than one worker's concurrency (see the module docstring).
WINDOW = CONCURRENCY
JOB = KillJob(steps=10, step_s=0.2, words=10, word_s=0.05)
# Seconds between kills, drawn uniformly (after the killed worker consumes again).
KILL_GAP_S = (0.5, 2.5)
# A run's stream read to its final event within this, from its publish.
READ_WITHIN_S = 60.0


@dataclass(frozen=True)
class Kill:
    pid: int
    at: float  # just before the SIGKILL (time.time(), the handler's clock)


@dataclass
class Fleet:
    settings: Settings
    queue: str
    record_dir: Path
    log_dir: Path
    workers: list[WorkerProcess] = field(default_factory=list)
    started: int = 0

    def start(self) -> WorkerProcess:
        worker = spawn_cli_worker(
            APP_PATH,
            settings=self.settings,
            app_env={"TEST_QUEUE": self.queue, "TEST_RECORD_DIR": str(self.record_dir)},
            log_path=self.log_dir / f"worker-{self.started}.log",
            concurrency=CONCURRENCY,
        )
        self.started += 1
        return worker

    def in_flight(self, worker: WorkerProcess) -> set[str]:
        """The tasks whose run began in ``worker`` and has not ended there."""
        running: set[str] = set()
        for line in lines(self.record_dir):
            if line.pid != worker.pid:
                continue
            if line.kind == "start":
                running.add(line.task)
            elif line.kind == "end":
                running.discard(line.task)
        return running

    def describe(self) -> str:
        return "\n".join(w.describe() for w in self.workers)


async def _kill_at_random(
    fleet: Fleet, rng: random.Random, kills: int, done: asyncio.Event
) -> list[Kill]:
    """``kills`` times: wait a random gap, SIGKILL a random worker with runs in flight, and
    start another in its place (consuming before the next gap)."""
    made: list[Kill] = []
    while len(made) < kills and not done.is_set():
        await asyncio.sleep(rng.uniform(*KILL_GAP_S))  # the kill's random moment
        busy = [i for i, w in enumerate(fleet.workers) if fleet.in_flight(w)]
        if not busy:
            continue
        index = rng.choice(busy)
        victim = fleet.workers[index]
        made.append(Kill(victim.pid, time.time()))
        victim.signal(signal.SIGKILL)
        assert await victim.wait_exit(10) == -signal.SIGKILL, victim.describe()
        print(f"kill {len(made)}: worker {index} (pid {victim.pid}) at {made[-1].at:.3f}")
        fleet.workers[index] = fleet.start()
        await fleet.workers[index].wait_consuming(30)
    return made


async def _read(app: App, task_id: str, timeout_s: float) -> list[StreamEvent]:
    events = []
    async with asyncio.timeout(timeout_s):
        async for event in app.stream(task_id):
            events.append(event)
    return events


async def _publish_all(
    app: App, queue: str, runs: int, timeout_s: float, published: Path
) -> dict[str, asyncio.Task[list[StreamEvent]]]:
    """Publish ``runs`` jobs, at most ``WINDOW`` unfinished at a time; each read by a reader
    of its stream from its publish on (its final event frees its place)."""
    room = asyncio.Semaphore(WINDOW)
    readers: dict[str, asyncio.Task[list[StreamEvent]]] = {}
    for _ in range(runs):
        await room.acquire()
        task_id = await app.publish(queue, JOB)
        with published.open("a") as file:
            file.write(f"{task_id} {time.time():.3f}\n")
        reader = asyncio.create_task(_read(app, task_id, timeout_s))
        reader.add_done_callback(lambda _: room.release())
        readers[task_id] = reader
    await asyncio.gather(*readers.values(), return_exceptions=True)
    return readers


@dataclass(frozen=True)
class Audit:
    """What the calls file says about the runs and the kills."""

    hits: int  # runs in flight at the kills
    resumes: list[float]  # seconds from the kill to the resumed run's start
    extra_calls: int  # step calls past the first, over every task
    problems: list[str]


def audit(calls: list[Line], kills: list[Kill], task_ids: list[str], steps: int) -> Audit:
    """Check the calls file against the kills (see the module docstring for the rules)."""
    killed_at = {k.pid: k.at for k in kills}
    by_task: dict[str, list[Line]] = defaultdict(list)
    for line in calls:
        by_task[line.task].append(line)
    problems: list[str] = []
    resumes: list[float] = []
    hits = extra = 0
    for task in task_ids:
        mine = by_task.get(task, [])
        starts = [line for line in mine if line.kind == "start"]
        if not starts:
            problems.append(f"{task}: never ran")
            continue
        # Each later run: only after the worker of the run before it was killed.
        for before, after in itertools.pairwise(starts):
            kill_at = killed_at.get(before.pid)
            if kill_at is None or not before.at <= kill_at <= after.at:
                problems.append(
                    f"{task}: a run began at {after.at} (pid {after.pid}) though its run in "
                    f"pid {before.pid} was not killed before"
                )
                continue
            resumes.append(after.at - kill_at)
        last = starts[-1]
        if not any(line.kind == "end" and line.pid == last.pid for line in mine):
            problems.append(f"{task}: its last run (pid {last.pid}) never ended")
        # Allowed calls per step: 1, plus one per kill that hit the run while that step was
        # its latest call (in progress, or returned and not yet recorded).
        allowed: Counter[int] = Counter({i: 1 for i in range(steps)})
        for kill in kills:
            in_pid = [line for line in mine if line.pid == kill.pid]
            if not in_pid or in_pid[-1].kind == "end":
                continue
            hits += 1
            latest = in_pid[-1]
            if latest.kind == "call" and latest.step is not None:
                allowed[latest.step] += 1
        called = Counter(line.step for line in mine if line.kind == "call")
        for i in range(steps):
            if not 1 <= called[i] <= allowed[i]:
                problems.append(f"{task}: step {i} called {called[i]} times, allowed {allowed[i]}")
        extra += sum(max(0, c - 1) for c in called.values())
    return Audit(hits, resumes, extra, problems)


async def _delay_ladder_problems(node: RabbitNode, names: list[str]) -> list[str]:
    """The handler's queues and every shared queue of the vhost (the delay ladder, the
    parking queue) not empty, or holding unacked messages, as the node reports them."""
    rows = json.loads(await node.ctl(*LIST_QUEUES_ARGS, "--formatter", "json") or "[]")
    listed = {
        r["name"]: (int(r["messages_ready"]), int(r["messages_unacknowledged"])) for r in rows
    }
    problems = [f"{n}: not listed" for n in names if n not in listed]
    for name, (ready, unacked) in listed.items():
        if (name in names or is_shared_name(name)) and (ready or unacked):
            problems.append(f"{name}: {ready} ready, {unacked} unacked")
    return problems


async def _drill(
    node: RabbitNode,
    redis_url: str,
    tmp_path: Path,
    report: DrillReport,
    *,
    runs: int,
    kills: int,
) -> None:
    seed = int(os.environ.get("WECLAW_DRILL_SEED", random.randrange(1 << 32)))
    print(f"\nseed {seed} (WECLAW_DRILL_SEED={seed} replays the kill choices and gaps)")
    rng = random.Random(seed)
    began = time.perf_counter()
    settings = drill_settings(
        node.url, redis_url, long_run_watch_s=WATCH_S, guard_heartbeat_ttl_s=HEARTBEAT_S
    )
    queue = f"drill-long-kill-{uuid.uuid4().hex[:8]}"
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    app = build_app(queue, settings=settings, record_dir=record_dir)
    await app.declare()
    fleet = Fleet(settings, queue, record_dir, tmp_path)
    try:
        fleet.workers = [fleet.start() for _ in range(WORKERS)]
        for worker in fleet.workers:
            await worker.wait_consuming(60)
        published = asyncio.create_task(
            _publish_all(
                app, queue, runs, timeout_s=READ_WITHIN_S, published=tmp_path / "published.txt"
            )
        )
        done = asyncio.Event()
        published.add_done_callback(lambda _: done.set())
        made = await _kill_at_random(fleet, rng, kills, done)
        readers = await published
        assert len(made) == kills, f"only {len(made)} of {kills} kills while runs were in flight"

        # Every task succeeded, its succeeded record written once, its result whole.
        task_ids = list(readers)
        expected = words(JOB.words)
        succeeded_writes: Counter[str] = Counter()
        unread = {t: repr(r.exception()) for t, r in readers.items() if r.exception()}
        if unread:
            states = {t: await app.status(t) for t in unread}
            raise AssertionError(f"streams not read to their end: {unread}; status: {states}")
        for task_id, reader in readers.items():
            events = reader.result()
            final = await app.result(task_id, timeout_s=5)
            assert final.status is TaskStatus.SUCCEEDED, (task_id, final, fleet.describe())
            assert final.result == {"steps": list(range(JOB.steps)), "text": "".join(expected)}
            timeline = await app.timeline(task_id, queue=queue)
            succeeded_writes[task_id] = sum(e.status is TaskStatus.SUCCEEDED for e in timeline)
            # One reply that goes on across the kills: one marker, every word once, in order.
            kinds = [e.kind for e in events]
            assert kinds.count("attempt") == 1, (task_id, kinds)
            assert [e.data for e in events if e.kind == "chunk"] == expected, (task_id, events)
            assert events[-1].kind == "final" and events[-1].status == TaskStatus.SUCCEEDED
        twice = {t: c for t, c in succeeded_writes.items() if c != 1}
        assert not twice, f"succeeded records written other than once: {twice}"

        found = audit(lines(record_dir), made, task_ids, JOB.steps)
        assert not found.problems, "\n".join(found.problems)
        assert found.extra_calls <= found.hits, found
        assert found.resumes, "no kill hit a run: nothing was resumed"
        worst = max(found.resumes)
        median = statistics.median(found.resumes)
        assert worst <= RESUME_BOUND_S, (sorted(found.resumes), RESUME_BOUND_S)

        # The end state on the broker: the last watch copies come back to done tasks and go.
        names = queue_names(app)
        problems: list[str] = []

        async def clean() -> bool:
            nonlocal problems
            problems = await _delay_ladder_problems(node, names)
            return not problems

        try:
            await wait_until(clean, 30, "the broker to report every queue empty")
        except AssertionError:
            dead = await dlq.inspect(app, queue)
            raise AssertionError(
                f"end state on the broker: {'; '.join(problems)}; dead letters: {dead}"
            ) from None
        for worker in fleet.workers:
            worker.signal(signal.SIGTERM)
        for worker in fleet.workers:
            assert await worker.wait_exit(30) == 0, worker.describe()
        left = await fresh_ready_counts(node.url, names)
        assert not any(left.values()), f"left in the queues after the workers stopped: {left}"

        seconds = time.perf_counter() - began
        summary = (
            f"{runs} long runs x {JOB.steps} steps + {JOB.words}-word stream, {WORKERS} workers "
            f"x concurrency {CONCURRENCY}, <= {WINDOW} in flight; {kills} kill -9s hit "
            f"{found.hits} runs in flight; {runs}/{runs} succeeded, succeeded record written "
            f"once each; extra step calls {found.extra_calls} (<= {found.hits}); streams whole; "
            f"resumed {len(found.resumes)} runs, max {worst:.2f} s, median {median:.2f} s "
            f"({bounds.long_run_resume_bound_text()}); "
            "broker: queues, delay ladder, DLQ empty, 0 unacked; "
            f"{seconds:.0f} s"
        )
        print(summary)
        report.add(
            f"long runs, kill -9 x{kills}",
            published=runs,
            confirmed=runs,
            processed=sum(1 for t in task_ids if succeeded_writes[t] == 1),
            lost=0,
            duplicated=sum(c - 1 for c in succeeded_writes.values() if c > 1),
            seconds=seconds,
            notes=summary,
        )
    finally:
        for worker in fleet.workers:
            worker.kill()
        await app.close()
        await delete_queues(node.url, queue_names(app))
        await forget_task_keys(redis_url, [queue])


@pytest.mark.timeout(180)
async def test_20_long_runs_survive_2_random_kill_9s(
    node: RabbitNode, drill_redis_url: str, tmp_path: Path, drill_report: DrillReport
) -> None:
    await _drill(node, drill_redis_url, tmp_path, drill_report, runs=20, kills=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_100_long_runs_survive_10_random_kill_9s(
    node: RabbitNode, drill_redis_url: str, tmp_path: Path, drill_report: DrillReport
) -> None:
    await _drill(node, drill_redis_url, tmp_path, drill_report, runs=100, kills=10)

"""Drill: on a real 3-node cluster, kill -9 the node that leads the quorum queue under load.

A producer publishes continuously and a worker (a real process) consumes, both given all three
node URLs. The queue's leader node is killed with SIGKILL. Then:

- no confirmed task is lost and none runs twice (effects counted outside the worker);
- the producer goes on by itself: a publish that fails is retried by the caller with the same
  task id and is confirmed on a surviving node; the failover time the client sees (kill to the
  first confirm of a publish started after it) is printed and lands in the drill table;
- the worker goes on consuming from a surviving node;
- the killed node, started again, rejoins, and the queue is back to 3 members.

Runs alternate which client sits on the doomed node: odd runs the producer, even runs the
worker. The drill runs ``WECLAW_CLUSTER_DRILL_RUNS`` times in a row, 5 by default as the
docs/design/guarantees.md claims (``tests/drills/bounds.py``). Only collected with
``WECLAW_CLUSTER_DRILL=1`` (see ``conftest.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import delete_queues, wait_until
from tests.drills import bounds, drill_app
from tests.drills.conftest import ClusterNodes, DrillRun, RabbitNode, drill_settings
from tests.integration.processes import queue_names
from weclaw_mq import App, Settings, WeclawMQError

pytestmark = [pytest.mark.drill, pytest.mark.cluster]

RUNS = int(os.environ.get("WECLAW_CLUSTER_DRILL_RUNS", str(bounds.CLUSTER_DRILL_RUNS_DEFAULT)))
HEARTBEAT_S = 2
LANES = 10  # publishes in flight
BEFORE_KILL = 300  # confirmed before the kill
AFTER_KILL = 300  # confirmed, of publishes started after the kill, before the producer stops
# How long the caller keeps republishing one task id before it gives up on it.
CALLER_PATIENCE_S = 60.0
FAILOVER_BOUND_S = 30.0


def _settings(urls: str, redis_url: str) -> Settings:
    return drill_settings(urls, redis_url, heartbeat_s=HEARTBEAT_S, confirm_timeout_s=5)


class Producer:
    """Publishes continuously from ``LANES`` lanes; a failed publish is republished with the
    same task id (what a careful caller does) until confirmed or ``CALLER_PATIENCE_S``."""

    def __init__(self, app: App, queue: str) -> None:
        self.app = app
        self.queue = queue
        self.published: list[str] = []
        self.started_at: dict[str, float] = {}  # task id -> first attempt (monotonic)
        self.confirmed_at: dict[str, float] = {}  # task id -> its confirm (monotonic)
        self.given_up: set[str] = set()
        self.errors: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._numbers = itertools.count()
        self._lanes: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._lanes = [asyncio.create_task(self._lane()) for _ in range(LANES)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._lanes)

    def confirmed_since(self, t: float) -> list[str]:
        return [i for i, at in self.started_at.items() if at > t and i in self.confirmed_at]

    async def _lane(self) -> None:
        while not self._stop.is_set():
            n = next(self._numbers)
            task_id = f"{n:06d}-{uuid.uuid4().hex[:12]}"
            self.published.append(task_id)
            began = self.started_at[task_id] = time.monotonic()
            while True:
                try:
                    await self.app.publish(self.queue, drill_app.Job(n=n), task_id=task_id)
                except WeclawMQError as e:
                    self.errors[type(e).__name__] += 1
                    if time.monotonic() - began > CALLER_PATIENCE_S:
                        self.given_up.add(task_id)
                        break
                    # The caller's pacing between attempts, not a wait for an event.
                    await asyncio.sleep(0.1)
                else:
                    self.confirmed_at[task_id] = time.monotonic()
                    break


async def _all_members_back(cluster: ClusterNodes, queue: str, via: RabbitNode) -> bool:
    try:
        members = await cluster.quorum_members(queue, via)
    except Exception:  # the CLI may fail while the node boots: ask again
        return False
    healthy = [n for n, state in members.items() if state in ("leader", "follower")]
    return len(healthy) == 3


@pytest.mark.parametrize("run", range(1, RUNS + 1))
async def test_killing_the_queue_leader_loses_no_confirmed_task(
    run: int,
    rabbit_cluster: ClusterNodes,
    drill_redis_url: str,
    new_drill_run: Callable[[str, Settings], DrillRun],
) -> None:
    cluster = rabbit_cluster
    # The leader goes where the queue is declared: a different node each run.
    home = (run - 1) % 3
    next_node = (home + 1) % 3
    producer_first, worker_first = (home, next_node) if run % 2 else (next_node, home)
    drill = new_drill_run("failover", _settings(cluster.urls(producer_first), drill_redis_url))
    app, queue = drill.app, drill.queue
    declarer = drill_app.build_app(
        queue, settings=_settings(cluster.nodes[home].url, drill_redis_url), effects=drill.effects
    )
    producer = Producer(app, queue)
    victim: RabbitNode | None = None
    try:
        await declarer.declare()
        await declarer.close()
        leader = await cluster.leader(queue, via=cluster.nodes[home])
        members = await cluster.quorum_members(queue, via=cluster.nodes[home])
        assert len(members) == 3, f"the queue has members {members}, not 3"
        victim = cluster.by_name(leader)
        survivor = next(n for n in cluster.nodes if n is not victim)

        worker = await drill.start_worker(
            settings=_settings(cluster.urls(worker_first), drill_redis_url),
            concurrency=10,
            sleep_s=0.005,
            consuming_within_s=30,
        )
        producer.start()
        await wait_until(
            lambda: (
                len(producer.confirmed_at) >= BEFORE_KILL and len(drill.ran()) >= BEFORE_KILL // 3
            ),
            60,
            f"{BEFORE_KILL} confirms and tasks running before the kill",
        )

        killed_wall = time.time()
        killed_at = time.monotonic()
        await victim.kill9()
        await wait_until(
            lambda: len(producer.confirmed_since(killed_at)) >= AFTER_KILL,
            FAILOVER_BOUND_S + 60,
            f"{AFTER_KILL} confirms of publishes started after the kill",
        )
        after_kill = producer.confirmed_since(killed_at)
        failover_s = min(producer.confirmed_at[i] for i in after_kill) - killed_at
        await producer.stop()
        published = set(producer.published)
        confirmed = set(producer.confirmed_at)

        # Tasks confirmed after the kill could only reach the worker through a survivor.
        await drill.wait_ran(after_kill, 60, "the worker to run tasks published after the kill")
        ran_at = _first_effect_times(drill.effects)
        worker_failover_s = min(ran_at[i] for i in after_kill) - killed_wall
        assert worker.popen.poll() is None, f"the worker died: {worker.describe()}"

        restart_began = time.monotonic()
        await victim.start()
        await wait_until(
            lambda: _all_members_back(cluster, queue, survivor),
            60,
            f"{victim.name} to rejoin {queue} (3 members)",
        )
        rejoin_s = time.monotonic() - restart_began
        members_after = await cluster.quorum_members(queue, via=survivor)

        exit_code, stuck = await drill.finish(survivor, confirmed, run_within_s=90)

        errors = ", ".join(f"{k} x{v}" for k, v in producer.errors.most_common()) or "none"
        on_victim = "producer" if run % 2 else "worker"
        row = drill.report(
            f"cluster: kill -9 of the queue leader (run {run})",
            published=len(published),
            confirmed=confirmed,
            notes=f"leader {victim.name} (the {on_victim} was on it); client failover "
            f"{failover_s:.1f} s, worker {worker_failover_s:.1f} s; failed publishes "
            f"(republished): {errors}; node back with 3 members {rejoin_s:.1f} s after restart",
        )
        print(
            f"\ncluster failover run {run}: killed {victim.name}; first confirm after the kill "
            f"{failover_s:.2f} s; worker ran a post-kill task {worker_failover_s:.2f} s after it"
        )
        assert not producer.given_up, f"{len(producer.given_up)} task(s) never confirmed"
        assert set(drill.ran()) <= published, "the worker ran tasks nobody published"
        drill.assert_clean(row, exit_code, stuck)
        assert failover_s <= FAILOVER_BOUND_S
        assert sorted(members_after) == sorted(n.name for n in cluster.nodes), members_after
    finally:
        await producer.stop()
        if drill.worker is not None:
            drill.worker.kill()
        await app.close()
        await declarer.close()
        if victim is not None and victim.pid() is None:
            await victim.start()
        up = next(n for n in cluster.nodes if n.pid() is not None)
        await delete_queues(up.url, queue_names(app))
        drill.forget(list(producer.published))


def _first_effect_times(effects: Path) -> dict[str, float]:
    first: dict[str, float] = {}
    for line in effects.read_text().splitlines():
        task_id, _, at = line.split()
        first.setdefault(task_id, float(at))
    return first

"""Fixtures for the fault drills: private RabbitMQ nodes of our own, and the drill table.

Every disruptive drill (stopped app, paused VM, memory alarm, closed connections, killed node)
runs against nodes that ``ops/cluster/cluster.sh`` starts with their own cookie: the machine's
default broker on 5672 is shared and is never touched here. Each pytest run's nodes are its
own: named ``weclaw-s1-<run id>@localhost``, on free ports picked when they start, with every
file they write (data, logs, cookie, erl_crash.dump) in the run's temporary folder; so two
checkouts can run the drills side by side, and a node an interrupted run left behind is in
nobody's way. They are stopped by pid at the end of the session, and by the safety nets of
``tests/private_servers.py`` if the session does not end well (Ctrl-C, SIGTERM, SIGKILL).

Fixtures:
    private_node     the single node s1, started once per session
    node             the same node, put back in order after each drill (resumed, alarm off,
                     app started, VM restarted if it was killed)
    rabbit_cluster   the 3-node cluster c1..c3, started on first use, stopped at the end
    drill_redis_url  a redis-server of the drills' own on a unix socket, for this session
    drill_report     collects one row per drill; printed as a table at the end of the run
    forget_tasks     deletes the Redis records (results, guard keys) of a drill's tasks
    new_drill_run    makes a DrillRun: one drill's queue, app, effects file and worker, with
                     the steps the drills share (start, wait, stop, count, clean up)

The cluster failover drill is only collected when ``WECLAW_CLUSTER_DRILL=1``
(``tests/drills/run_drills.sh``, i.e. ``make drill``, sets it): it needs three more nodes and
about a minute. A drill that did not run must not look like one that passed, so it is left
out of the collection (and the summary says so) rather than reported as skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import delete_queues, settings_for, wait_until
from tests.drills import bounds, drill_app
from tests.integration.processes import (
    LIST_QUEUES_ARGS,
    QueueCounts,
    WorkerProcess,
    end_state_problems,
    fresh_ready_counts,
    parse_list_queues,
    queue_names,
    ready_count_is,
)
from tests.private_servers import PrivateRedis, PrivateServers, has_env, running
from weclaw_mq import Settings
from weclaw_mq.contract.naming import GUARD_KEY_PREFIX, queue_key_pattern, task_keys

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO_ROOT / "ops" / "cluster" / "cluster.sh"
CLUSTER_DRILL_ENV = "WECLAW_CLUSTER_DRILL"
CLUSTER_DRILL_FILE = "test_cluster_failover_drill.py"
REPORT_JSON_ENV = "WECLAW_DRILL_REPORT_JSON"

NODE_START_TIMEOUT_S = 180.0
CLUSTER_START_TIMEOUT_S = 300.0
CLI_TIMEOUT_S = 60.0
# vm_memory_high_watermark: a fraction no VM fits under raises the alarm at once; 0.4 is
# RabbitMQ's default, which the private node runs with.
ALARM_WATERMARK = "0.000001"
NORMAL_WATERMARK = "0.4"


# -- running cluster.sh -----------------------------------------------------------------------


class ClusterScriptError(RuntimeError):
    pass


@dataclass(frozen=True)
class NodeSpace:
    """Where this run's nodes live: cluster.sh's base folder, the suffix of their names, and
    the run marker the safety nets know them by."""

    base: Path
    cluster_id: str
    servers: PrivateServers
    # More of cluster.sh's settings for these nodes (e.g. WECLAW_CLUSTER_NOFILE).
    extra_env: tuple[tuple[str, str], ...] = ()

    def env(self) -> dict[str, str]:
        return self.servers.env(
            WECLAW_CLUSTER_DIR=str(self.base),
            WECLAW_CLUSTER_ID=self.cluster_id,
            WECLAW_CLUSTER_PORTS="auto",
            **dict(self.extra_env),
        )


def cluster_sh(space: NodeSpace, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> str:
    """Run ``cluster.sh ARGS`` and return its stdout; raise with its stderr if it fails."""
    try:
        done = subprocess.run(
            ["bash", str(CLUSTER_SH), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=space.env(),
            stdin=subprocess.DEVNULL,
            cwd=space.base,
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterScriptError(f"cluster.sh {' '.join(args)} ran past {timeout_s} s") from e
    if done.returncode != 0:
        raise ClusterScriptError(
            f"cluster.sh {' '.join(args)} exited {done.returncode}:\n{done.stderr.strip()}"
        )
    return done.stdout


async def acluster_sh(space: NodeSpace, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> str:
    """``cluster_sh`` without blocking the event loop (drills keep publishing meanwhile)."""
    proc = await asyncio.create_subprocess_exec(
        "bash",
        str(CLUSTER_SH),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=space.env(),
        cwd=space.base,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise ClusterScriptError(f"cluster.sh {' '.join(args)} ran past {timeout_s} s") from None
    except BaseException:  # cancelled: the CLI is ours, it must not outlive the drill
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    if proc.returncode != 0:
        raise ClusterScriptError(
            f"cluster.sh {' '.join(args)} exited {proc.returncode}:\n{err.decode().strip()}"
        )
    return out.decode()


# -- one node ---------------------------------------------------------------------------------


@dataclass
class RabbitNode:
    """One of our private nodes, driven through ``cluster.sh`` and signals to its pid."""

    key: str  # s1, c1, c2, c3
    space: NodeSpace

    @property
    def name(self) -> str:
        return f"weclaw-{self.key}-{self.space.cluster_id}@localhost"

    @property
    def port(self) -> int:
        """The AMQP port cluster.sh picked when the node first started (kept on restarts)."""
        return int((self.space.base / self.key / "ports").read_text().split()[0])

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def pid_file(self) -> Path:
        return self.space.base / self.key / "rabbitmq.pid"

    @property
    def launcher_pid_file(self) -> Path:
        return self.space.base / self.key / "launcher.pid"

    def pid(self) -> int | None:
        """The beam process's pid, or None if it does not run (the file may be stale)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if has_env(pid, f"RABBITMQ_NODENAME={self.name}") else None

    def require_pid(self) -> int:
        pid = self.pid()
        if pid is None:
            raise AssertionError(f"{self.name} is not running (pid file {self.pid_file})")
        return pid

    async def ctl(self, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> str:
        return await acluster_sh(self.space, "ctl", self.key, *args, timeout_s=timeout_s)

    async def diag(self, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> str:
        return await acluster_sh(self.space, "diag", self.key, *args, timeout_s=timeout_s)

    async def queues(self, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> str:
        return await acluster_sh(self.space, "queues", self.key, *args, timeout_s=timeout_s)

    # The faults.
    async def stop_app(self) -> None:
        await self.ctl("stop_app")

    async def start_app(self) -> None:
        await self.ctl("start_app")
        await self.ctl("await_startup", "--timeout", "60", timeout_s=90)

    def pause(self) -> int:
        """SIGSTOP the VM: sockets stay open, nothing answers. Always ``resume()`` after."""
        pid = self.require_pid()
        os.kill(pid, signal.SIGSTOP)
        return pid

    def resume(self) -> None:
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    async def kill9(self) -> int:
        """SIGKILL the VM by pid and wait until it is gone; returns the pid."""
        pid = self.require_pid()
        os.kill(pid, signal.SIGCONT)  # a paused VM would otherwise die only when resumed
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running(pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} (pid {pid}) still runs 10 s after SIGKILL")
            await asyncio.sleep(0.02)
        return pid

    async def start(self) -> None:
        """Start the VM (after ``kill9``); returns once the node runs."""
        await acluster_sh(self.space, "node-start", self.key, timeout_s=NODE_START_TIMEOUT_S)

    def pids_to_stop(self) -> list[int]:
        """The VM's pid and its launcher's, as far as their pid files exist."""
        pids = []
        for file in (self.pid_file, self.launcher_pid_file):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(file.read_text().strip()))
        return pids

    def terminate(self) -> None:
        """Stop the VM and its launcher by pid (SIGTERM, SIGKILL after a grace): the node is
        throwaway, so no CLI round trip; its logs stay in the run's folder."""
        self.space.servers.stop(self.pids_to_stop())

    async def set_memory_alarm(self, on: bool) -> None:
        """Raise (or clear) the memory alarm and wait until the node reports it so."""
        await self.ctl("set_vm_memory_high_watermark", ALARM_WATERMARK if on else NORMAL_WATERMARK)
        deadline = time.monotonic() + 30
        while ("Memory alarm" in await self.diag("alarms")) != on:
            if time.monotonic() > deadline:
                raise AssertionError(f"memory alarm on {self.name} not {'set' if on else 'clear'}")
            await asyncio.sleep(0.2)

    async def close_all_connections(self, reason: str = "drill") -> None:
        await self.ctl("close_all_connections", reason)

    async def arm_cut(self, trigger: Path, reason: str = "drill") -> asyncio.Task[str]:
        """Arm a ``close_all_connections`` that fires the moment ``trigger`` exists.

        rabbitmqctl needs one to five seconds to boot an Erlang VM under load, too slow to
        aim a cut at a 10-second publish. So the CLI is started now, waits on the node for
        the file, and then makes the same call ``rabbitmqctl close_all_connections`` makes
        (``rabbit_networking:close_all_connections/1``). Returns once armed; the task ends
        with "cut" once it fired.
        """
        armed = trigger.with_name(trigger.name + ".armed")
        for path in (trigger, armed):
            if not all(c.isalnum() or c in "/._-" for c in str(path)):
                raise ValueError(f"unsafe path for an Erlang string: {path}")
        # Deleting the .armed file disarms it (see disarm_cut); it gives up after 120 s.
        expr = (
            f'ok = file:write_file("{armed}", <<>>), '
            f'Wait = fun W(N) -> case filelib:is_regular("{trigger}") of true -> ok; '
            f'false -> case filelib:is_regular("{armed}") of false -> disarmed; '
            "true when N > 0 -> timer:sleep(5), W(N - 1); true -> timeout end end end, "
            f'case Wait(24000) of ok -> rabbit_networking:close_all_connections("{reason}"), '
            "cut; Other -> Other end."
        )
        task = asyncio.create_task(self.ctl("eval", expr, timeout_s=180))
        deadline = time.monotonic() + 60
        while not armed.exists():
            if task.done():
                task.result()  # raises what went wrong
                raise AssertionError("the armed cut ended before it was armed")
            if time.monotonic() > deadline:
                task.cancel()
                raise AssertionError(f"could not arm a cut on {self.name} within 60 s")
            await asyncio.sleep(0.02)
        return task

    @staticmethod
    async def disarm_cut(trigger: Path, task: asyncio.Task[str]) -> None:
        """Disarm a cut that was not fired (a failed drill must not cut later)."""
        trigger.with_name(trigger.name + ".armed").unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)

    async def queue_counts(self, names: Sequence[str]) -> dict[str, QueueCounts]:
        """Ready and unacked counts of ``names``, as this node reports them."""
        out = await self.ctl(*LIST_QUEUES_ARGS, "--formatter", "json")
        return parse_list_queues(out, names)

    async def app_state(self) -> tuple[bool, bool]:
        """(the app runs, a memory alarm is on), asked in one CLI call: each call boots an
        Erlang VM (1 to 5 s under load), and ``restore`` runs before and after every drill."""
        expr = "{rabbit:is_running(), catch rabbit_alarm:get_alarms()}."
        try:
            out = await self.ctl("eval", expr, timeout_s=30)
        except ClusterScriptError:
            return False, False
        running = out.strip().startswith("{true")
        # e.g. {true,[{{resource_limit,memory,'weclaw-s1-...@localhost'},[]}]} (~p may wrap)
        return running, running and re.search(r"resource_limit,\s*memory", out) is not None

    async def restore(self) -> None:
        """Undo whatever a drill did: resumed, alarm off, app running, VM running."""
        if self.pid() is None:
            await self.start()
            return
        self.resume()
        running, alarm = await self.app_state()
        if not running:
            await self.start_app()
            _, alarm = await self.app_state()
        if alarm:
            await self.set_memory_alarm(False)


@pytest.fixture(scope="session")
def node_space(private_servers: PrivateServers) -> NodeSpace:
    """This run's base folder and node-name suffix for cluster.sh."""
    return NodeSpace(private_servers.folder("rabbit"), private_servers.run_id, private_servers)


@contextlib.contextmanager
def single_node(space: NodeSpace, what: str) -> Iterator[RabbitNode]:
    """A private single RabbitMQ node in ``space``, stopped on every exit path; a node that
    cannot start fails the test saying what it needs (``what``: for the drills, with TLS...)."""
    node = RabbitNode("s1", space)
    try:
        try:
            cluster_sh(space, "single-start", timeout_s=NODE_START_TIMEOUT_S)
        except ClusterScriptError as e:
            pytest.fail(
                f"cannot start the private RabbitMQ node {what} ({e}); it needs "
                "/usr/lib/rabbitmq/bin (Debian package rabbitmq-server)",
                pytrace=False,
            )
        yield node
    finally:
        node.terminate()


async def new_connection_opens(url: str, patience_s: float) -> bool:
    """Whether a NEW connection completes its AMQP handshake within ``patience_s`` (a node out
    of file handles accepts TCP and never answers)."""
    import aio_pika

    try:
        conn = await asyncio.wait_for(aio_pika.connect(url, timeout=patience_s), patience_s + 1)
    except (TimeoutError, aio_pika.exceptions.AMQPConnectionError):
        return False
    await conn.close()
    return True


@contextlib.contextmanager
def low_nofile_node(servers: PrivateServers, name: str, nofile: int) -> Iterator[RabbitNode]:
    """A private single node of its own space ``name``, started with ``ulimit -n nofile``."""
    space = NodeSpace(
        servers.folder(f"rabbit-{name}"),
        f"{servers.run_id}-{name}",
        servers,
        extra_env=(("WECLAW_CLUSTER_NOFILE", str(nofile)),),
    )
    with single_node(space, f"with ulimit -n {nofile}") as node:
        yield node


@pytest.fixture(scope="session")
def private_node(node_space: NodeSpace) -> Iterator[RabbitNode]:
    """The private single node, started for this session and stopped at its end."""
    with single_node(node_space, "for the drills") as node:
        yield node


@pytest.fixture
async def node(private_node: RabbitNode) -> AsyncIterator[RabbitNode]:
    """The private node, put back in working order after the drill whatever happened."""
    await private_node.restore()
    yield private_node
    await private_node.restore()


@dataclass
class ClusterNodes:
    nodes: list[RabbitNode]

    def urls(self, first: int = 0) -> str:
        """Every node's URL, comma-separated, starting at ``nodes[first]``."""
        order = self.nodes[first:] + self.nodes[:first]
        return ",".join(n.url for n in order)

    def by_name(self, name: str) -> RabbitNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    async def quorum_members(self, queue: str, via: RabbitNode) -> dict[str, str]:
        """node name -> Raft state of each member of ``queue``, as ``via`` sees it."""
        out = await via.queues("quorum_status", queue, "--formatter", "json")
        return {row["Node Name"]: str(row["Raft State"]) for row in json.loads(out)}

    async def leader(self, queue: str, via: RabbitNode) -> str:
        out = await via.ctl("list_queues", "name", "leader", "--formatter", "json")
        for row in json.loads(out):
            if row["name"] == queue:
                return str(row["leader"])
        raise AssertionError(f"queue {queue!r} not listed by {via.name}")


@pytest.fixture(scope="session")
def rabbit_cluster(node_space: NodeSpace) -> Iterator[ClusterNodes]:
    """The 3-node cluster (started on first use, stopped at the end of the session)."""
    cluster = ClusterNodes([RabbitNode(k, node_space) for k in ("c1", "c2", "c3")])
    try:
        try:
            cluster_sh(node_space, "start", timeout_s=CLUSTER_START_TIMEOUT_S)
        except ClusterScriptError as e:
            pytest.fail(f"cannot start the 3-node drill cluster: {e}", pytrace=False)
        yield cluster
    finally:
        # All three at once: stopped one by one, the last would wait for its lost peers.
        node_space.servers.stop([p for n in cluster.nodes for p in n.pids_to_stop()])


# -- Redis for the drills ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def drill_redis_url(
    request: pytest.FixtureRequest, private_servers: PrivateServers
) -> Iterator[str]:
    """A Redis of the drills' own on a unix socket, so their counts cannot be spoiled by
    anyone restarting the shared Redis; the shared one only when redis-server is missing."""
    if shutil.which("redis-server") is None:
        yield str(request.getfixturevalue("redis_url"))
        return
    redis = PrivateRedis(private_servers, private_servers.folder("drill-redis"))
    try:
        redis.start()
    except RuntimeError as e:
        pytest.fail(f"the drills' private Redis: {e}", pytrace=False)
    try:
        yield redis.url
    finally:
        redis.stop()


@pytest.fixture
async def forget_tasks(drill_redis_url: str) -> AsyncIterator[Callable[[str, list[str]], None]]:
    """Register (queue, task ids); their results and guard keys are deleted at teardown.

    Drills register ids one at a time (a publisher registers each new task), so the ids are
    gathered per queue and each queue's guard keys are scanned for once, not once per
    registration: hundreds of full SCANs of the drills' Redis made a teardown outlast the
    test's timeout."""
    registered: dict[str, list[str]] = {}

    def register(queue: str, ids: list[str]) -> None:
        registered.setdefault(queue, []).extend(ids)

    yield register
    client = aioredis.Redis.from_url(drill_redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        for queue, ids in registered.items():
            keys = [k for t in ids for k in task_keys(queue, t)]
            pattern = queue_key_pattern(GUARD_KEY_PREFIX, queue)
            keys += [k async for k in client.scan_iter(match=pattern, count=1000)]
            for start in range(0, len(keys), 500):
                await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()


# -- the steps drills share -------------------------------------------------------------------


def drill_settings(url: str, redis_url: str, **overrides: Any) -> Settings:
    """What every drill runs with, unless it says otherwise: reconnects within a second, short
    guard leases and retry delays (a dead worker's tasks come back in seconds), results kept
    long enough to be counted, and the drills' short shutdown grace."""
    defaults: dict[str, Any] = {
        "reconnect_max_delay_s": 1,
        "guard_lease_s": 2,
        "retry_delay_s": 0.2,
        "result_ttl_s": 600,
        "done_ttl_s": 600,
        "shutdown_grace_s": drill_app.GRACE_S,
    }
    return settings_for(url, redis_url, **{**defaults, **overrides})


class DrillRun:
    """One drill's queue, effects file, app (which declares and publishes, never consumes)
    and worker process, with the steps every drill takes: start the worker, wait until the
    tasks ran and the queue drained, check the end state on the broker (nothing unacked,
    nothing left in the queue, its delay queues or its DLQ), stop the worker, read the queues
    afresh, count the effects into the drill table."""

    def __init__(
        self,
        kind: str,
        *,
        settings: Settings,
        work_dir: Path,
        report: DrillReport,
        forget: Callable[[str, list[str]], None],
    ) -> None:
        self.started = time.perf_counter()
        self.queue = f"drill-{kind}-{uuid.uuid4().hex[:8]}"
        self.effects = work_dir / "effects.log"
        self.settings = settings
        self.app = drill_app.build_app(self.queue, settings=settings, effects=self.effects)
        self.worker: WorkerProcess | None = None
        self._work_dir = work_dir
        self._report = report
        self._forget_tasks = forget
        self.end_state = "broker end state not checked"
        self._expected_ready: dict[str, int] = {}

    def task_ids(self, count: int, prefix: str = "") -> list[str]:
        """New task ids, whose Redis records are deleted when the drill ends."""
        ids = [f"{prefix}{uuid.uuid4()}" for _ in range(count)]
        self.forget(ids)
        return ids

    def forget(self, ids: list[str]) -> None:
        """Delete the Redis records of these tasks when the drill ends."""
        self._forget_tasks(self.queue, ids)

    async def start_worker(
        self,
        *,
        concurrency: int = 1,
        sleep_s: float = 0.0,
        settings: Settings | None = None,
        consuming_within_s: float | None = 20.0,
    ) -> WorkerProcess:
        """Start the worker process, with the app's settings unless given others, and wait
        until it consumes (``consuming_within_s=None``: do not wait)."""
        self.worker = drill_app.spawn_worker(
            queue=self.queue,
            settings=settings or self.settings,
            effects=self.effects,
            log_path=self._work_dir / "worker.log",
            concurrency=concurrency,
            sleep_s=sleep_s,
        )
        if consuming_within_s is not None:
            await self.worker.wait_consuming(consuming_within_s)
        return self.worker

    def ran(self) -> Counter[str]:
        """How many times each task id's effect happened so far."""
        return drill_app.read_effects(self.effects)

    async def wait_ran(
        self, expected: int | Collection[str], timeout_s: float, what: str = ""
    ) -> None:
        """Until ``expected`` tasks ran (a count), or every one of those task ids ran."""
        if isinstance(expected, int):
            count = expected
            await wait_until(
                lambda: len(self.ran()) >= count, timeout_s, what or f"{count} tasks to run"
            )
        else:
            wanted = set(expected)
            await wait_until(
                lambda: set(self.ran()) >= wanted, timeout_s, what or "every task to run"
            )

    async def wait_drained(self, url: str, timeout_s: float = 30.0) -> None:
        """Until the queue on the node at ``url`` is empty, i.e. the acks have arrived."""
        await wait_until(
            lambda: ready_count_is(url, self.queue, 0), timeout_s, "the queue to drain"
        )

    async def stop_worker(self) -> tuple[int, int]:
        """SIGTERM the worker: (exit code, handler tasks stuck at the stop)."""
        assert self.worker is not None, "the drill started no worker"
        return await drill_app.stop_worker(self.worker)

    async def finish(
        self,
        node: RabbitNode,
        expected: int | Collection[str],
        *,
        run_within_s: float = 60.0,
        drain_within_s: float = 30.0,
    ) -> tuple[int, int]:
        """Wait until ``expected`` ran and the queue drained, check the end state on the
        broker (``check_end_state``), then stop the worker."""
        await self.wait_ran(expected, run_within_s)
        await self.wait_drained(node.url, drain_within_s)
        await self.check_end_state(node)
        stopped = await self.stop_worker()
        await self.check_left_after_stop(node)
        return stopped

    async def check_end_state(
        self, node: RabbitNode, expected_ready: dict[str, int] | None = None, within_s: float = 30
    ) -> None:
        """Until the broker itself reports the drill's end state, or fail: every queue of the
        app (the task queue, its delay queues, its DLQ) listed, with nothing unacked and
        nothing ready except ``expected_ready``. Read with rabbitmqctl on the node, not from
        our metrics; called while the worker still runs, so a delivery it holds unsettled
        shows as unacked. Those counts are statistics up to 5 s old (the broker's
        collect_statistics_interval): ``check_left_after_stop`` is the fresh reading."""
        names = queue_names(self.app)
        expected = expected_ready or {}
        problems: list[str] = []

        async def as_expected() -> bool:
            nonlocal problems
            problems = end_state_problems(await node.queue_counts(names), names, expected)
            return not problems

        try:
            await wait_until(as_expected, within_s, "the broker to report the end state")
        except AssertionError:
            raise AssertionError(f"end state on the broker: {'; '.join(problems)}") from None
        self._expected_ready = expected
        dlq = sum(expected.get(n, 0) for n in names if n.endswith(".dlq"))
        self.end_state = f"broker: {len(names)} queues, 0 unacked, {dlq} in the DLQ"

    async def check_left_after_stop(self, node: RabbitNode) -> None:
        """Once the worker is gone, every queue's ready count read afresh (passive declare)
        is the expected one: a delivery it had left unacked would be ready again now."""
        names = queue_names(self.app)
        found = await fresh_ready_counts(node.url, names)
        wanted = {n: self._expected_ready.get(n, 0) for n in names}
        assert found == wanted, f"left in the queues after the worker stopped: {found}"
        self.end_state += " (and 0 ready after the worker's exit)"

    def report(self, drill: str, *, published: int, confirmed: set[str], notes: str) -> DrillRow:
        """The drill's row in the table, counted from the effects against ``confirmed``."""
        return self._report.add_counts(
            drill,
            published=published,
            confirmed=confirmed,
            effects=self.ran(),
            seconds=time.perf_counter() - self.started,
            notes=f"{notes}; {self.end_state}",
        )

    def assert_clean(self, row: DrillRow, exit_code: int, stuck: int) -> None:
        """No confirmed task lost, none run twice, and the worker stopped within its grace."""
        assert row.lost == 0, f"{row.lost} confirmed task(s) never ran"
        assert row.duplicated == 0, f"{row.duplicated} duplicate run(s)"
        assert exit_code == 0, self.describe_worker()
        assert stuck == 0, drill_app.stuck_at_stop(stuck)

    def describe_worker(self) -> str:
        return "no worker" if self.worker is None else self.worker.describe()

    async def clean_up(self, node: RabbitNode) -> None:
        """Kill the worker, close the app, put ``node`` back in order, delete the queues."""
        if self.worker is not None:
            self.worker.kill()
        await self.app.close()
        await node.restore()
        await delete_queues(node.url, queue_names(self.app))


@pytest.fixture
def new_drill_run(
    tmp_path: Path, drill_report: DrillReport, forget_tasks: Callable[[str, list[str]], None]
) -> Callable[[str, Settings], DrillRun]:
    """``new_drill_run(kind, settings)``: a DrillRun in this test's tmp_path and report."""

    def new(kind: str, settings: Settings) -> DrillRun:
        return DrillRun(
            kind, settings=settings, work_dir=tmp_path, report=drill_report, forget=forget_tasks
        )

    return new


# -- the drill table --------------------------------------------------------------------------


@dataclass(frozen=True)
class DrillRow:
    drill: str
    queue: str
    published: int
    confirmed: int
    processed: int
    lost: int
    duplicated: int
    seconds: float
    notes: str


@dataclass
class DrillReport:
    rows: list[DrillRow] = field(default_factory=list)

    def add(
        self,
        drill: str,
        *,
        published: int,
        confirmed: int,
        processed: int,
        lost: int,
        duplicated: int,
        seconds: float,
        queue: str = "weclaw_mq (quorum)",
        notes: str = "",
    ) -> DrillRow:
        row = DrillRow(
            drill, queue, published, confirmed, processed, lost, duplicated, seconds, notes
        )
        self.rows.append(row)
        return row

    def add_counts(
        self,
        drill: str,
        *,
        published: int,
        confirmed: set[str],
        effects: Counter[str],
        seconds: float,
        queue: str = "weclaw_mq (quorum)",
        notes: str = "",
    ) -> DrillRow:
        """A row from the confirmed task ids and the effects counted outside the worker:
        lost = confirmed but never run; duplicated = extra runs of one task id."""
        return self.add(
            drill,
            published=published,
            confirmed=len(confirmed),
            processed=len(confirmed & set(effects)),
            lost=len(confirmed - set(effects)),
            duplicated=sum(c - 1 for c in effects.values() if c > 1),
            seconds=seconds,
            queue=queue,
            notes=notes,
        )

    def table(self) -> list[str]:
        head = (
            "drill",
            "queue",
            "published",
            "confirmed",
            "processed",
            "lost",
            "duplicated",
            "time",
            "notes",
        )
        body = [
            (
                r.drill,
                r.queue,
                str(r.published),
                str(r.confirmed),
                str(r.processed),
                str(r.lost),
                str(r.duplicated),
                f"{r.seconds:.1f} s",
                r.notes,
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]

        def line(cells: tuple[str, ...]) -> str:
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        return [line(head), rule, *(line(r) for r in body)]


_REPORT = pytest.StashKey[DrillReport]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_REPORT] = DrillReport()
    config.addinivalue_line(
        "markers", "cluster: needs the local 3-node RabbitMQ cluster (ops/cluster/cluster.sh)"
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name == CLUSTER_DRILL_FILE and os.environ.get(CLUSTER_DRILL_ENV) != "1":
        return True
    return None


@pytest.fixture
def drill_report(request: pytest.FixtureRequest) -> DrillReport:
    return request.config.stash[_REPORT]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    report = config.stash.get(_REPORT, None)
    if report is None:
        return
    if report.rows:
        terminalreporter.write_sep("=", "fault drills: counts from the runs above")
        for line in report.table():
            terminalreporter.write_line(line)
        terminalreporter.write_line("bounds asserted (tests/drills/bounds.py):")
        for line in bounds.bound_texts():
            terminalreporter.write_line(f"  {line}")
        path = os.environ.get(REPORT_JSON_ENV)
        if path:
            Path(path).write_text(json.dumps([r.__dict__ for r in report.rows], indent=2))
            terminalreporter.write_line(f"(also written to {path})")
    if os.environ.get(CLUSTER_DRILL_ENV) != "1":
        terminalreporter.write_line(
            f"cluster failover drill not collected: set {CLUSTER_DRILL_ENV}=1 "
            "(make drill does) to run it on the local 3-node cluster"
        )

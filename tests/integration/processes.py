"""Real worker processes for fault tests: start, wait until consuming, kill -9, clean up.

Every process is started by this module and ended by its pid, never by name; a ``WorkerFleet``
SIGKILLs whatever is still running when its test ends (pass or fail) and deletes its queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika

from tests.broker_ctl import abroker_ctl
from tests.conftest import (
    delete_queues,
    forget_task_keys,
    get_message,
    queue_depth,
    settings_for,
    wait_until,
)
from tests.integration.fixture_apps.worker_app import Event, Job, build_app, read_events
from weclaw_mq import App, Settings, TaskStatus
from weclaw_mq.wire.topology import queue_declarations

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_APP = "tests.integration.fixture_apps.worker_app:app"
# The log line the worker writes once its consumers are registered.
CONSUMING_MARK = " consuming "


def cli_executable() -> str:
    """The installed ``weclaw-mq`` script of the interpreter running the tests."""
    beside = Path(sys.executable).with_name("weclaw-mq")
    if beside.exists():
        return str(beside)
    found = shutil.which("weclaw-mq")
    if found is None:
        raise RuntimeError("the weclaw-mq script is not installed; run 'pip install -e .'")
    return found


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as ``WECLAW_MQ_*`` variables, so a child process reads the same values."""
    env: dict[str, str] = {}
    for field, value in settings.model_dump().items():
        if value is None:
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"WECLAW_MQ_{field.upper()}"] = str(value)
    return env


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str


async def start_cli(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    """Start ``weclaw-mq ARGS`` from the repository root with ``env`` added to ours, its stdin,
    stdout and stderr piped."""
    return await asyncio.create_subprocess_exec(
        cli_executable(),
        *args,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finish_cli(
    proc: asyncio.subprocess.Process,
    args: Sequence[str],
    *,
    stdin: bytes | None = None,
    timeout_s: float = 30.0,
) -> CliResult:
    """Wait for a ``start_cli`` process (feeding it ``stdin``) and collect what it wrote."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"weclaw-mq {' '.join(args)} ran past {timeout_s} s") from None
    assert proc.returncode is not None
    return CliResult(proc.returncode, out.decode(), err.decode())


async def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    timeout_s: float = 30.0,
) -> CliResult:
    """Run ``weclaw-mq ARGS`` from the repository root with ``env`` added to ours."""
    proc = await start_cli(*args, env=env)
    return await finish_cli(proc, args, stdin=stdin, timeout_s=timeout_s)


def one_error_line(result: CliResult) -> str:
    """The single stderr line of a failed command; fails on a traceback or on silence."""
    assert result.code != 0, result
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    return lines[0]


@dataclass
class WorkerProcess:
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        tail = "\n".join(self.log().splitlines()[-20:])
        return f"worker pid {self.pid} (exit {self.popen.poll()}), log tail:\n{tail}"

    async def wait_for_log(self, mark: str, timeout_s: float, what: str) -> None:
        """Until ``mark`` is in the log or the process has ended (the caller tells which)."""
        await wait_until(
            lambda: mark in self.log() or self.popen.poll() is not None, timeout_s, what
        )

    async def wait_consuming(self, timeout_s: float = 20.0) -> None:
        await self.wait_for_log(
            CONSUMING_MARK, timeout_s, f"worker pid {self.pid} to start consuming"
        )
        if self.popen.poll() is not None:
            raise AssertionError(f"worker exited before consuming: {self.describe()}")

    async def wait_exit(self, timeout_s: float = 20.0) -> int:
        await wait_until(
            lambda: self.popen.poll() is not None, timeout_s, f"worker pid {self.pid} to exit"
        )
        code = self.popen.returncode
        assert code is not None
        return code

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL by pid and reap; a no-op once the process has ended."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)


def spawn_cli_worker(
    app_path: str,
    *,
    settings: Settings,
    app_env: dict[str, str],
    log_path: Path,
    concurrency: int = 1,
    extra_args: Sequence[str] = (),
    cwd: Path = REPO_ROOT,
) -> WorkerProcess:
    """Start ``weclaw-mq worker APP_PATH`` from ``cwd`` (the repository root), with ``settings``
    and the app's own ``app_env`` in its environment; its output goes to ``log_path``.

    The caller owns the process: kill it by pid (``WorkerProcess.kill``) when done.
    """
    env = {**os.environ, **settings_env(settings), **app_env, "PYTHONUNBUFFERED": "1"}
    args = [cli_executable(), "worker", app_path, "--concurrency", str(concurrency), *extra_args]
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            args,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    # For the safety nets of tests/private_servers.py: a worker must not outlive pytest either.
    log_path.with_suffix(".pid").write_text(str(popen.pid))
    return WorkerProcess(popen, log_path)


class WorkerFleet:
    """The worker processes of one test, all on one handler queue of the fixture app.

    ``app`` is the same fixture app built in this process (same queue, same settings), used
    to declare the queues before publishing and to publish; it never consumes.
    """

    def __init__(self, *, queue: str, work_dir: Path, settings: Settings) -> None:
        self.queue = queue
        self.settings = settings
        self.work_dir = work_dir
        self.record_dir = work_dir / "records"
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.app: App = build_app(queue, settings=settings, record_dir=self.record_dir)
        self.workers: list[WorkerProcess] = []

    def start(
        self,
        *,
        concurrency: int = 1,
        sleep_s: float = 0.0,
        crash_on: str | None = None,
        mode: str = "sleep",
        extra_args: Sequence[str] = (),
    ) -> WorkerProcess:
        """Start ``weclaw-mq worker`` on the fixture app; its stderr goes to a log file."""
        app_env = {
            "TEST_QUEUE": self.queue,
            "TEST_RECORD_DIR": str(self.record_dir),
            "TEST_HANDLER_SLEEP_S": str(sleep_s),
            "TEST_HANDLER_MODE": mode,
        }
        if crash_on is not None:
            app_env["TEST_CRASH_ON"] = crash_on
        worker = spawn_cli_worker(
            FIXTURE_APP,
            settings=self.settings,
            app_env=app_env,
            log_path=self.work_dir / f"worker-{len(self.workers)}.log",
            concurrency=concurrency,
            extra_args=extra_args,
        )
        self.workers.append(worker)
        return worker

    async def start_consuming(self, **kwargs: Any) -> WorkerProcess:
        worker = self.start(**kwargs)
        await worker.wait_consuming()
        return worker

    async def publish_jobs(self, n: int) -> list[str]:
        """Publish ``n`` tasks ``t0``..``t<n-1>`` to the fleet's queue; their ids, in order."""
        return [await self.app.publish(self.queue, Job(text=f"t{i}")) for i in range(n)]

    async def assert_all_succeed(self, ids: Sequence[str], timeout_s: float = 30.0) -> None:
        """Each task's stored result says it succeeded (waiting for it up to ``timeout_s``)."""
        for task_id in ids:
            state = await self.app.result(task_id, timeout_s=timeout_s)
            assert state.status is TaskStatus.SUCCEEDED, state

    def events(self, kind: str | None = None) -> list[Event]:
        return [e for e in read_events(self.record_dir) if kind is None or e.kind == kind]

    def task_ids(self, kind: str) -> set[str]:
        return {e.task_id for e in self.events(kind)}

    def queue_names(self) -> list[str]:
        return queue_names(self.app)

    def kill_all(self) -> None:
        for worker in self.workers:
            worker.kill()


@contextlib.contextmanager
def spawned_workers(
    app_path: str, *, settings: Settings, app_env: dict[str, str], log_dir: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """A starter of ``app_path``'s workers in processes of their own (``start(concurrency,
    **setting overrides)``), each logging to ``log_dir/worker-<n>.log``; every one started is
    killed by pid on the way out."""
    workers: list[WorkerProcess] = []

    def start(concurrency: int = 1, **overrides: Any) -> WorkerProcess:
        worker = spawn_cli_worker(
            app_path,
            settings=settings.model_copy(update=overrides) if overrides else settings,
            app_env=app_env,
            log_path=log_dir / f"worker-{len(workers)}.log",
            concurrency=concurrency,
        )
        workers.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in workers:
            worker.kill()


def queue_names(app: App) -> list[str]:
    """Every queue of every handler of ``app`` (Q, Q.dlq, lanes; not the vhost's ladder)."""
    return sorted(
        {n for spec in app.handlers.values() for n, _ in queue_declarations(spec.queue_spec())}
    )


# What the ``open_fleet`` fixture gives: ``worker_fleet`` with the test's own names bound.
OpenFleet = Callable[..., contextlib.AbstractAsyncContextManager[WorkerFleet]]


@contextlib.asynccontextmanager
async def worker_fleet(
    *, queue: str, work_dir: Path, broker_url: str, redis_url: str, **overrides: Any
) -> AsyncIterator[WorkerFleet]:
    """A fleet whose queues are declared now; at exit every worker is SIGKILLed, then every
    queue is deleted (in that order: a live worker would declare them again)."""
    fleet = WorkerFleet(
        queue=queue, work_dir=work_dir, settings=settings_for(broker_url, redis_url, **overrides)
    )
    try:
        await fleet.app.declare()
        yield fleet
    finally:
        fleet.kill_all()
        await fleet.app.close()
        await delete_queues(broker_url, fleet.queue_names())
        await forget_task_keys(redis_url, [queue])


async def ready_count(broker_url: str, queue: str) -> int:
    """Messages ready in ``queue`` (unacked ones are not counted: they belong to a consumer)."""
    conn = await aio_pika.connect(broker_url)
    try:
        return await queue_depth(await conn.channel(), queue)
    finally:
        await conn.close()


async def ready_count_is(broker_url: str, queue: str, expected: int) -> bool:
    return await ready_count(broker_url, queue) == expected


async def all_empty(broker_url: str, names: list[str]) -> bool:
    counts = [await ready_count(broker_url, name) for name in names]
    return not any(counts)


async def take_one(broker_url: str, queue: str) -> aio_pika.abc.AbstractIncomingMessage | None:
    """Fetch the head of ``queue`` and ack it; None when the queue is empty."""
    conn = await aio_pika.connect(broker_url)
    try:
        return await get_message(await conn.channel(), queue)
    finally:
        await conn.close()


# -- the broker's own counts ------------------------------------------------------------------


@dataclass(frozen=True)
class QueueCounts:
    """A queue's counts as the broker reports them (``rabbitmqctl list_queues``)."""

    ready: int
    unacked: int


LIST_QUEUES_ARGS = ("list_queues", "-q", "name", "messages_ready", "messages_unacknowledged")


def parse_list_queues(out: str, names: Sequence[str]) -> dict[str, QueueCounts]:
    """``names`` -> their counts, from ``rabbitmqctl list_queues ... --formatter json``
    output; a queue the broker does not list is missing from the answer."""
    wanted = set(names)
    return {
        row["name"]: QueueCounts(int(row["messages_ready"]), int(row["messages_unacknowledged"]))
        for row in json.loads(out or "[]")
        if row["name"] in wanted
    }


async def broker_queue_counts(names: Sequence[str]) -> dict[str, QueueCounts]:
    """Ready and unacked counts of ``names`` on the tests' broker, read with
    ``rabbitmqctl`` (root, as in CI): the broker's word, not our metrics. AMQP's passive
    declare reports ready messages only, so "nothing unacked" needs the CLI.

    These are the queue's statistics, which the broker refreshes every
    ``collect_statistics_interval`` (5 s by default): a reading may be that old. A check that
    needs a reading taken after some moment must prove it (see the marker in
    test_promises.py); a check of the end state also reads the ready counts afresh with a
    passive declare once the consumer is gone (``fresh_ready_counts``): its unacked messages
    would be ready again by then."""
    out = await abroker_ctl(*LIST_QUEUES_ARGS, "--formatter", "json")
    return parse_list_queues(out, names)


def end_state_problems(
    counts: dict[str, QueueCounts], names: Sequence[str], expected_ready: dict[str, int]
) -> list[str]:
    """What differs from the expected end state: every queue listed, nothing unacked, and
    ``expected_ready`` messages ready (0 for a queue not named there)."""
    problems = []
    for name in names:
        got = counts.get(name)
        if got is None:
            problems.append(f"{name}: not listed by the broker")
            continue
        want = expected_ready.get(name, 0)
        if got.unacked or got.ready != want:
            problems.append(f"{name}: {got.ready} ready (expected {want}), {got.unacked} unacked")
    return problems


async def fresh_ready_counts(broker_url: str, names: Sequence[str]) -> dict[str, int]:
    """Ready counts read now, by a passive declare per queue (not the periodic statistics)."""
    return {name: await ready_count(broker_url, name) for name in names}

"""Real worker processes for fault tests: start, wait until consuming, kill -9, clean up.

Every process is started by this module and ended by its pid, never by name; a ``WorkerFleet``
SIGKILLs whatever is still running when its test ends (pass or fail) and deletes its queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika

from tests.conftest import delete_queues, settings_for, wait_until
from tests.integration.fixture_apps.worker_app import Event, build_app, read_events
from weclaw_mq import App, Settings
from weclaw_mq.topology import queue_declarations

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


async def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0
) -> CliResult:
    """Run ``weclaw-mq ARGS`` from the repository root with ``env`` added to ours."""
    proc = await asyncio.create_subprocess_exec(
        cli_executable(),
        *args,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"weclaw-mq {' '.join(args)} ran past {timeout_s} s") from None
    assert proc.returncode is not None
    return CliResult(proc.returncode, out.decode(), err.decode())


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

    async def wait_consuming(self, timeout_s: float = 20.0) -> None:
        await wait_until(
            lambda: CONSUMING_MARK in self.log() or self.popen.poll() is not None,
            timeout_s,
            f"worker pid {self.pid} to start consuming",
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

    def env(self, *, sleep_s: float = 0.0, crash_on: str | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            **settings_env(self.settings),
            "TEST_QUEUE": self.queue,
            "TEST_RECORD_DIR": str(self.record_dir),
            "TEST_HANDLER_SLEEP_S": str(sleep_s),
            "PYTHONUNBUFFERED": "1",
        }
        if crash_on is not None:
            env["TEST_CRASH_ON"] = crash_on
        return env

    def start(
        self, *, concurrency: int = 1, sleep_s: float = 0.0, crash_on: str | None = None
    ) -> WorkerProcess:
        """Start ``weclaw-mq worker`` on the fixture app; its stderr goes to a log file."""
        log_path = self.work_dir / f"worker-{len(self.workers)}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [cli_executable(), "worker", FIXTURE_APP, "--concurrency", str(concurrency)],
                cwd=REPO_ROOT,
                env=self.env(sleep_s=sleep_s, crash_on=crash_on),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        worker = WorkerProcess(popen, log_path)
        self.workers.append(worker)
        return worker

    async def start_consuming(self, **kwargs: Any) -> WorkerProcess:
        worker = self.start(**kwargs)
        await worker.wait_consuming()
        return worker

    def events(self, kind: str | None = None) -> list[Event]:
        return [e for e in read_events(self.record_dir) if kind is None or e.kind == kind]

    def task_ids(self, kind: str) -> set[str]:
        return {e.task_id for e in self.events(kind)}

    def queue_names(self) -> list[str]:
        return queue_names(self.app)

    def kill_all(self) -> None:
        for worker in self.workers:
            worker.kill()


def queue_names(app: App) -> list[str]:
    """Every queue of every handler of ``app`` (Q, Q.dlq, Q.retry.*)."""
    return sorted(
        {n for spec in app.handlers.values() for n, _ in queue_declarations(spec.queue_spec())}
    )


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


async def ready_count(broker_url: str, queue: str) -> int:
    """Messages ready in ``queue`` (unacked ones are not counted: they belong to a consumer)."""
    conn = await aio_pika.connect(broker_url)
    try:
        channel = await conn.channel()
        declared = await channel.declare_queue(queue, passive=True)
        count = declared.declaration_result.message_count
        assert count is not None
        return count
    finally:
        await conn.close()


async def take_one(broker_url: str, queue: str) -> aio_pika.abc.AbstractIncomingMessage | None:
    """Fetch the head of ``queue`` and ack it; None when the queue is empty."""
    conn = await aio_pika.connect(broker_url)
    try:
        channel = await conn.channel()
        q = await channel.get_queue(queue, ensure=False)
        message = await q.get(fail=False, no_ack=True)
        return message
    finally:
        await conn.close()

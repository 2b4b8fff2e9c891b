"""``weclaw-mq worker MODULE:APP --reload``: the real command on a handler module in a folder
of the test's own, against the real broker and Redis; the module is edited while tasks flow.

The reloader and every worker process it started are SIGKILLed by pid when a test ends, however
it ends; the queues are deleted and the task keys forgotten. ``--reload --processes 2`` is in
test_cli_errors.py's table of mistakes (one line, exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import close_apps, settings_for, wait_until
from tests.drills.drill_app import Job
from tests.integration.processes import (
    CONSUMING_MARK,
    REPO_ROOT,
    WorkerProcess,
    spawn_cli_worker,
)
from tests.private_servers import running
from weclaw_mq import App, Settings, TaskStatus

MODULE = "reload_app"
# The handler module the reloader runs; VERSION_HERE is what an edit changes. Each run is one
# line in runs-<version>.log (the drills' record, written outside the process): a task run twice
# (a restart that re-delivered it) shows as two lines.
APP_SOURCE = """
import asyncio
import os
from pathlib import Path

from tests.drills.drill_app import Job, record_effect
from weclaw_mq import App, Context

VERSION = "VERSION_HERE"

app = App("reload-test")


@app.handler(os.environ["TEST_QUEUE"])
async def work(task: Job, ctx: Context) -> dict[str, str]:
    record_effect(Path(os.environ["TEST_RECORD_DIR"]) / f"runs-{VERSION}.log", ctx.task_id)
    await asyncio.sleep(0.1)  # so that a restart finds tasks in flight
    return {"version": VERSION}
"""
# The reloader's line once its watch is in place, and a new child's.
WATCHING_MARK = "--reload (for development): watching "
STARTED = re.compile(r"worker process started \(pid (\d+)\)")
# Publishing pace while a restart happens: about 20 tasks a second (four in flight at most).
PUBLISH_EVERY_S = 0.05
# What a restart adds to the new worker's start-up (its imports, connection, declarations: the
# machine's speed): the change seen (watchfiles waits 50 ms of quiet), the old worker's stop
# (its in-flight 0.1 s tasks, its connection closed, its interpreter ended: ~0.3 s measured),
# the first delivery to the new one. 2 s holds that with room for a busy machine.
RESTART_S = 2.0


@dataclass(frozen=True)
class Run:
    task_id: str
    version: str
    pid: int
    at: float  # time.time() when the handler started


@dataclass
class Reloading:
    """One test's folder (the reloader's current folder, holding the module), its queue, the
    app that publishes to it (the same handler, never consuming) and its reloaders."""

    folder: Path
    records: Path
    queue: str
    settings: Settings
    app: App
    processes: list[WorkerProcess] = field(default_factory=list)

    def write(self, version: str, extra: str = "") -> float:
        """The module with ``version`` (and ``extra`` lines) on disk; the time it was saved."""
        (self.folder / f"{MODULE}.py").write_text(
            APP_SOURCE.replace("VERSION_HERE", version) + extra
        )
        return time.time()

    def start(self) -> WorkerProcess:
        process = spawn_cli_worker(
            f"{MODULE}:app",
            settings=self.settings,
            app_env={
                "TEST_QUEUE": self.queue,
                "TEST_RECORD_DIR": str(self.records),
                # The module imports the drills' helpers; weclaw_mq is the one under test.
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
                ),
                # The first worker's rabbitmqctl (seconds on a busy machine) would hold its
                # stop; the restarted ones skip it by themselves (reloader.RESTART_ENV).
                "WECLAW_MQ_BROKER_LOAD_CHECK": "false",
            },
            log_path=self.records / f"reloader-{len(self.processes)}.log",
            concurrency=4,
            extra_args=["--reload"],
            cwd=self.folder,
        )
        self.processes.append(process)
        return process

    def runs(self) -> list[Run]:
        """Every run of the handler, the earliest first."""
        runs = []
        for path in self.records.glob("runs-*.log"):
            version = path.stem.removeprefix("runs-")
            for line in path.read_text().splitlines():
                task_id, pid, at = line.split()
                runs.append(Run(task_id, version, int(pid), float(at)))
        return sorted(runs, key=lambda r: r.at)


def children(process: WorkerProcess) -> list[int]:
    """The pids of the worker processes the reloader said it started, in order."""
    return [int(pid) for pid in STARTED.findall(process.log())]


def consuming(process: WorkerProcess) -> int:
    return process.log().count(CONSUMING_MARK)


def kill_with_children(process: WorkerProcess) -> None:
    """SIGKILL the reloader, then each worker it started that still runs (by pid, once its
    command line shows it is the reloader's child, not a process that reused the pid)."""
    pids = children(process)
    process.kill()
    for pid in pids:
        with contextlib.suppress(OSError):
            if (
                running(pid)
                and b"weclaw_mq.cli.reloader" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def reloading(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> AsyncIterator[Reloading]:
    folder = tmp_path / "src"
    records = tmp_path / "records"
    folder.mkdir()
    records.mkdir()
    settings = settings_for(broker_url, redis_url)
    app = App("reload-test", settings=settings)

    @app.handler(qname)
    async def work(task: Job) -> None:  # the worker's queues, declared by this app too
        raise AssertionError("the test's app never consumes")

    await app.declare()
    reloading = Reloading(folder, records, qname, settings, app)
    try:
        yield reloading
    finally:
        for process in reloading.processes:
            kill_with_children(process)
        await close_apps([app], broker_url, redis_url)


async def start_consuming(reloading: Reloading) -> WorkerProcess:
    process = reloading.start()
    await wait_until(
        lambda: (
            (consuming(process) >= 1 and WATCHING_MARK in process.log())
            or process.popen.poll() is not None
        ),
        30,
        "the reloader watching and its worker consuming",
    )
    assert process.popen.poll() is None, process.describe()
    return process


def log_time(line: str) -> float:
    """The time of a text log line (``2026-12-02 18:22:20,516 INFO ...``), as time.time()."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def start_up_s(log: str, index: int) -> float:
    """Worker ``index``'s start-up: from the reloader starting it to its consuming line."""
    lines = log.splitlines()
    started = [line for line in lines if STARTED.search(line)][index]
    ready = [line for line in lines if CONSUMING_MARK in line][index]
    return log_time(ready) - log_time(started)


async def stop_reloader(process: WorkerProcess) -> None:
    pids = children(process)
    process.signal(signal.SIGTERM)
    assert await process.wait_exit(30) == 0, process.describe()
    assert not [pid for pid in pids if running(pid)], process.describe()


async def test_an_edit_is_running_within_2_s_plus_a_start_up_and_no_task_is_lost(
    reloading: Reloading,
) -> None:
    reloading.write("v1")
    process = await start_consuming(reloading)
    app, queue = reloading.app, reloading.queue
    first = await app.publish(queue, Job(n=0))
    assert (await app.result(first, timeout_s=20)).result == {"version": "v1"}

    published = [first]
    done = asyncio.Event()

    async def publish_continuously() -> None:
        while not done.is_set():
            published.append(await app.publish(queue, Job(n=len(published))))
            await asyncio.sleep(PUBLISH_EVERY_S)  # a pace, not a wait for anything

    publisher = asyncio.create_task(publish_continuously())
    try:
        await wait_until(lambda: len(published) >= 5, 10, "tasks flowing before the edit")
        saved_at = reloading.write("v2")
        await wait_until(
            lambda: sum(r.version == "v2" for r in reloading.runs()) >= 5,
            30,
            f"runs of the edited handler: {process.describe()}",
        )
    finally:
        done.set()
        await publisher

    # Every task published across the restart succeeded, each run once.
    for task_id in published:
        state = await app.result(task_id, timeout_s=30)
        assert state.status is TaskStatus.SUCCEEDED, state
    runs = reloading.runs()
    assert Counter(r.task_id for r in runs) == Counter(published), process.describe()
    # The old worker drained before the new one started: two processes, one version each,
    # every v1 run before every v2 run.
    assert [r.version for r in runs] == sorted(r.version for r in runs)
    assert {r.pid: r.version for r in runs} == dict(
        zip(children(process), ["v1", "v2"], strict=True)
    )
    assert "stopped (exit 0)" in process.log(), process.describe()

    first_new = min(r.at for r in runs if r.version == "v2")
    start_up = start_up_s(process.log(), 1)  # the new worker's: the machine's load, not ours
    took = first_new - saved_at
    print(f"save -> first run of the edit: {took:.2f} s, of which {start_up:.2f} s start-up")
    assert took <= RESTART_S + start_up, (took, start_up)

    await stop_reloader(process)


async def test_an_edit_that_breaks_the_import_leaves_the_reloader_waiting_for_the_fix(
    reloading: Reloading,
) -> None:
    reloading.write("v1")
    process = await start_consuming(reloading)

    # A syntax error: the CLI's one line, then the reloader waits.
    reloading.write("v2", extra="\ndef broken(:\n")
    await wait_until(
        lambda: process.log().count("waiting for a change") == 1, 30, "the import to fail"
    )
    assert f"weclaw-mq: error: importing '{MODULE}' failed: SyntaxError" in process.log()
    # An error raised while importing: the CLI shows the user's frames, as without --reload.
    reloading.write("v2", extra="\nVALUE = undefined_name\n")
    await wait_until(
        lambda: process.log().count("waiting for a change") == 2, 30, "the import to fail again"
    )
    log = process.log()
    assert f"weclaw-mq: error: importing '{MODULE}' failed: NameError" in log
    assert f'  File "{reloading.folder / MODULE}.py", line ' in log
    assert "    VALUE = undefined_name" in log
    assert "Traceback" not in log
    assert process.popen.poll() is None, process.describe()

    reloading.write("v2")
    await wait_until(lambda: consuming(process) == 2, 30, f"the fix running: {process.describe()}")
    task_id = await reloading.app.publish(reloading.queue, Job(n=1))
    assert (await reloading.app.result(task_id, timeout_s=20)).result == {"version": "v2"}

    await stop_reloader(process)

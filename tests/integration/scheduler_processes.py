"""Scheduler processes for the schedule tests and drill: a test's own app (its name is its
lease's), a module the ``weclaw-mq scheduler`` processes load, and the ticks its handler ran.

Every process is started here and killed by pid when its test ends (pass or fail); the
schedule's Redis keys are deleted then too.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.integration.processes import REPO_ROOT, WorkerProcess, cli_executable, settings_env
from weclaw_mq import App
from weclaw_mq.contract.naming import schedule_key, scheduler_lease_key

MODULE = "schedule_app"
APP_SOURCE = """
import os

from weclaw_mq import App

app = App(os.environ["TEST_APP"])


@app.handler(os.environ["TEST_QUEUE"])
async def tick(task: dict) -> None:
    raise AssertionError("scheduler processes only publish")


app.schedule(
    "every-second", queue=os.environ["TEST_QUEUE"], every_s=1, missed=os.environ["TEST_MISSED"]
)
"""
LEADS = "leads: it fires the ticks"
STANDS_BY = "stands by"
# The lease the scheduler processes run with: a killed leader's ticks go unfired this long.
LEASE_S = 2.0


@dataclass
class Ticking:
    """One test's app (its name is its lease's), queue, folder and the ticks its handler ran."""

    app: App
    queue: str
    folder: Path
    redis_url: str
    runs: list[str] = field(default_factory=list)  # the tick of each run, ISO 8601
    processes: list[WorkerProcess] = field(default_factory=list)

    lease_s: float = LEASE_S

    def spawn(self, missed: str = "skip") -> WorkerProcess:
        log_path = self.folder / f"scheduler-{len(self.processes)}.log"
        env = {
            **os.environ,
            **settings_env(self.app.settings),
            "WECLAW_MQ_SCHEDULER_LEASE_S": str(self.lease_s),
            "TEST_APP": self.app.name,
            "TEST_QUEUE": self.queue,
            "TEST_MISSED": missed,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            ),
            "PYTHONUNBUFFERED": "1",
        }
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [cli_executable(), "scheduler", f"{MODULE}:app"],
                cwd=self.folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        log_path.with_suffix(".pid").write_text(str(popen.pid))
        process = WorkerProcess(popen, log_path)
        self.processes.append(process)
        return process

    def ran(self) -> Counter[str]:
        return Counter(self.runs)


@pytest.fixture
async def ticking(
    broker_url: str,
    redis_url: str,
    qname: str,
    tmp_path: Path,
    # Before start_worker: fixtures end in reverse, so the worker stops before the app's
    # queues are deleted (a live worker would declare them again as its consumer is cancelled).
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
) -> AsyncIterator[Ticking]:
    app = make_app(f"sched-{qname}")
    ticking = Ticking(app, qname, tmp_path, redis_url)

    @app.handler(qname)
    async def tick(task: dict[str, str]) -> None:
        ticking.runs.append(task["tick"])

    app.schedule("every-second", queue=qname, every_s=1)
    (tmp_path / f"{MODULE}.py").write_text(APP_SOURCE)
    await start_worker(app, concurrency=4)
    try:
        yield ticking
    finally:
        for process in ticking.processes:
            process.kill()
        client = aioredis.from_url(redis_url)
        await client.delete(scheduler_lease_key(app.name), schedule_key(app.name, "every-second"))
        await client.aclose()

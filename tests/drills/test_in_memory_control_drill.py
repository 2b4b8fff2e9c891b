"""The control: the kill -9 drill run against a plain in-process ``asyncio.Queue``.

1000 tasks go into an ``asyncio.Queue`` inside a worker process; the process is SIGKILLed by
pid at a random point (once a random number of tasks between 100 and 800 has run; set
DRILL_SEED to replay one), then started again. The restarted process has nothing to work on:
every task the dead one still held in memory is gone. The loss is counted from the effects
that actually happened (written outside the process), not from the kill point. This row
stands next to the weclaw_mq kill -9 row in the drill table (same tasks, same fault).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.drills import drill_app
from tests.drills.conftest import REPO_ROOT, DrillReport

TASKS = 1000
KILL_AFTER = (100, 800)  # the kill comes once a random count in this range has run
SLEEP_S = 0.004


def _start(effects: Path, log: Path, *, restart: bool) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tests.drills.drill_app", "in-memory"]
    args += ["--tasks", str(TASKS), "--effects", str(effects), "--sleep-s", str(SLEEP_S)]
    if restart:
        args.append("--restart")
    with log.open("ab") as out:
        return subprocess.Popen(
            args, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )


@pytest.mark.drill
async def test_in_memory_queue_loses_every_unfinished_task_when_killed(
    tmp_path: Path, drill_report: DrillReport
) -> None:
    seed = int(os.environ.get("DRILL_SEED") or random.randrange(2**32))
    kill_at = random.Random(seed).randrange(*KILL_AFTER)
    started = time.perf_counter()
    effects = tmp_path / "effects.log"
    log = tmp_path / "inmem.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        first = _start(effects, log, restart=False)
        procs.append(first)
        await wait_until(
            lambda: len(drill_app.read_effects(effects)) >= kill_at or first.poll() is not None,
            30,
            f"{kill_at} in-memory tasks to run",
        )
        assert first.poll() is None, f"the in-memory worker ended by itself: {log.read_text()}"
        first.send_signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
        done_before = len(drill_app.read_effects(effects))

        # "Restart": the same program started again, as a supervisor would.
        second = _start(effects, log, restart=True)
        procs.append(second)
        await asyncio.to_thread(second.wait, 30)
        assert second.returncode == 0, log.read_text()
        ran = drill_app.read_effects(effects)
        recovered = len(ran) - done_before
        lost = TASKS - len(ran)
        drill_report.add(
            "kill -9 at a random point (control)",
            queue="asyncio.Queue (in memory)",
            published=TASKS,
            confirmed=TASKS,
            processed=len(ran),
            lost=lost,
            duplicated=sum(c - 1 for c in ran.values() if c > 1),
            seconds=time.perf_counter() - started,
            notes=f"seed {seed}; killed after {done_before} had run (aimed at {kill_at}); "
            f"the restart recovered {recovered} of the {TASKS - done_before} left",
        )
        assert lost > 0, f"the kill came after every task ran ({done_before} ran)"
        assert recovered == 0, f"the restart ran {recovered} task(s) it cannot have known"
        assert lost == TASKS - done_before
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

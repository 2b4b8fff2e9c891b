"""The control: the kill -9 drill run against a plain in-process ``asyncio.Queue``.

1000 tasks go into an ``asyncio.Queue`` inside a worker process; the process is SIGKILLed by
pid once about 362 have run, then started again. The restarted process has nothing to work
on: every task the dead one still held in memory is gone. This row stands next to the
weclaw_mq kill -9 row in the drill table (same tasks, same fault, lost = 0 there).
"""

from __future__ import annotations

import asyncio
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
KILL_AT = 362
# Slow enough that the kill lands within a task or two of KILL_AT when polled every 20 ms.
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
    started = time.perf_counter()
    effects = tmp_path / "effects.log"
    log = tmp_path / "inmem.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        first = _start(effects, log, restart=False)
        procs.append(first)
        await wait_until(
            lambda: len(drill_app.read_effects(effects)) >= KILL_AT or first.poll() is not None,
            30,
            f"{KILL_AT} in-memory tasks to run",
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
            "kill -9 at ~362 (control)",
            queue="asyncio.Queue (in memory)",
            published=TASKS,
            confirmed=TASKS,
            processed=len(ran),
            lost=lost,
            duplicated=sum(c - 1 for c in ran.values() if c > 1),
            seconds=time.perf_counter() - started,
            notes=f"killed after {done_before} ran; the restart recovered {recovered} "
            f"of the {TASKS - done_before} left",
        )
        assert recovered == 0
        assert lost == TASKS - done_before
        assert lost > TASKS // 2, f"the kill came too late ({done_before} ran) to show the loss"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

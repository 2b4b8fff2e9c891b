"""The app ``benchmarks.start_time`` starts workers of: one guarded handler that stamps when it
starts (CLOCK_MONOTONIC, shared by every process; one file per process, for its first task)
and then holds its task for a while, so that no process takes every task of a run (each runs
one at a time: concurrency 1) and every process's first delivery is seen.

Configured by the environment, as a deployed app is: ``WECLAW_MQ_*`` for the settings,
``BENCH_START_QUEUE`` for the queue, ``BENCH_START_DIR`` for the stamps (one file per pid).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from weclaw_mq import App

QUEUE = os.environ.get("BENCH_START_QUEUE", "bench-start")
STAMP_DIR = os.environ.get("BENCH_START_DIR", ".")
HOLD_S = float(os.environ.get("BENCH_START_HOLD_S", "1.0"))

app = App("bench-start")


def _stamp(stamp_ns: int) -> None:
    # Written aside, then linked into place: a reader never sees a file without its stamp.
    pid = os.getpid()
    aside = os.path.join(STAMP_DIR, f"writing-{pid}-{stamp_ns}")
    with open(aside, "w") as f:
        f.write(str(stamp_ns))
    with contextlib.suppress(FileExistsError):  # not this process's first task
        os.link(aside, os.path.join(STAMP_DIR, f"started-{pid}"))
    os.unlink(aside)


@app.handler(QUEUE)
async def start(task: Any) -> None:
    _stamp(time.monotonic_ns())
    await asyncio.sleep(HOLD_S)

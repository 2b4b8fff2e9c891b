"""A worker app for the kill -9 drill of long runs (``tests/drills/test_long_run_kill9_drill.py``):
a ``long_running`` handler of memoized steps, then a streamed reply that continues from what an
earlier run of the task already streamed (``ctx.emitted()``).

Run as ``weclaw-mq worker tests.integration.fixture_apps.long_kill_app:app`` with cwd at the
repository root. Every run's start, every real call of a step (at its start: the call's effect
is out once it began) and every end of a run is one line appended to
``$TEST_RECORD_DIR/calls.log`` (``steps_app.record_call``), with the task id, this process's
pid and the time, so the drill can tell, for each kill, which runs and which steps it hit:

    start <task id> <pid> <time> <attempt>
    call <task id> <step> <pid> <time>
    end <task id> <pid> <time>

Environment:
    TEST_QUEUE       the handler's queue (required to use ``app``)
    TEST_RECORD_DIR  where ``calls.log`` is written (required to use ``app``)
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from tests.integration.fixture_apps.steps_app import read_calls, record_call
from weclaw_mq import App, Context, Settings

__all__ = ["KillJob", "Line", "build_app", "lines", "words"]


class KillJob(BaseModel):
    steps: int = 10
    step_s: float = 0.2
    words: int = 10
    word_s: float = 0.05


def words(count: int) -> list[str]:
    """The reply's chunks, in order."""
    return [f"w{i} " for i in range(count)]


def build_app(queue: str, *, settings: Settings, record_dir: Path) -> App:
    app = App("long-kill-fixture", settings=settings)

    @app.handler(queue, long_running=True, timeout_s=3600)
    async def run(job: KillJob, ctx: Context) -> dict[str, object]:
        pid = os.getpid()
        record_call(record_dir, f"start {ctx.task_id} {pid} {time.time():.3f} {ctx.attempt}")
        done = []
        for i in range(job.steps):

            async def step(i: int = i) -> int:
                record_call(record_dir, f"call {ctx.task_id} {i} {pid} {time.time():.3f}")
                await asyncio.sleep(job.step_s)
                return i

            done.append(await ctx.step(f"s{i}", step))
        # Read before this run's first emit: its chunks follow what an earlier run streamed.
        before = await ctx.emitted()
        reply = words(job.words)
        for chunk in reply[len(before) :]:
            await ctx.emit(chunk)
            await asyncio.sleep(job.word_s)
        record_call(record_dir, f"end {ctx.task_id} {pid} {time.time():.3f}")
        return {"steps": done, "text": "".join(reply)}

    return app


class Line(BaseModel):
    """One line of ``calls.log``."""

    kind: str  # start, call, end
    task: str
    pid: int
    at: float
    step: int | None = None


def lines(record_dir: Path) -> list[Line]:
    """Every line of ``calls.log``, in the order written."""
    out = []
    for raw in read_calls(record_dir):
        kind, task, *rest = raw.split()
        if kind == "call":
            out.append(
                Line(kind=kind, task=task, step=int(rest[0]), pid=int(rest[1]), at=float(rest[2]))
            )
        else:
            out.append(Line(kind=kind, task=task, pid=int(rest[0]), at=float(rest[1])))
    return out


def _app_from_env() -> App:
    queue, record_dir = required_env(__name__, "TEST_QUEUE", "TEST_RECORD_DIR")
    return build_app(queue, settings=Settings(), record_dir=Path(record_dir))


# Built on first access rather than at import, so the drill can import build_app and lines
# without the worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

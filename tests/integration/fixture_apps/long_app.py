"""A worker app whose handler is a long run (``long_running=True``) of memoized steps, each a
short sleep: it may SIGKILL its own process once after a step, or ask for one retry.

Run as ``weclaw-mq worker tests.integration.fixture_apps.long_app:app`` with cwd at the
repository root. Every run's start (with its pid), every real call of a step and every end is
one line appended to ``$TEST_RECORD_DIR/calls.log`` (``steps_app.record_call``), with the
time, so a test can tell when a run resumed and that no two runs overlapped.

Environment:
    TEST_QUEUE         the handler's queue (required to use ``app``)
    TEST_RECORD_DIR    where ``calls.log`` and ``killed`` are written (required)
    TEST_LONG_RUNNING  "0" registers the same handler without ``long_running`` (a control)
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from tests.integration.fixture_apps.steps_app import KILLED_FILE, _kill_once, record_call
from weclaw_mq import App, Context, Retry, Settings


class LongJob(BaseModel):
    steps: int = 4
    step_s: float = 0.5
    # SIGKILL the worker once this step is recorded (the first run only).
    kill_after: int | None = None
    # Ask for a retry once, after this step (the first attempt only).
    retry_after: int | None = None


def build_app(
    queue: str, *, settings: Settings, record_dir: Path, long_running: bool = True
) -> App:
    app = App("long-fixture", settings=settings)

    # Past the 4-hour run of tests/drills/test_long_run_drill.py (RUN_S=14400, by hand).
    @app.handler(queue, long_running=long_running, timeout_s=5 * 3600)
    async def run(job: LongJob, ctx: Context) -> dict[str, int]:
        record_call(record_dir, f"start {os.getpid()} {time.time():.3f} attempt {ctx.attempt}")
        done = 0
        for i in range(job.steps):

            async def step(i: int = i) -> int:
                await asyncio.sleep(job.step_s)
                record_call(record_dir, f"step {i} {time.time():.3f}")
                return i

            done += 1 + await ctx.step(f"s{i}", step)
            if i == job.kill_after and not (record_dir / KILLED_FILE).exists():
                _kill_once(record_dir)
            if i == job.retry_after and ctx.attempt == 1:
                raise Retry("once", after_s=0.1)
        record_call(record_dir, f"end {os.getpid()} {time.time():.3f}")
        return {"sum": done, "attempt": ctx.attempt}

    return app


def _app_from_env() -> App:
    queue, record_dir = required_env(__name__, "TEST_QUEUE", "TEST_RECORD_DIR")
    long_running = os.environ.get("TEST_LONG_RUNNING", "1") != "0"
    return build_app(
        queue, settings=Settings(), record_dir=Path(record_dir), long_running=long_running
    )


# Built on first access rather than at import, so tests can import build_app without the
# worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

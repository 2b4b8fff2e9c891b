"""A worker app whose handler records steps (``ctx.step``) or streams a reply, and SIGKILLs its
own process once, at a point the task chooses: the second run (another worker process) must
replay the recorded steps, or continue the stream, instead of starting over.

Run as ``weclaw-mq worker tests.integration.fixture_apps.steps_app:app`` with cwd at the
repository root. Every real call of a step's function, and every re-run's resume point, is
one line appended to ``$TEST_RECORD_DIR/calls.log``, outside the process, so a test can
count them after the kill; ``$TEST_RECORD_DIR/killed`` marks that the kill happened.

Environment:
    TEST_QUEUE       the handler's queue (required to use ``app``)
    TEST_RECORD_DIR  where ``calls.log`` and ``killed`` are written (required to use ``app``)
The ``WECLAW_MQ_*`` settings apply as in any app.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from weclaw_mq import App, Context, Settings

CALLS_FILE = "calls.log"
KILLED_FILE = "killed"


class StepsJob(BaseModel):
    # Steps mode: SIGKILL the worker once this step is recorded (the first run only).
    kill_after: str | None = None
    # Stream mode (words > 0): emit "w0 " .. "w<words-1> ", and SIGKILL the worker once the
    # chunks before word ``kill_at_word`` are in the stream (the first run only).
    words: int = 0
    kill_at_word: int | None = None
    # Steps mode, in a test's own process: once this step is recorded, wait for the test's
    # ``release`` event (``build_app(release=...)``).
    hold_after: str | None = None


def record_call(record_dir: Path, line: str) -> None:
    # One write() on an O_APPEND file: the line outlives a SIGKILL right after it.
    fd = os.open(record_dir / CALLS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_calls(record_dir: Path) -> list[str]:
    path = record_dir / CALLS_FILE
    return path.read_text().splitlines() if path.exists() else []


def _kill_once(record_dir: Path) -> None:
    """SIGKILL this process, the first time only (a marker file says it happened)."""
    marker = record_dir / KILLED_FILE
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def build_app(
    queue: str, *, settings: Settings, record_dir: Path, release: asyncio.Event | None = None
) -> App:
    app = App("steps-fixture", settings=settings)

    def fetch(ctx: Context) -> str:
        record_call(record_dir, "fetch")
        ctx.usage(input_tokens=5, output_tokens=1, model="m-1")
        return "fetched"

    async def call() -> str:
        record_call(record_dir, "call")
        return "called"

    @app.handler(queue)
    async def run(task: StepsJob, ctx: Context) -> Any:
        if task.words:
            return await _stream(task, ctx)
        fetched = await ctx.step("fetch", fetch, ctx)
        if task.kill_after == "fetch":
            _kill_once(record_dir)
        if task.hold_after == "fetch" and release is not None:
            await release.wait()
        called = await ctx.step("call", call)
        return {"fetch": fetched, "call": called, "attempt": ctx.attempt}

    async def _stream(task: StepsJob, ctx: Context) -> str:
        before = await ctx.emitted()
        if (record_dir / KILLED_FILE).exists():
            record_call(record_dir, f"resume {len(before)}")
        words = [f"w{i} " for i in range(task.words)]
        for i in range(len(before), task.words):
            if i == task.kill_at_word and not (record_dir / KILLED_FILE).exists():
                # Killed once what it emitted is in the stream (read back, not waited out).
                while len(await ctx.emitted()) < i:
                    pass
                _kill_once(record_dir)
            await ctx.emit(words[i])
        return "".join([*before, *words[len(before) :]])

    return app


def _app_from_env() -> App:
    queue, record_dir = required_env(__name__, "TEST_QUEUE", "TEST_RECORD_DIR")
    return build_app(queue, settings=Settings(), record_dir=Path(record_dir))


# Built on first access rather than at import, so tests can import build_app and read_calls
# without the worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

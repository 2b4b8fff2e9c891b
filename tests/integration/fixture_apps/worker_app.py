"""A worker app whose behaviour the test chooses through environment variables.

Run as ``weclaw-mq worker tests.integration.fixture_apps.worker_app:app`` with cwd at the
repository root. The handler records every start and finish as one line appended to
``$TEST_RECORD_DIR/events.log``, outside the process, so a test can still count them after it
killed the worker with SIGKILL.

Environment:
    TEST_QUEUE            the handler's queue (required to use ``app``)
    TEST_RECORD_DIR       where ``events.log`` is written (required to use ``app``)
    TEST_HANDLER_SLEEP_S  how long each handler call takes (default 0)
    TEST_CRASH_ON         a ``text`` value on which the handler SIGKILLs its own process
    TEST_HANDLER_MODE     how the handler spends TEST_HANDLER_SLEEP_S: "sleep" (default),
                          "ignore_cancel" (sleeps, swallowing every cancellation), "block"
                          (blocks the event loop in a synchronous sleep), "stream"
                          (emits each word of the text, sleeping that long after each)
                          (blocks the event loop in a synchronous sleep)
    TEST_LIMIT_CONCURRENCY  a global concurrency limit of the handler (``Limit``), if set
The ``WECLAW_MQ_*`` settings apply as in any app.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from weclaw_mq import App, Context, Limit, Settings

EVENTS_FILE = "events.log"


class Job(BaseModel):
    text: str


@dataclass(frozen=True)
class Event:
    kind: str  # "started" or "finished"
    task_id: str
    pid: int
    attempt: int


def record(record_dir: Path, kind: str, ctx: Context) -> None:
    line = f"{kind} {ctx.task_id} {os.getpid()} {ctx.attempt}\n"
    # One write() on an O_APPEND file: lines from concurrent handlers and processes never
    # interleave, and the page cache keeps the line even if we are SIGKILLed right after.
    fd = os.open(record_dir / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_events(record_dir: Path) -> list[Event]:
    path = record_dir / EVENTS_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        kind, task_id, pid, attempt = line.split()
        events.append(Event(kind, task_id, int(pid), int(attempt)))
    return events


def build_app(
    queue: str,
    *,
    settings: Settings,
    record_dir: Path,
    sleep_s: float = 0.0,
    crash_on: str | None = None,
    mode: str = "sleep",
    limit: Limit | None = None,
) -> App:
    app = App("fixture", settings=settings)

    @app.handler(queue, limit=limit, priorities=True)
    async def work(task: Job, ctx: Context) -> dict[str, str]:
        record(record_dir, "started", ctx)
        if crash_on is not None and task.text == crash_on:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stream":
            # A stand-in model: one word of the text per chunk, TEST_HANDLER_SLEEP_S apart.
            for word in task.text.split():
                await ctx.emit(word)
                await asyncio.sleep(sleep_s)
        elif mode == "block":
            time.sleep(sleep_s)  # noqa: ASYNC251 - on purpose: a call the loop cannot interrupt
        elif mode == "ignore_cancel":
            until = time.monotonic() + sleep_s
            while time.monotonic() < until:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(until - time.monotonic())
        else:
            await asyncio.sleep(sleep_s)
        record(record_dir, "finished", ctx)
        return {"echo": task.text}

    return app


def _app_from_env() -> App:
    queue, record_dir = required_env(__name__, "TEST_QUEUE", "TEST_RECORD_DIR")
    crash_on = os.environ.get("TEST_CRASH_ON") or None
    concurrency = os.environ.get("TEST_LIMIT_CONCURRENCY")
    return build_app(
        queue,
        settings=Settings(),
        record_dir=Path(record_dir),
        sleep_s=float(os.environ.get("TEST_HANDLER_SLEEP_S", "0")),
        crash_on=crash_on,
        mode=os.environ.get("TEST_HANDLER_MODE", "sleep"),
        limit=Limit(concurrency=int(concurrency)) if concurrency else None,
    )


# Built on first access rather than at import, so tests can import build_app and
# read_events without the worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

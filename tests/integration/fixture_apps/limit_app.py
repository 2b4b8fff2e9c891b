"""A worker app whose one handler runs under a global concurrency limit of 1.

Run as ``weclaw-mq worker tests.integration.fixture_apps.limit_app:app`` with cwd at the
repository root. Every start is recorded as in ``worker_app`` (``events.log``), and each call
sleeps ``TEST_HANDLER_SLEEP_S``: long enough to be killed while it holds the limit's slot.

Environment: TEST_QUEUE, TEST_RECORD_DIR (required), TEST_HANDLER_SLEEP_S (default 0); the
``WECLAW_MQ_*`` settings apply as in any app (``GUARD_LEASE_S`` is the slot's lease too).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from tests.integration.fixture_apps import lazy_app, required_env
from tests.integration.fixture_apps.worker_app import Job, record
from weclaw_mq import App, Context, Limit, Settings

# One task at a time in the whole handler, across every worker.
ONE_AT_A_TIME = Limit(concurrency=1)


def build_app(queue: str, *, settings: Settings, record_dir: Path, sleep_s: float = 0.0) -> App:
    app = App("fixture-limit", settings=settings)

    @app.handler(queue, limit=ONE_AT_A_TIME)
    async def work(task: Job, ctx: Context) -> dict[str, str]:
        record(record_dir, "started", ctx)
        await asyncio.sleep(sleep_s)
        record(record_dir, "finished", ctx)
        return {"echo": task.text}

    return app


def _app_from_env() -> App:
    queue, record_dir = required_env(__name__, "TEST_QUEUE", "TEST_RECORD_DIR")
    return build_app(
        queue,
        settings=Settings(),
        record_dir=Path(record_dir),
        sleep_s=float(os.environ.get("TEST_HANDLER_SLEEP_S", "0")),
    )


__getattr__ = lazy_app(__name__, _app_from_env)

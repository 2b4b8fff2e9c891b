"""A worker app whose handler is a long run (``long_running=True``) of memoized steps, each a
short sleep, for many tasks at once: the Redis Sentinel failover drill
(``tests/drills/test_redis_sentinel_long_runs_drill.py``) counts per task every start, every
real call of a step and every end.

Run as ``weclaw-mq worker tests.integration.fixture_apps.long_sentinel_app:app`` with cwd at
the repository root. Every line goes to ``$TEST_RECORD_DIR/calls.log``
(``steps_app.record_call``: one O_APPEND write, so it outlives the process) as
``start|step|end <task id> ...``.

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
from tests.integration.fixture_apps.steps_app import record_call
from weclaw_mq import App, Context, Settings


class SentinelJob(BaseModel):
    steps: int = 10
    step_s: float = 0.3


def build_app(queue: str, *, settings: Settings, record_dir: Path) -> App:
    app = App("long-sentinel-fixture", settings=settings)

    @app.handler(queue, long_running=True, timeout_s=600)
    async def run(job: SentinelJob, ctx: Context) -> dict[str, int]:
        pid = os.getpid()
        record_call(record_dir, f"start {ctx.task_id} {pid} {time.time():.3f} {ctx.attempt}")
        total = 0
        for i in range(job.steps):

            async def step(i: int = i) -> int:
                await asyncio.sleep(job.step_s)
                record_call(record_dir, f"step {ctx.task_id} {i} {pid} {time.time():.3f}")
                return i

            total += await ctx.step(f"s{i}", step)
        record_call(record_dir, f"end {ctx.task_id} {pid} {time.time():.3f}")
        return {"sum": total, "steps": job.steps}

    return app


def _app_from_env() -> App:
    queue, record_dir = required_env(__name__, "TEST_QUEUE", "TEST_RECORD_DIR")
    return build_app(queue, settings=Settings(), record_dir=Path(record_dir))


# Built on first access rather than at import, so tests can import build_app without the
# worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

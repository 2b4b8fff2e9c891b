"""A worker app for the workflow drill, configured by environment variables.

Run as ``weclaw-mq worker tests.integration.fixture_apps.workflow_app:app`` with cwd at the
repository root. A group's parts (``WORKFLOW_APP_PARTS_QUEUE``) return their number after a
short random sleep; its callback (``WORKFLOW_APP_MERGE_QUEUE``) records each run OUTSIDE the
process, as an RPUSH of ``<group id> <results as JSON>`` to the Redis list
``<WORKFLOW_APP_RECORD_KEY>:merges``, so a test can count callback runs per group after it
killed workers with SIGKILL.

Environment:
    WORKFLOW_APP_PARTS_QUEUE    the parts' handler queue
    WORKFLOW_APP_MERGE_QUEUE    the callback's handler queue
    WORKFLOW_APP_RECORD_KEY     prefix of this test's Redis keys
    WORKFLOW_APP_SLEEP_MAX_S    a part's longest run (default 0.03 s; its shortest: a sixth)
The ``WECLAW_MQ_*`` settings apply as in any app.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import redis.asyncio as aioredis

from tests.integration.fixture_apps import lazy_app, required_env
from weclaw_mq import App, Context, Settings

APP_PATH = "tests.integration.fixture_apps.workflow_app:app"


def merges_key(record_key: str) -> str:
    """The list of callback runs: ``<group id> <results JSON>`` per run."""
    return f"{record_key}:merges"


def build_app(
    parts_queue: str,
    merge_queue: str,
    *,
    settings: Settings,
    record_key: str,
    sleep_max_s: float = 0.03,
) -> App:
    recorder = aioredis.Redis.from_url(
        settings.redis_url_plain(), socket_connect_timeout=5, socket_timeout=5
    )
    app = App("workflow-fixture", settings=settings)

    @app.handler(parts_queue)
    async def part(n: int) -> int:
        await asyncio.sleep(random.uniform(sleep_max_s / 6, sleep_max_s))
        return n

    @app.handler(merge_queue)
    async def merge(results: list[int], ctx: Context) -> int:
        group_id = ctx.task_id.removesuffix(".then")
        await recorder.rpush(merges_key(record_key), f"{group_id} {json.dumps(results)}")
        return sum(results)

    return app


def _app_from_env() -> App:
    parts, merge, record_key = required_env(
        __name__, "WORKFLOW_APP_PARTS_QUEUE", "WORKFLOW_APP_MERGE_QUEUE", "WORKFLOW_APP_RECORD_KEY"
    )
    sleep_max_s = float(os.environ.get("WORKFLOW_APP_SLEEP_MAX_S", "0.03"))
    return build_app(
        parts, merge, settings=Settings(), record_key=record_key, sleep_max_s=sleep_max_s
    )


# Built on first access rather than at import, so tests can import build_app without the
# worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

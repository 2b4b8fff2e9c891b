"""Fixtures of the integration tests beyond tests/conftest.py's."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import forget_task_keys, settings_for
from tests.integration.dead_endpoints import closed_broker_url
from tests.integration.postgres_db import pg_schema
from tests.integration.processes import OpenFleet, worker_fleet
from weclaw_mq import App

__all__ = ["DEAD_URL", "down_apps", "open_fleet", "pg_schema"]

DEAD_URL = closed_broker_url()


@pytest.fixture
def open_fleet(broker_url: str, redis_url: str, qname: str, tmp_path: Path) -> OpenFleet:
    """``async with open_fleet(**settings) as fleet``: worker processes of this test's own
    (its queue, its folder, the test broker and Redis; any of them may be overridden too)."""
    return functools.partial(
        worker_fleet, queue=qname, work_dir=tmp_path, broker_url=broker_url, redis_url=redis_url
    )


@pytest.fixture
async def down_apps(redis_url: str, qname: str) -> AsyncIterator[Callable[..., App]]:
    """``down_apps(**settings)``: Apps whose broker is down (``DEAD_URL``), on the test's Redis;
    closed at teardown, and ``qname``'s Redis keys forgotten (no queue of theirs exists)."""
    apps: list[App] = []

    def build(**overrides: Any) -> App:
        app = App("down", settings=settings_for(DEAD_URL, redis_url, **overrides))
        apps.append(app)
        return app

    yield build
    for app in apps:
        await app.close()
    await forget_task_keys(redis_url, [qname])

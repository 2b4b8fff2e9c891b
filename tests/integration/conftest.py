"""Fixtures of the integration tests beyond tests/conftest.py's."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.integration.postgres_db import pg_schema
from tests.integration.processes import OpenFleet, worker_fleet

__all__ = ["open_fleet", "pg_schema"]


@pytest.fixture
def open_fleet(broker_url: str, redis_url: str, qname: str, tmp_path: Path) -> OpenFleet:
    """``async with open_fleet(**settings) as fleet``: worker processes of this test's own
    (its queue, its folder, the test broker and Redis; any of them may be overridden too)."""
    return functools.partial(
        worker_fleet, queue=qname, work_dir=tmp_path, broker_url=broker_url, redis_url=redis_url
    )

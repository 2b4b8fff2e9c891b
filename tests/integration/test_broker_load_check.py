"""The worker's start-up read of the broker's load: at the lowest CPU priority, and not at all
when ``broker_load_check`` is off (the benchmark measures with it off; ``--processes N`` asks
in one child only).

A ``rabbitmqctl`` of our own stands first on PATH: it prints a status in rabbitmqctl's JSON
shape and appends the niceness it runs at to a file, so the test sees each invocation and how
it was started. The workers run against the real broker.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from weclaw_mq import App
from weclaw_mq.wire.broker_load import read_broker_load

STATUS = json.dumps(
    {
        "file_descriptors": {"total_used": 10, "total_limit": 927},
        "memory": {"total": {"erlang": 1, "rss": 2, "allocated": 3}},
        "vm_memory_high_watermark_limit": 100,
    }
)


@pytest.fixture
def invocations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file our rabbitmqctl appends its niceness to, once per invocation."""
    calls = tmp_path / "calls"
    ctl = tmp_path / "bin" / "rabbitmqctl"
    ctl.parent.mkdir()
    ctl.write_text(
        f"#!/bin/sh\nawk '{{print $19}}' /proc/$$/stat >> {calls}\nprintf '%s' '{STATUS}'\n"
    )
    ctl.chmod(ctl.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{ctl.parent}:{os.environ['PATH']}")
    return calls


def lines_of(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_the_status_is_read_at_the_lowest_cpu_priority(invocations: Path) -> None:
    load = read_broker_load("amqp://guest:guest@127.0.0.1:5672/")

    assert load is not None and (load.handles_used, load.handles_limit) == (10, 927)
    assert invocations.read_text().split() == ["19"]


async def test_a_worker_reads_the_load_at_start_unless_told_not_to(
    invocations: Path,
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
) -> None:
    quiet = make_app("load-off")

    @quiet.handler(f"{qname}-off")
    async def off(task: dict[str, str]) -> None:
        return None

    asking = make_app("load-on")

    @asking.handler(f"{qname}-on")
    async def on(task: dict[str, str]) -> None:
        return None

    # The one told not to starts first: a read of its own would land before the other's.
    await start_worker(quiet, broker_load_check=False)
    await start_worker(asking)

    await wait_until(lambda: lines_of(invocations), 20, "the starting worker's rabbitmqctl run")
    assert lines_of(invocations) == ["19"], "the worker told not to read it did"

"""The task index benchmark still runs end to end (tiny counts): its numbers live in
`make bench`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import redis

from tests.broker_ctl import broker_ctl
from weclaw_mq.contract.naming import TASK_INDEX_QUEUES_KEY

ROOT = Path(__file__).resolve().parents[2]


def test_task_index_benchmark_smoke_run_prints_both_tables_and_leaves_nothing(
    redis_url: str,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.task_index_cost", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in (
        "| 10 | off |",
        "| 10 | on |",
        "target: on / off >= 0.95",
        "| newest first | 50 |",
        "| a cursor 90 % deep | 50 |",
        "target: a page < 100 ms",
    ):
        assert row in proc.stdout, row
    listing = broker_ctl("list_queues", "-q", "name")
    assert "bench-task-index-" not in listing, "the benchmark left its queues behind"
    client = redis.Redis.from_url(redis_url)
    try:
        left = [k for k in client.smembers(TASK_INDEX_QUEUES_KEY) if b"bench-task-index-" in k]
    finally:
        client.close()
    assert not left, f"the benchmark left index entries in the shared Redis: {left}"

"""The task index benchmark still runs end to end (tiny counts): its numbers live in
`make bench`."""

from __future__ import annotations

import redis

from tests.integration.benchmark_runs import queues_left, run_benchmark
from weclaw_mq.contract.naming import TASK_INDEX_QUEUES_KEY


def test_task_index_benchmark_smoke_run_prints_both_tables_and_leaves_nothing(
    redis_url: str,
) -> None:
    proc, tag = run_benchmark("benchmarks.task_index_cost", "--smoke", timeout=300)
    for row in (
        "| 10 | off |",
        "| 10 | on |",
        "target: on / off >= 0.95",
        "| newest first | 50 |",
        "| a cursor 90 % deep | 50 |",
        "target: a page < 100 ms",
    ):
        assert row in proc.stdout, row
    assert not queues_left(tag), "the benchmark left its queues behind"
    client = redis.Redis.from_url(redis_url)
    try:
        left = [k for k in client.smembers(TASK_INDEX_QUEUES_KEY) if tag.encode() in k]
    finally:
        client.close()
    assert not left, f"the benchmark left index entries in the shared Redis: {left}"

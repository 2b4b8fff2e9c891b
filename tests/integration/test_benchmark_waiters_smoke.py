"""The waiters benchmark still runs end to end (tiny counts): its numbers live in `make bench`."""

from __future__ import annotations

from tests.integration.benchmark_runs import queues_left, run_benchmark


def test_waiters_benchmark_smoke_run_prints_its_table_and_leaves_nothing() -> None:
    proc, tag = run_benchmark("benchmarks.waiters", "--smoke", timeout=120)
    for row in (
        "| Redis connections, 500 waiting |",
        "| RSS per waiter |",
        "| publish (results on) p50",
    ):
        assert row in proc.stdout, row
    assert not queues_left(tag), "the benchmark left its queue behind"

"""The fair-share benchmark still runs end to end (tiny counts): its numbers live in
`make bench`."""

from __future__ import annotations

from tests.integration.benchmark_runs import queues_left, run_benchmark


def test_fair_share_benchmark_smoke_run_prints_every_row_and_leaves_nothing() -> None:
    proc, tag = run_benchmark("benchmarks.fair_share", "--smoke", timeout=240)
    for line in (
        "behind 1 tenant(s)' backlog",
        "behind 3 tenant(s)' backlog",
        "without fair share (one queue)",
        "consume at concurrency 10, 4 tenant(s)",
        "publish one at a time",
    ):
        assert line in proc.stdout, line
    # The lanes' turns give no delivery back to its queue (each return counts toward the
    # delivery limit).
    assert "given back to their queue 0 (target 0: met)" in proc.stdout, proc.stdout
    assert not queues_left(tag), "the benchmark left its queues behind"

"""The token-budget benchmark still runs end to end (two 1-s windows): its numbers live in
`make bench`."""

from __future__ import annotations

from tests.integration.benchmark_runs import queues_left, run_benchmark


def test_token_budget_benchmark_smoke_run_prints_both_runs_and_the_target() -> None:
    proc, tag = run_benchmark("benchmarks.token_budget", "--smoke", timeout=120)
    for line in ("unbudgeted", "budgeted", "target: budgeted, 0 429s after the warm-up"):
        assert line in proc.stdout, line
    assert not queues_left(tag), "the benchmark left its queue behind"

"""The outbox benchmark still runs end to end (tiny counts): its numbers live in `make bench`."""

from __future__ import annotations

from tests.integration.benchmark_runs import queues_left, run_benchmark


def test_outbox_benchmark_smoke_run_prints_every_case_and_the_ratio() -> None:
    proc, tag = run_benchmark("benchmarks.outbox", "--smoke", timeout=120)
    for case in ("| publish |", "| publish_many |", "(broker down)", "| relay drain |"):
        assert case in proc.stdout, case
    assert "relay drain / publish_many:" in proc.stdout
    assert not queues_left(tag), "the benchmark left its queue behind"

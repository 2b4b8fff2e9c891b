"""The fair-share benchmark still runs end to end (tiny counts): its numbers live in
`make bench`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.broker_ctl import broker_ctl

ROOT = Path(__file__).resolve().parents[2]


def test_fair_share_benchmark_smoke_run_prints_every_row_and_leaves_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.fair_share", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
    listing = broker_ctl("list_queues", "-q", "name")
    assert "bench-fair-" not in listing, "the benchmark left its queues behind"

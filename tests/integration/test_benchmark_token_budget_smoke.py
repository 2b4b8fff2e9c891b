"""The token-budget benchmark still runs end to end (two 1-s windows): its numbers live in
`make bench`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.broker_ctl import broker_ctl

ROOT = Path(__file__).resolve().parents[2]


def test_token_budget_benchmark_smoke_run_prints_both_runs_and_the_target() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.token_budget", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in ("unbudgeted", "budgeted", "target: budgeted, 0 429s after the warm-up"):
        assert line in proc.stdout, line
    listing = broker_ctl("list_queues", "-q", "name")
    assert "bench-token-" not in listing, "the benchmark left its queue behind"

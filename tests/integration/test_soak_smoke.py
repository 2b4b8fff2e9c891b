"""The soak (`make soak`) still runs end to end, with tiny counts: its verdict on 50,000 tasks
is in docs/design/security.md; here only that it publishes, samples, checks every outcome and
cleans up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.broker_ctl import broker_ctl

ROOT = Path(__file__).resolve().parents[2]


def test_soak_smoke_run_samples_rss_and_checks_every_outcome() -> None:
    # A bound of 100 %: a few hundred tasks are still the warm-up of any process.
    args = ["--tasks", "600", "--warmup", "200", "--every", "200", "--bound", "1.0"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RSS MiB" in proc.stdout and "soak: ok" in proc.stdout
    assert "soak: outcomes acked 588, retried 60, dead_lettered 12" in proc.stdout
    listing = broker_ctl("list_queues", "-q", "name")
    assert "soak-" not in listing, "the soak left its queues behind"

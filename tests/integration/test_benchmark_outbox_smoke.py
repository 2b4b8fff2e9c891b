"""The outbox benchmark still runs end to end (tiny counts): its numbers live in `make bench`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.broker_ctl import broker_ctl

ROOT = Path(__file__).resolve().parents[2]


def test_outbox_benchmark_smoke_run_prints_every_case_and_the_ratio() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.outbox", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for case in ("| publish |", "| publish_many |", "(broker down)", "| relay drain |"):
        assert case in proc.stdout, case
    assert "relay drain / publish_many:" in proc.stdout
    listing = broker_ctl("list_queues", "-q", "name")
    assert "bench-outbox-" not in listing, "the benchmark left its queue behind"

"""The waiters benchmark still runs end to end (tiny counts): its numbers live in `make bench`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.broker_ctl import broker_ctl

ROOT = Path(__file__).resolve().parents[2]


def test_waiters_benchmark_smoke_run_prints_its_table_and_leaves_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.waiters", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in (
        "| Redis connections, 500 waiting |",
        "| RSS per waiter |",
        "| publish (results on) p50",
    ):
        assert row in proc.stdout, row
    listing = broker_ctl("list_queues", "-q", "name")
    assert "bench-waiters-" not in listing, "the benchmark left its queue behind"

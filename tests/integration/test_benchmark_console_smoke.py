"""The console page benchmark still runs end to end (tiny counts): its numbers live in
`make bench` (``make bench-console``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_console_benchmark_smoke_run_prints_its_tables_and_targets() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.console_page", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in (
        "| App.tasks, newest 50 (baseline) |",
        "| GET /tasks (the whole page) |",
        "| GET /fragments/tasks?status=dead_lettered |",
        "target: a console page < 100 ms (median)",
        "| open pages | requests | broker + Redis reads | Redis commands |",
        "target: 3 pages cause the reads 1 does",
    ):
        assert row in proc.stdout, row

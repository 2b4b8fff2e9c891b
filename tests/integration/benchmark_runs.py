"""A benchmark script run by a smoke test: its own tag in every queue it names, so the test
checks what its run left behind while another run of the suite shares the broker."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from benchmarks.infra import RUN_TAG_ENV
from tests.broker_ctl import broker_ctl

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    module: str, *args: str, timeout: float
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``python -m module args`` from the repository root; the output and the run's tag."""
    tag = f"smoke{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, RUN_TAG_ENV: tag},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, tag


def queues_left(tag: str) -> list[str]:
    """The broker's queues whose names carry ``tag``."""
    return [name for name in broker_ctl("list_queues", "-q", "name").split() if tag in name]

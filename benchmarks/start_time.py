"""How soon a worker started cold takes its first task: spawn -> first handler start.

    make bench-start                  # or: .venv/bin/python -m benchmarks.start_time
    .venv/bin/python -m benchmarks.start_time --runs 9 --processes 1 2 4
    .venv/bin/python -m benchmarks.start_time --smoke

An autoscaled worker's clock starts when its pod does. Each run declares a fresh queue (as a
deployed worker finds its queues declared), queues three tasks per worker process, then starts
``weclaw-mq worker benchmarks.start_app:app --processes N --concurrency 1`` as a pod would
and times, from just before the spawn, the first handler start of any process ("first") and
the first handler start of the last process to start one ("all": every process has connected
and taken a task; each handler holds its task for a second, and a process holds at most two
tasks at a time, so none takes them all). Stamps are CLOCK_MONOTONIC, shared by
every process. Median (min-max) over ``--runs`` runs; the worker is stopped with SIGTERM after
each and every queue and Redis key of the run is deleted, also after a failure or Ctrl-C.

Target: the median "first" of one process at most 0.5 s. A missed target is reported, not
fatal (the machine may be busy: re-run on a quiet one); exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from weclaw_mq import App
from weclaw_mq.wire.topology import queue_declarations

ROOT = Path(__file__).resolve().parent.parent
TARGET_FIRST_S = 0.5
START_TIMEOUT_S = 30.0
POLL_S = 0.002


async def _noop(task: Any) -> None:
    return None


def _declaring_app(queue: str) -> App:
    app = App("bench-start-publisher")
    app.handler(queue)(_noop)
    return app


async def _cleanup(app: App, queue: str) -> None:
    import aio_pika

    names = [n for n, _ in queue_declarations(app.handlers[queue].queue_spec())]
    conn = await aio_pika.connect(app.settings.amqp_url.get_secret_value())
    try:
        channel = await conn.channel()
        for name in names:
            await channel.queue_delete(name)
    finally:
        await conn.close()
    client = aioredis.Redis.from_url(app.settings.redis_url_plain())
    try:
        keys = [k async for k in client.scan_iter(match=f"*{queue}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def one_run(processes: int) -> tuple[float, float]:
    """(first, all) in seconds from spawn, for a worker of ``processes`` processes."""
    queue = f"bench-start-{uuid.uuid4().hex[:8]}"
    app = _declaring_app(queue)
    stamps = Path(tempfile.mkdtemp(prefix="bench-start-"))
    env = {
        **os.environ,
        "BENCH_START_QUEUE": queue,
        "BENCH_START_DIR": str(stamps),
        "PYTHONPATH": str(ROOT),
    }
    worker: subprocess.Popen[bytes] | None = None
    try:
        await app.declare()
        for i in range(3 * processes):
            await app.publish(queue, {"n": i})
        command = [sys.executable, "-m", "weclaw_mq.cli", "worker", "benchmarks.start_app:app"]
        command += ["--processes", str(processes), "--concurrency", "1", "--log-level", "WARNING"]
        started = time.monotonic_ns()
        worker = _spawn(command, env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(found := _stamps(stamps)) < processes:
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited ({worker.returncode}) before its tasks")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(found)} of {processes} processes took a task in 30 s")
            await asyncio.sleep(POLL_S)
        times = sorted((stamp - started) / 1e9 for stamp in found)
        return times[0], times[-1]
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        shutil.rmtree(stamps, ignore_errors=True)
        await app.close()
        await _cleanup(app, queue)


def _spawn(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)


def _stamps(folder: Path) -> list[int]:
    """The first handler start of each process that started one (monotonic ns)."""
    return [int(p.read_text()) for p in folder.glob("started-*")]


def _figure(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{statistics.median(ms):7.0f} ms ({min(ms):.0f}-{max(ms):.0f})"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per process count")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--smoke", action="store_true", help="2 runs each (figures not kept)")
    args = parser.parse_args(argv)
    runs = 2 if args.smoke else args.runs
    print(f"\n## Time to first delivery: spawn -> handler start (median of {runs} runs)\n")
    print("| worker | first task | every process's first task |")
    print("|---|---|---|")
    status = 0
    missed: list[str] = []
    for n in args.processes:
        firsts: list[float] = []
        alls: list[float] = []
        for _ in range(runs):
            try:
                first, every = await one_run(n)
            except Exception as e:
                print(f"start_time: --processes {n}: {e}", file=sys.stderr)
                status = 1
                continue
            firsts.append(first)
            alls.append(every)
        if not firsts:
            continue
        label = "1 process" if n == 1 else f"--processes {n}"
        print(f"| {label} | {_figure(firsts)} | {_figure(alls)} |", flush=True)
        if n == 1 and statistics.median(firsts) > TARGET_FIRST_S:
            missed.append(
                f"1 process: first task after {statistics.median(firsts) * 1000:.0f} ms, "
                f"over the target of {TARGET_FIRST_S * 1000:.0f} ms"
            )
    print()
    for line in missed:
        print(f"target missed: {line}")
    if not missed and 1 in args.processes:
        print(f"target met: 1 process's first task within {TARGET_FIRST_S * 1000:.0f} ms")
    return status


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

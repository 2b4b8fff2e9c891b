"""Soak: a long-running worker's memory stays flat (no per-task growth), on the real broker.

    make soak                                  # or: .venv/bin/python -m benchmarks.soak
    .venv/bin/python -m benchmarks.soak --tasks 50000 --warmup 10000 --every 2500

One worker process (``weclaw-mq worker benchmarks.soak:app``, guard and results on,
concurrency 32) runs ``--tasks`` tasks that this process publishes in windows, at most
``--outstanding`` ahead of the worker. One task in 10 fails its first attempt (a retry through
the delay queue), one in 50 is rejected (the DLQ). Every ``--every`` settled tasks the worker's
RSS (``/proc/PID/status`` VmRSS) is sampled and printed. The verdict: after ``--warmup`` tasks,
no sample is more than ``--bound`` (10 %) above the RSS at the end of the warm-up; exit 1 if
one is, or if a task did not end where it should.

Its queues and Redis keys (unique names) are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import redis.asyncio as aioredis
from pydantic import BaseModel

from weclaw_mq import App, Context, Reject, RetryPolicy, Settings
from weclaw_mq.contract.naming import task_keys

from .infra import delete_app_queues, forget_task_index

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE_ENV = "SOAK_QUEUE"
CONCURRENCY = 32
FAIL_ONCE_EVERY = 10  # n % 10 == 3: the first attempt fails, the retry succeeds
REJECT_EVERY = 50  # n % 50 == 7: rejected, to the DLQ
ROOT = Path(__file__).resolve().parents[1]


class Job(BaseModel):
    n: int
    text: str


def build_app(queue: str) -> App:
    # Records live 10 minutes (not a day): the soak's keys must not outlast it by much even
    # when it is cut off before its own clean-up.
    settings = Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL, result_ttl_s=600, done_ttl_s=600)
    app = App("soak", settings=settings)

    @app.handler(queue, retry=RetryPolicy(max_retries=1, delay_s=0.05))
    async def work(job: Job, ctx: Context) -> dict[str, object]:
        if job.n % REJECT_EVERY == 7:
            raise Reject("soak: this task cannot succeed")
        if job.n % FAIL_ONCE_EVERY == 3 and ctx.attempt == 1:
            raise RuntimeError("soak: the first attempt fails")
        return {"n": job.n, "reply": job.text[::-1]}

    return app


def __getattr__(name: str) -> App:
    """``app`` for the worker process, built from its environment on first access."""
    if name != "app":
        raise AttributeError(name)
    return build_app(os.environ[QUEUE_ENV])


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert match, "no VmRSS"
    return int(match.group(1)) / 1024


def outcomes(port: int, queue: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    found: dict[str, float] = {}
    pattern = re.compile(r"^weclaw_mq_messages_total\{(.*)\} (\S+)$", re.M)
    for labels, value in pattern.findall(text):
        if f'queue="{queue}"' in labels:
            outcome = re.search(r'outcome="([^"]+)"', labels)
            if outcome:
                found[outcome.group(1)] = float(value)
    return found


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def cleanup(app: App, queue: str, tasks: int) -> None:
    """Delete the soak's queues and every Redis key its tasks may own."""
    await delete_app_queues(AMQP_URL, app)
    await forget_task_index(REDIS_URL, queue)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for start in range(0, tasks, 1000):
            keys = [
                k
                for n in range(start, min(start + 1000, tasks))
                for k in task_keys(queue, task_id(queue, n))
            ]
            await client.delete(*keys)
    finally:
        await client.aclose()


def task_id(queue: str, n: int) -> str:
    return f"{queue}-{n}"


def start_worker(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)


async def soak(args: argparse.Namespace) -> int:
    queue = f"soak-{uuid.uuid4().hex[:8]}"
    app = build_app(queue)
    port = free_port()
    await app.declare()
    log = Path(tempfile.mkdtemp(prefix="weclaw-soak-")) / "worker.log"
    env = {**os.environ, QUEUE_ENV: queue, "WECLAW_MQ_AMQP_URL": AMQP_URL}
    env["WECLAW_MQ_REDIS_URL"] = REDIS_URL
    worker_cmd = [
        str(Path(sys.executable).with_name("weclaw-mq")),
        "worker",
        "benchmarks.soak:app",
        "--concurrency",
        str(CONCURRENCY),
        "--metrics-port",
        str(port),
        "--log-level",
        "ERROR",
    ]
    worker = start_worker(worker_cmd, env, log)
    rows: list[tuple[int, float, float]] = []
    failed = False
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                outcomes(port, queue)
                break
            except OSError:
                if worker.poll() is not None or time.monotonic() > deadline:
                    print(f"soak: the worker did not start; see {log}", file=sys.stderr)
                    return 1
                await asyncio.sleep(0.2)
        published = 0
        started = time.monotonic()
        next_sample = args.every
        settled = 0.0
        text = "prompt " * 20
        print(f"soak: {args.tasks} tasks on {queue}; worker pid {worker.pid}; log {log}")
        print(f"{'tasks settled':>14}  {'RSS MiB':>8}  {'tasks/s':>8}")
        while settled < args.tasks:
            if worker.poll() is not None:
                print(f"soak: the worker exited ({worker.returncode}); see {log}", file=sys.stderr)
                return 1
            if published < args.tasks and published - settled < args.outstanding:
                batch = min(500, args.tasks - published)
                numbers = range(published, published + batch)
                await app.publish_many(
                    queue,
                    [Job(n=n, text=text) for n in numbers],
                    task_ids=[task_id(queue, n) for n in numbers],
                )
                published += batch
                continue
            await asyncio.sleep(0.2)
            seen = outcomes(port, queue)
            settled = seen.get("acked", 0.0) + seen.get("dead_lettered", 0.0)
            while settled >= next_sample and next_sample <= args.tasks:
                rate = settled / (time.monotonic() - started)
                rows.append((next_sample, rss_mib(worker.pid), rate))
                print(f"{next_sample:>14}  {rows[-1][1]:>8.1f}  {rate:>8.0f}", flush=True)
                next_sample += args.every
        seen = outcomes(port, queue)
        rejects = sum(1 for n in range(args.tasks) if n % REJECT_EVERY == 7)
        retries = sum(
            1 for n in range(args.tasks) if n % FAIL_ONCE_EVERY == 3 and n % REJECT_EVERY != 7
        )
        expect = {
            "acked": args.tasks - rejects,
            "dead_lettered": rejects,
            "retried": retries,
        }
        for outcome, count in expect.items():
            if seen.get(outcome, 0.0) != count:
                print(f"soak: {outcome} {seen.get(outcome, 0.0):.0f}, expected {count}")
                failed = True
        warm = [r for r in rows if r[0] <= args.warmup]
        after = [r for r in rows if r[0] > args.warmup]
        if not warm or not after:
            print("soak: too few samples for a verdict (raise --tasks or lower --every)")
            return 1
        base = warm[-1][1]
        peak = max(r[1] for r in after)
        end = after[-1][1]
        growth = (peak - base) / base
        print(
            f"soak: RSS after warm-up ({args.warmup} tasks) {base:.1f} MiB; peak after it "
            f"{peak:.1f} MiB (+{growth * 100:.1f} %); at the end {end:.1f} MiB "
            f"({(end - base) / base * 100:+.1f} %); bound +{args.bound * 100:.0f} %"
        )
        print(
            f"soak: outcomes acked {seen.get('acked', 0):.0f}, retried "
            f"{seen.get('retried', 0):.0f}, dead_lettered {seen.get('dead_lettered', 0):.0f}"
        )
        if growth > args.bound:
            print("soak: FAILED: RSS grew past the bound")
            failed = True
        print("soak: FAILED" if failed else "soak: ok")
        return 1 if failed else 0
    finally:
        if worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        await app.close()
        await cleanup(app, queue, args.tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--warmup", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=2_500)
    parser.add_argument("--outstanding", type=int, default=2_000)
    parser.add_argument("--bound", type=float, default=0.10)
    sys.exit(asyncio.run(soak(parser.parse_args())))


if __name__ == "__main__":
    main()

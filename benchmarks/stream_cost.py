"""What streaming partial output costs: ``ctx.emit`` in the handler, and emit -> reader delay.

    make bench-stream                         # or: .venv/bin/python -m benchmarks.stream_cost
    .venv/bin/python -m benchmarks.stream_cost --tasks 40 --latency-tasks 8 --chunks 200 \
        --pace-ms 10
    .venv/bin/python -m benchmarks.stream_cost --smoke

Real RabbitMQ and Redis (``WECLAW_MQ_AMQP_URL``, ``WECLAW_MQ_REDIS_URL``), one Worker and the
readers in this process, on a queue named for this run (deleted at the end with every Redis
key the run wrote, also after a failure or Ctrl-C).

1. **Emit cost** (target: at most 5 ms per task): each handler emits ``--chunks`` chunks
   (a few words each, like a model's token groups) back to back, and sums the time spent
   inside its ``await ctx.emit(...)`` calls (``perf_counter``). One task at a time
   (concurrency 1), so no other task's work lands inside the measured awaits. Figures: the
   median and p95 over the tasks. For reference, the turnaround (publish to result) of the
   same tasks against tasks that emit nothing, run alternately: the ratio is what streaming
   adds to a task's end to end time (the worker writes every chunk before it stores the
   result).
2. **Emit -> reader** (target: median and p95 at most 10 ms): handlers emit ``--chunks``
   chunks paced ``--pace-ms`` apart (10 ms: a fast model writing 100 chunks a second, with
   a reader waiting),
   each carrying its ``perf_counter_ns`` at emit; a reader of ``App.stream(task_id)``,
   started before the task is published, takes the delay at arrival. Four tasks at a time,
   each with its reader.

Exit status 1 when a phase produced no figures; a missed target is reported, not fatal (the
machine may be busy: re-run on a quiet one).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel

from weclaw_mq import App, Context, Settings, Worker
from weclaw_mq.contract.naming import (
    GUARD_KEY_PREFIX,
    STATE_KEY_PREFIX,
    queue_key_pattern,
    stream_key,
    task_keys,
)
from weclaw_mq.wire.topology import queue_declarations

EMIT_BOUND_MS = 5.0
LATENCY_BOUND_MS = 10.0
CHUNK_TEXT = "four words per chunk "
LATENCY_CONCURRENCY = 4
RESULT_TIMEOUT_S = 60.0


class StreamTask(BaseModel):
    chunks: int
    pace_ms: float = 0.0
    stamp: bool = False


async def produce(task: StreamTask, ctx: Context) -> dict[str, Any]:
    """Emit ``task.chunks`` chunks; the time spent inside the emits, in ns."""
    spent = 0
    for i in range(task.chunks):
        chunk: Any = {"i": i, "t": time.perf_counter_ns()} if task.stamp else CHUNK_TEXT
        started = time.perf_counter_ns()
        await ctx.emit(chunk)
        spent += time.perf_counter_ns() - started
        if task.pace_ms:
            await asyncio.sleep(task.pace_ms / 1000)
    return {"emit_ns": spent}


@dataclass
class Figures:
    emit_ms: list[float]
    turnaround_ms: list[float]
    baseline_ms: list[float]
    latency_ms: list[float]


def p95(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]
    )


async def run_task(app: App, queue: str, task: StreamTask) -> tuple[float, dict[str, Any]]:
    """Publish one task and wait for its result: (turnaround in ms, result)."""
    started = time.perf_counter()
    task_id = await app.publish(queue, task)
    state = await app.result(task_id, queue=queue, timeout_s=RESULT_TIMEOUT_S)
    if state.status.value != "succeeded":
        raise RuntimeError(f"task {task_id} ended {state.status.value}: {state.error}")
    result: dict[str, Any] = state.result
    return (time.perf_counter() - started) * 1000, result


async def emit_cost(app: App, queue: str, tasks: int, chunks: int, figures: Figures) -> None:
    for _ in range(tasks):
        # Alternated, so both see the same machine load.
        ms, result = await run_task(app, queue, StreamTask(chunks=chunks))
        figures.turnaround_ms.append(ms)
        figures.emit_ms.append(result["emit_ns"] / 1e6)
        base_ms, _ = await run_task(app, queue, StreamTask(chunks=0))
        figures.baseline_ms.append(base_ms)


async def read_delays(app: App, task_id: str, delays: list[float]) -> None:
    async for event in app.stream(task_id):
        if event.kind == "chunk":
            delays.append((time.perf_counter_ns() - event.data["t"]) / 1e6)


async def one_latency_task(app: App, queue: str, chunks: int, pace_ms: float) -> list[float]:
    task_id = str(uuid.uuid4())
    delays: list[float] = []
    reader = asyncio.create_task(read_delays(app, task_id, delays))
    await app.publish(
        queue, StreamTask(chunks=chunks, pace_ms=pace_ms, stamp=True), task_id=task_id
    )
    async with asyncio.timeout(RESULT_TIMEOUT_S):
        await reader  # the stream ends with the task's final event
    if len(delays) != chunks:
        raise RuntimeError(f"the reader got {len(delays)} of {chunks} chunks of {task_id}")
    return delays


async def emit_latency(
    app: App, queue: str, tasks: int, chunks: int, pace_ms: float, figures: Figures
) -> None:
    for start in range(0, tasks, LATENCY_CONCURRENCY):
        batch = range(start, min(tasks, start + LATENCY_CONCURRENCY))
        for delays in await asyncio.gather(
            *(one_latency_task(app, queue, chunks, pace_ms) for _ in batch)
        ):
            figures.latency_ms.extend(delays)


async def cleanup(app: App, redis_url: str, queue: str) -> None:
    """Delete the run's queues and every Redis key its tasks wrote."""
    conn = await app.broker.connect(name="bench-stream-cleanup")
    try:
        spec = app.handlers[queue].queue_spec()
        for name, _ in queue_declarations(spec):
            channel = await conn.channel()
            await channel.queue_delete(name)
            await channel.close()
    finally:
        await conn.close()
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys: list[str] = []
        for prefix in (GUARD_KEY_PREFIX, STATE_KEY_PREFIX):
            async for key in client.scan_iter(queue_key_pattern(prefix, queue)):
                task_id = key.decode().rsplit(":{", 1)[1].removesuffix("}")
                keys += [*task_keys(queue, task_id), stream_key(task_id)]
        if keys:
            await client.delete(*set(keys))
    finally:
        await client.aclose()


async def running_worker(app: App, concurrency: int) -> tuple[Worker, asyncio.Task[None]]:
    worker = Worker(app, concurrency=concurrency, shutdown_grace_s=5)
    running = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    await asyncio.wait({ready, running}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        running.cancel()
        raise RuntimeError("the worker did not start consuming within 30 s")
    return worker, running


async def measure(args: argparse.Namespace) -> Figures:
    settings = Settings()
    queue = f"bench-stream-{uuid.uuid4().hex[:10]}"
    app = App("bench-stream", settings=settings)
    app.handler(queue)(produce)
    figures = Figures([], [], [], [])
    phases: list[tuple[int, Callable[[], Awaitable[None]]]] = [
        (1, lambda: emit_cost(app, queue, args.tasks, args.chunks, figures)),
        (
            LATENCY_CONCURRENCY,
            lambda: emit_latency(
                app, queue, args.latency_tasks, args.chunks, args.pace_ms, figures
            ),
        ),
    ]
    await app.declare()
    try:
        for concurrency, phase in phases:
            worker, running = await running_worker(app, concurrency)
            try:
                await phase()
            finally:
                worker.stop()
                await running
    finally:
        await cleanup(app, settings.redis_url_plain(), queue)
        await app.close()
    return figures


def report(f: Figures, args: argparse.Namespace) -> int:
    print(f"stream benchmark: {args.chunks} chunks per task")
    print("| measure | median | p95 | bound | result |")
    print("|---|---|---|---|---|")
    status = 0
    rows: list[tuple[str, list[float], float | None]] = [
        (
            f"ctx.emit x{args.chunks}, time in the handler (ms, {len(f.emit_ms)} tasks)",
            f.emit_ms,
            EMIT_BOUND_MS,
        ),
        (
            f"emit -> App.stream reader (ms, {len(f.latency_ms)} chunks, {args.pace_ms} ms apart)",
            f.latency_ms,
            LATENCY_BOUND_MS,
        ),
        (f"turnaround with {args.chunks} chunks (ms)", f.turnaround_ms, None),
        ("turnaround with no chunk (ms, baseline)", f.baseline_ms, None),
    ]
    for name, values, bound in rows:
        if not values:
            print(f"| {name} | - | - | - | NO DATA |")
            status = 1
            continue
        median, high = statistics.median(values), p95(values)
        verdict = "" if bound is None else ("met" if max(median, high) <= bound else "MISSED")
        limit = "" if bound is None else f"<= {bound:g}"
        print(f"| {name} | {median:.3f} | {high:.3f} | {limit} | {verdict} |")
    if f.turnaround_ms and f.baseline_ms:
        ratios = [a / b for a, b in zip(f.turnaround_ms, f.baseline_ms, strict=True)]
        print(
            f"turnaround ratio, {args.chunks} chunks / none: "
            f"median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks.stream_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", type=int, default=40, help="tasks of the emit-cost phase")
    p.add_argument("--latency-tasks", type=int, default=8, help="tasks of the latency phase")
    p.add_argument("--chunks", type=int, default=200, help="chunks per task")
    # 10 ms: a fast model's 100 chunks a second.
    p.add_argument("--pace-ms", type=float, default=10.0, help="delay between paced chunks")
    p.add_argument("--smoke", action="store_true", help="tiny counts (a few seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tasks, args.latency_tasks = 3, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return report(asyncio.run(measure(args)), args)


if __name__ == "__main__":
    sys.exit(main())

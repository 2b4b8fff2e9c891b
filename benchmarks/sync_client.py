"""``app.sync.publish`` from 8 threads at once against the async ``publish`` it wraps.

    make bench-sync-client                 # or: .venv/bin/python -m benchmarks.sync_client
    .venv/bin/python -m benchmarks.sync_client --n 2000 --rounds 3
    .venv/bin/python -m benchmarks.sync_client --smoke

Cases (each round runs every case once, in a rotated order; figures are medians over the
rounds, with min-max; ratios are paired per round):

- ``async publish x8``: 8 coroutines on one loop, each awaiting ``App.publish`` (its confirm)
  one task at a time: the async API at the same concurrency as the threads.
- ``async publish x1``: one coroutine, one task at a time (for scale).
- ``sync publish, 8 threads``: 8 threads, each calling ``app.sync.publish`` one task at a
  time; every call runs on the process's one background loop and connection.

Target: the 8 threads publish at least 0.8x the rate of ``async publish x8`` (paired median
ratio). Broker: ``WECLAW_MQ_AMQP_URL`` (default 127.0.0.1:5672), one quorum queue of the run's
own, deleted at the end. Results (the task store) are off: Redis is not measured. The payload
is ``benchmarks.common.make_payload`` (1 KiB of JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import aio_pika

from weclaw_mq import App, Settings
from weclaw_mq.wire.topology import queue_declarations

from .common import make_payload
from .infra import bench_queue_name

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TARGET = 0.8
THREADS = 8
CASES = ("async publish x8", "async publish x1", "sync publish, 8 threads")


def _app(queue: str) -> App:
    app = App("bench-sync", settings=Settings(amqp_url=AMQP_URL, results_enabled=False))

    @app.handler(queue)
    async def work(task: dict[str, object]) -> None:  # declared only, never consumed
        return None

    return app


async def _purge(queue: str) -> None:
    conn = await aio_pika.connect(AMQP_URL)
    try:
        channel = await conn.channel()
        await (await channel.declare_queue(queue, passive=True)).purge()
    finally:
        await conn.close()


async def _async_rate(app: App, queue: str, n: int, concurrency: int) -> float:
    payloads = [make_payload(i) for i in range(n)]
    share = n // concurrency

    async def one(part: list[dict[str, object]]) -> None:
        for p in part:
            await app.publish(queue, p)

    started = time.perf_counter()
    await asyncio.gather(*(one(payloads[i * share : (i + 1) * share]) for i in range(concurrency)))
    return share * concurrency / (time.perf_counter() - started)


def _threads_rate(app: App, queue: str, n: int) -> float:
    payloads = [make_payload(i) for i in range(n)]
    share = n // THREADS
    barrier = threading.Barrier(THREADS + 1)

    def one(part: list[dict[str, object]]) -> None:
        barrier.wait()
        for p in part:
            app.sync.publish(queue, p)

    threads = [
        threading.Thread(target=one, args=(payloads[i * share : (i + 1) * share],))
        for i in range(THREADS)
    ]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return share * THREADS / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> int:
    queue = bench_queue_name("sync")
    async_app, sync_app = _app(queue), _app(queue)
    await async_app.declare()
    await asyncio.to_thread(sync_app.sync.publish, queue, make_payload(0))  # warm: connect
    await async_app.publish(queue, make_payload(0))
    cases: dict[str, Callable[[], object]] = {
        "async publish x8": lambda: _async_rate(async_app, queue, args.n, THREADS),
        "async publish x1": lambda: _async_rate(async_app, queue, args.n // 4, 1),
        "sync publish, 8 threads": lambda: asyncio.to_thread(
            _threads_rate, sync_app, queue, args.n
        ),
    }
    rates: dict[str, list[float]] = {c: [] for c in CASES}
    try:
        for r in range(args.rounds):
            for name in CASES[r % len(CASES) :] + CASES[: r % len(CASES)]:
                await _purge(queue)
                rate = await cases[name]()  # type: ignore[misc]
                rates[name].append(float(rate))
    finally:
        await asyncio.to_thread(sync_app.sync.close)
        await async_app.close()
        conn = await aio_pika.connect(AMQP_URL)
        try:
            channel = await conn.channel()
            for spec in async_app.handlers.values():
                for name, _ in queue_declarations(spec.queue_spec()):
                    await channel.queue_delete(name)
        finally:
            await conn.close()
    ratios = [
        s / a
        for s, a in zip(rates["sync publish, 8 threads"], rates["async publish x8"], strict=True)
    ]
    print(f"sync client benchmark: n={args.n}, {args.rounds} rounds, {THREADS} threads")
    print("| case | tasks/s (median) | min-max |")
    print("|---|---|---|")
    for name in CASES:
        v = rates[name]
        print(f"| {name} | {statistics.median(v):,.0f} | {min(v):,.0f}-{max(v):,.0f} |")
    median = statistics.median(ratios)
    verdict = "met" if median >= TARGET else "MISSED"
    print(
        f"sync 8 threads / async x8: {median:.2f}x (min-max {min(ratios):.2f}-{max(ratios):.2f}); "
        f"target >= {TARGET}x: {verdict} (held in {sum(x >= TARGET for x in ratios)} of "
        f"{len(ratios)} rounds)"
    )
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sync_client", description=__doc__)
    parser.add_argument("--n", type=int, default=2000, help="tasks per case (x1: a quarter)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny counts, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.rounds = 80, 1
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))

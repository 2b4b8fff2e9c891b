"""Priorities on the real broker: how soon an URGENT task starts behind a NORMAL backlog, and
what the lanes cost in throughput against one queue.

    make bench-priority                      # or: .venv/bin/python -m benchmarks.priority
    .venv/bin/python -m benchmarks.priority --smoke

1. URGENT behind a backlog: a worker with concurrency C (10) runs a handler of WORK_MS (20 ms)
   over BACKLOG (1000) queued NORMAL tasks; once it is busy, one URGENT task is published. We
   count the handler completions between that publish and the URGENT task's start (target:
   at most C + 1, the median over RUNS runs) and its start latency. For reference, one run
   publishes a NORMAL task at the same point instead: it waits for the whole backlog.
2. Throughput: N queued NORMAL tasks, a no-op handler (guard and results off, so the
   consumption machinery is all there is to measure), concurrency 10 and 100, consumed once
   through the lanes (``worker.lanes``: a prefetch-1 consumer per running task plus a spare
   per lane) and once through one queue with one prefetch-C consumer (the plan of a broker
   with native priorities, on the same quorum queue). Rounds alternate the two; the ratio
   is paired per round, median over the rounds (target: lanes at least 0.95 of one queue).
   Each round also runs the lanes without their bulk mode (prefetch-1 consumers throughout,
   ``WECLAW_MQ_LANES_BULK=0``), paired the same way.
   For reference, each round also measures the broker's share of that cost with plain
   aio-pika (ack on arrival, no framework): C + 3 prefetch-1 consumers against one
   prefetch-C consumer on the same kind of queue.

On a shared 2-core machine the numbers are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika

from weclaw_mq import App, Context, Settings, Worker
from weclaw_mq.worker import consume

from .infra import delete_app_queues

RESULTS = Path(__file__).resolve().parent / "results"
THROUGHPUT_TARGET = 0.95


def _settings(amqp_url: str) -> Settings:
    return Settings(amqp_url=amqp_url, results_enabled=False, _env_file=None)  # type: ignore[call-arg,arg-type]


async def urgent_run(
    amqp_url: str, *, concurrency: int, backlog: int, work_s: float, level: str
) -> tuple[int, float]:
    """(completions between the publish and the start, start latency in s) of one task of
    ``level`` published behind ``backlog`` NORMAL ones."""
    app = App("bench-priority", settings=_settings(amqp_url))
    queue = f"bench-priority-{uuid.uuid4().hex[:10]}"
    done = 0
    busy = asyncio.Event()  # every slot taken and the look-ahead filled
    marker: asyncio.Future[tuple[int, float]] = asyncio.get_running_loop().create_future()

    @app.handler(queue, idempotent=False, priorities=True)
    async def work(task: dict[str, Any], ctx: Context) -> None:
        nonlocal done
        if task.get("marker") and not marker.done():
            marker.set_result((done, time.perf_counter()))
        await asyncio.sleep(work_s)
        done += 1
        if done >= 2 * concurrency:
            busy.set()

    try:
        await app.declare()
        await app.publish_many(queue, [{"n": i} for i in range(backlog)])
        worker = Worker(app, concurrency=concurrency)
        running = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(busy.wait(), 60)
            before, published_at = done, time.perf_counter()
            await app.publish(queue, {"marker": True}, priority=level)
            timeout = backlog * work_s / concurrency * 3 + 10
            done_at_start, started_at = await asyncio.wait_for(marker, timeout)
        finally:
            worker.stop()
            await running
        return done_at_start - before, started_at - published_at
    finally:
        await app.close()
        await delete_app_queues(amqp_url, app)


@contextlib.contextmanager
def per_consumer_lanes() -> Iterator[None]:
    """The lanes without their bulk mode (``worker.lanes``): every lane served by prefetch-1
    consumers throughout, as before the bulk mode (for the paired comparison)."""
    real = consume.LANES_BULK
    consume.LANES_BULK = False
    try:
        yield
    finally:
        consume.LANES_BULK = real


async def throughput_run(
    amqp_url: str, *, concurrency: int, n: int, lanes: bool, bulk: bool = True
) -> float:
    """Tasks per second consumed from a prefilled queue."""
    app = App("bench-priority", settings=_settings(amqp_url))
    queue = f"bench-priority-{uuid.uuid4().hex[:10]}"
    done = 0
    all_done = asyncio.Event()

    # Without priorities the worker consumes Q alone with one prefetch-C consumer: what it
    # does on a broker with native priorities (4.3), here on the same queue type, the baseline.
    @app.handler(queue, idempotent=False, priorities=lanes)
    async def work(task: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        if done == n:
            all_done.set()

    try:
        await app.declare()
        for start in range(0, n, 1000):
            await app.publish_many(queue, [{"n": i} for i in range(start, min(n, start + 1000))])
        with contextlib.nullcontext() if bulk else per_consumer_lanes():
            worker = Worker(app, concurrency=concurrency)
            began = time.perf_counter()
            running = asyncio.create_task(worker.run())
            try:
                await asyncio.wait_for(all_done.wait(), 300)
                elapsed = time.perf_counter() - began
            finally:
                worker.stop()
                await running
        return n / elapsed
    finally:
        await app.close()
        await delete_app_queues(amqp_url, app)


async def raw_run(amqp_url: str, *, consumers: int, prefetch: int, n: int) -> float:
    """Messages per second that plain aio-pika consumers ack from a prefilled quorum queue."""
    conn = await aio_pika.connect(amqp_url)
    name = f"bench-priority-raw-{uuid.uuid4().hex[:10]}"
    try:
        channel = await conn.channel()
        queue = await channel.declare_queue(
            name, durable=True, arguments={"x-queue-type": "quorum"}
        )
        publisher = await conn.channel(publisher_confirms=True)
        for start in range(0, n, 1000):
            await asyncio.gather(
                *(
                    publisher.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=name)
                    for _ in range(start, min(n, start + 1000))
                )
            )
        consuming = await conn.channel()
        await consuming.set_qos(prefetch_count=prefetch)
        target = await consuming.get_queue(name, ensure=False)
        done = 0
        all_done = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal done
            await message.ack()
            done += 1
            if done == n:
                all_done.set()

        began = time.perf_counter()
        for _ in range(consumers):
            await target.consume(on_message)
        await asyncio.wait_for(all_done.wait(), 300)
        elapsed = time.perf_counter() - began
        await consuming.close()  # its consumers first: a deleted queue cancels them noisily
        await queue.delete(if_unused=False, if_empty=False)
        return n / elapsed
    finally:
        await conn.close()


def _fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.3g}{unit} (min {min(values):.3g}, max {max(values):.3g})"


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    url = args.amqp_url
    c = args.concurrency
    out: dict[str, Any] = {"concurrency": c, "backlog": args.backlog, "work_ms": args.work_ms}
    completions, latencies = [], []
    for _ in range(args.runs):
        k, s = await urgent_run(
            url, concurrency=c, backlog=args.backlog, work_s=args.work_ms / 1000, level="urgent"
        )
        completions.append(k)
        latencies.append(s)
    _, normal_latency = await urgent_run(
        url, concurrency=c, backlog=args.backlog, work_s=args.work_ms / 1000, level="normal"
    )
    out["urgent_completions"] = completions
    out["urgent_latency_s"] = latencies
    out["normal_latency_s"] = normal_latency
    out["throughput"] = {}
    for conc in args.throughput_concurrency:
        ratios, lane_rates, one_rates, raw_ratios = [], [], [], []
        per_rates, per_ratios, bulk_gains = [], [], []
        for _ in range(args.rounds):
            one = await throughput_run(url, concurrency=conc, n=args.n, lanes=False)
            lane = await throughput_run(url, concurrency=conc, n=args.n, lanes=True)
            per = await throughput_run(url, concurrency=conc, n=args.n, lanes=True, bulk=False)
            one_rates.append(one)
            lane_rates.append(lane)
            ratios.append(lane / one)
            per_rates.append(per)
            per_ratios.append(per / one)
            bulk_gains.append(lane / per)
            raw_one = await raw_run(url, consumers=1, prefetch=conc, n=args.n)
            raw_many = await raw_run(url, consumers=conc + 3, prefetch=1, n=args.n)
            raw_ratios.append(raw_many / raw_one)
        out["throughput"][str(conc)] = {
            "lanes": lane_rates,
            "one_queue": one_rates,
            "ratio": ratios,
            "per_consumer": per_rates,
            "per_consumer_ratio": per_ratios,
            "bulk_gain": bulk_gains,
            "raw_ratio": raw_ratios,
        }
    return out


def report(out: dict[str, Any]) -> str:
    c = out["concurrency"]
    median_k = statistics.median(out["urgent_completions"])
    lines = [
        f"PRIORITY: concurrency {c}, {out['backlog']} NORMAL tasks queued, handler "
        f"{out['work_ms']} ms",
        f"  URGENT start, in handler completions after its publish: "
        f"{_fmt(out['urgent_completions'])} over {len(out['urgent_completions'])} runs "
        f"(target <= C + 1 = {c + 1}: {'met' if median_k <= c + 1 else 'MISSED'})",
        f"  URGENT start latency: {_fmt(out['urgent_latency_s'], ' s')}; a NORMAL task "
        f"published at the same point: {out['normal_latency_s']:.3g} s",
    ]
    for conc, row in out["throughput"].items():
        ratio = statistics.median(row["ratio"])
        lines.append(
            f"  throughput at concurrency {conc}: lanes {_fmt(row['lanes'], '/s')}, one queue "
            f"{_fmt(row['one_queue'], '/s')}; lanes / one queue {_fmt(row['ratio'])} "
            f"(target >= {THROUGHPUT_TARGET}: {'met' if ratio >= THROUGHPUT_TARGET else 'MISSED'});"
            " "
            f"the broker's share, plain aio-pika {int(conc) + 3} prefetch-1 consumers / one "
            f"prefetch-{conc} consumer: {_fmt(row['raw_ratio'])}"
        )
        if row.get("per_consumer"):
            lines.append(
                f"    lanes without bulk mode (prefetch-1 consumers throughout): "
                f"{_fmt(row['per_consumer'], '/s')}; / one queue {_fmt(row['per_consumer_ratio'])}"
                f"; lanes (bulk mode) / without, paired: {_fmt(row['bulk_gain'])}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.priority", description=__doc__)
    p.add_argument("--amqp-url", default=Settings().amqp_url.get_secret_value())
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--backlog", type=int, default=1000)
    p.add_argument("--work-ms", type=float, default=20.0)
    p.add_argument("--runs", type=int, default=5, help="URGENT runs (median)")
    p.add_argument("--n", type=int, default=4000, help="tasks per throughput run")
    p.add_argument("--rounds", type=int, default=5, help="throughput rounds (paired ratios)")
    p.add_argument("--throughput-concurrency", type=int, nargs="+", default=[10, 100])
    p.add_argument("--smoke", action="store_true", help="tiny counts: the script still runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.backlog, args.runs, args.n, args.rounds = 100, 1, 300, 1
        args.throughput_concurrency = [10]
    out = asyncio.run(measure(args))
    print(report(out))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("priority-smoke.json" if args.smoke else "priority.json")).write_text(
        json.dumps(out, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

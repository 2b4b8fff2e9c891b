"""Many ``result()`` waiters in one process: the Redis connections they use, the memory each
costs, and what ``publish`` and ``status()`` cost meanwhile.

    make bench-waiters                       # or: .venv/bin/python -m benchmarks.waiters
    .venv/bin/python -m benchmarks.waiters --waiters 10000 --n 300
    .venv/bin/python -m benchmarks.waiters --smoke

One ``App`` with results on (the default pool, ``WECLAW_MQ_REDIS_MAX_CONNECTIONS``), whose
Redis connections carry a client name of the run's own, counted with ``CLIENT LIST``:

1. ``--n`` publishes one at a time (each awaits its confirm and its "queued" record) and
   ``--n`` ``status()`` reads, with no waiter: the baseline latency;
2. ``--waiters`` ``app.result()`` calls on task ids with no record yet, all waiting: the
   time until every one is subscribed, the connections in use, and the process's RSS and
   Python heap (``tracemalloc`` is not used: it would double the cost it measures) against
   before, per waiter;
3. the same publishes and reads while they wait;
4. every waiter's task given a final record at once (``record_many``): the time until every
   ``result()`` returned.

Broker ``WECLAW_MQ_AMQP_URL``, Redis ``WECLAW_MQ_REDIS_URL`` (defaults: 127.0.0.1); one queue
of the run's own and every key it wrote are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
import uuid

import aio_pika
import redis.asyncio as aioredis

from weclaw_mq import App, Settings, TaskStatus
from weclaw_mq.contract.naming import done_channel, latest_key, state_key
from weclaw_mq.state import TaskState
from weclaw_mq.wire.topology import delay_exchanges, queue_declarations

from .common import make_payload
from .infra import bench_queue_name, forget_task_index

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0")


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def named(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}client_name={name}"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Bench:
    def __init__(self, waiters: int, n: int) -> None:
        self.waiters = waiters
        self.n = n
        self.name = bench_queue_name("waiters")
        self.queue = self.name
        settings = Settings(amqp_url=AMQP_URL, redis_url=named(REDIS_URL, self.name))
        self.app = App(self.name, settings=settings)
        self.published: list[str] = []
        self.ids = [uuid.uuid4().hex for _ in range(waiters)]

        @self.app.handler(self.queue)
        async def work(task: dict[str, object]) -> None:  # declared only, never consumed
            return None

    async def connections(self, probe: aioredis.Redis) -> int:
        return sum(1 for c in await probe.client_list() if c.get("name") == self.name)

    async def latencies(self) -> tuple[list[float], list[float]]:
        """ms per publish and per status() read, ``n`` of each, one at a time."""
        publish, status = [], []
        for i in range(self.n):
            started = time.perf_counter()
            task_id = await self.app.publish(self.queue, make_payload(i))
            publish.append((time.perf_counter() - started) * 1000)
            self.published.append(task_id)
            started = time.perf_counter()
            await self.app.status(task_id, queue=self.queue)
            status.append((time.perf_counter() - started) * 1000)
        return publish, status

    async def cleanup(self) -> None:
        await self.app.close()
        conn = await aio_pika.connect(AMQP_URL)
        try:
            channel = await conn.channel()
            for spec in self.app.handlers.values():
                for name, _ in queue_declarations(spec.queue_spec()):
                    await channel.queue_delete(name)
                for exchange in delay_exchanges(spec.queue_spec()):
                    await channel.exchange_delete(exchange)
        finally:
            await conn.close()
        await forget_task_index(REDIS_URL, self.queue)
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            ids = self.ids + self.published
            for first in range(0, len(ids), 1000):
                chunk = ids[first : first + 1000]
                await client.delete(
                    *[state_key(self.queue, t) for t in chunk], *[latest_key(t) for t in chunk]
                )
        finally:
            await client.aclose()


async def main(args: argparse.Namespace) -> int:
    bench = Bench(args.waiters, args.n)
    probe = aioredis.Redis.from_url(REDIS_URL, socket_timeout=30)
    rows: list[tuple[str, str]] = []
    waiting: list[asyncio.Future[TaskState]] = []
    try:
        await bench.app.declare()
        await bench.latencies()  # warm: connections, scripts
        idle_publish, idle_status = await bench.latencies()
        idle_connections = await bench.connections(probe)
        gc.collect()
        rss_before, blocks_before = rss_kib(), sys.getallocatedblocks()
        started = time.perf_counter()
        waiting = [
            asyncio.ensure_future(bench.app.result(t, queue=bench.queue, timeout_s=3600))
            for t in bench.ids
        ]
        store = bench.app.results
        assert store is not None
        step = max(1, bench.waiters // 20)
        sample = [done_channel(t) for t in bench.ids[::step]] + [done_channel(bench.ids[-1])]
        # Subscribed: Redis counts a subscriber on every sampled waiter's channel.
        while True:
            if any(w.done() for w in waiting):
                failed = next(w for w in waiting if w.done())
                raise SystemExit(f"a waiter ended early: {failed.exception()!r}")
            numsub = await probe.execute_command("PUBSUB", "NUMSUB", *sample)
            if all(int(n) >= 1 for n in numsub[1::2]):
                break
            await asyncio.sleep(0.05)
        subscribe_s = time.perf_counter() - started
        gc.collect()
        rss_after, blocks_after = rss_kib(), sys.getallocatedblocks()
        busy_connections = await bench.connections(probe)
        busy_publish, busy_status = await bench.latencies()
        started = time.perf_counter()
        await store.record_many(
            [
                TaskState(task_id=t, queue=bench.queue, status=TaskStatus.SUCCEEDED)
                for t in bench.ids
            ]
        )
        states = await asyncio.gather(*waiting)
        woken_s = time.perf_counter() - started
        assert all(s.status is TaskStatus.SUCCEEDED for s in states)
        per_waiter = (rss_after - rss_before) * 1024 / bench.waiters
        rows += [
            ("Redis connections, no waiter", f"{idle_connections}"),
            (f"Redis connections, {bench.waiters:,} waiting", f"{busy_connections}"),
            (f"time until {bench.waiters:,} are subscribed", f"{subscribe_s:.2f} s"),
            ("RSS per waiter", f"{per_waiter / 1024:.2f} KiB"),
            (
                "Python heap blocks per waiter",
                f"{(blocks_after - blocks_before) / bench.waiters:.0f}",
            ),
        ]
        for label, idle, busy in (
            ("publish (results on)", idle_publish, busy_publish),
            ("status()", idle_status, busy_status),
        ):
            for q, name in ((0.5, "p50"), (0.95, "p95")):
                rows.append(
                    (
                        f"{label} {name}, no waiter / {bench.waiters:,} waiting",
                        f"{pct(idle, q):.2f} / {pct(busy, q):.2f} ms",
                    )
                )
        rows.append((f"all {bench.waiters:,} woken by their finals", f"{woken_s:.2f} s"))
    finally:
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await probe.aclose()
        await bench.cleanup()
    print(
        f"waiters benchmark: {bench.waiters:,} result() waiters in one process, {bench.n} "
        f"publishes and status() reads each way, "
        f"pool {bench.app.settings.redis_max_connections}"
    )
    print("| measure | value |")
    print("|---|---|")
    for label, value in rows:
        print(f"| {label} | {value} |")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.waiters", description=__doc__)
    parser.add_argument("--waiters", type=int, default=10_000)
    parser.add_argument("--n", type=int, default=300, help="publishes and reads each way")
    parser.add_argument("--smoke", action="store_true", help="tiny counts")
    args = parser.parse_args(argv)
    if args.smoke:
        args.waiters, args.n = 500, 20
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))

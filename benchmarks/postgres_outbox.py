"""The PostgreSQL outbox: what it adds to the application's transaction, how soon a committed
task is confirmed by the broker (LISTEN/NOTIFY), and how fast 1 and 3 relays drain the table.

    make bench-postgres-outbox          # or: .venv/bin/python -m benchmarks.postgres_outbox
    .venv/bin/python -m benchmarks.postgres_outbox --smoke

Measured, on a schema of the run's own (dropped at the end) and a queue of its own:

- ``transaction``: a psycopg transaction that inserts one order row, alone and with
  ``app.add_to_outbox`` in it (one more INSERT); medians over ``--commits`` commits each, and
  the difference: the outbox's cost to the user's transaction.
- ``commit -> confirm``: ``--commits`` tasks committed one at a time (each after the last was
  confirmed) with a relay running whose poll interval is an hour, so only NOTIFY wakes it; from
  the COMMIT's return to the relay holding the broker's confirm (the moment it deletes the
  row). p50 and p99. Target: p99 < 50 ms.
- ``relay drain``: ``--n`` rows committed at once, then 1 or 3 relays (in this process) drain
  them; tasks per second from the relays' start to an empty table. Each relay counts what it
  sent; their sum and the queue's depth must both equal ``--n`` (no row published twice).

Broker: ``WECLAW_MQ_AMQP_URL``; PostgreSQL: ``WECLAW_TEST_POSTGRES_URL`` (default
postgresql://postgres@127.0.0.1:5432/postgres). Results (the task store) are off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from urllib.parse import quote

import aio_pika
import psycopg

from weclaw_mq import App, Settings
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.outbox.postgres import PostgresOutbox, migrate, run_relay
from weclaw_mq.outbox.relay import Relay
from weclaw_mq.wire.topology import queue_declarations

from .common import make_payload, percentile
from .infra import bench_queue_name

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
SERVER_URL = os.environ.get(
    "WECLAW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
TARGET_P99_MS = 50.0


class TimedOutbox(PostgresOutbox):
    """Records when each row's delete (right after its confirm) was issued."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.task_of: dict[int, str] = {}
        self.confirmed_at: dict[str, float] = {}
        self.confirmed = asyncio.Event()

    async def claim(self, limit: int, lease_s: float):  # type: ignore[no-untyped-def]
        rows = await super().claim(limit, lease_s)
        self.task_of.update({r.seq: r.task_id for r in rows})
        return rows

    async def delete(self, seqs):  # type: ignore[no-untyped-def]
        now = time.perf_counter()
        for seq in seqs:
            self.confirmed_at[self.task_of[seq]] = now
        self.confirmed.set()
        await super().delete(seqs)


def _app(queue: str, **settings: object) -> App:
    app = App(
        "bench-pg-outbox",
        settings=Settings(amqp_url=AMQP_URL, results_enabled=False, **settings),  # type: ignore[arg-type]
    )

    @app.handler(queue)
    async def work(task: dict[str, object]) -> None:  # declared only, never consumed
        return None

    return app


def transaction_ms(url: str, app: App, queue: str, commits: int) -> tuple[float, float]:
    """Median ms of a one-order transaction without and with the outbox row."""
    plain: list[float] = []
    with_outbox: list[float] = []
    with psycopg.connect(url) as conn:
        for i in range(commits):
            for timed, add in ((plain, False), (with_outbox, True)):
                started = time.perf_counter()
                with conn.transaction():
                    conn.execute("INSERT INTO orders (item) VALUES (%s)", (f"item {i}",))
                    if add:
                        app.add_to_outbox(conn, queue, make_payload(i))
                timed.append((time.perf_counter() - started) * 1000)
        conn.execute("DELETE FROM weclaw_outbox")
        conn.commit()
    return statistics.median(plain), statistics.median(with_outbox)


async def commit_to_confirm_ms(url: str, app: App, queue: str, commits: int) -> list[float]:
    outbox = TimedOutbox(url)
    relay = Relay(outbox, app.settings, Metrics())
    stop = asyncio.Event()
    running = asyncio.create_task(run_relay(relay, url, stop))
    latencies: list[float] = []
    try:
        await asyncio.sleep(0.5)  # the LISTEN is in place
        conn = await psycopg.AsyncConnection.connect(url)
        try:
            for i in range(commits):
                async with conn.transaction():
                    task_id = await app.add_to_outbox(conn, queue, make_payload(i))
                committed = time.perf_counter()
                while task_id not in outbox.confirmed_at:
                    await outbox.confirmed.wait()
                    outbox.confirmed.clear()
                latencies.append((outbox.confirmed_at[task_id] - committed) * 1000)
        finally:
            await conn.close()
    finally:
        stop.set()
        await running
        await outbox.close()
    return latencies


async def drain_rate(url: str, app: App, queue: str, n: int, relays: int) -> float:
    with psycopg.connect(url) as conn, conn.transaction():
        for i in range(n):
            app.add_to_outbox(conn, queue, make_payload(i))
    outboxes = [await PostgresOutbox.open(url) for _ in range(relays)]
    workers = [Relay(o, app.settings, Metrics()) for o in outboxes]
    started = time.perf_counter()
    sent = await asyncio.gather(*(w.drain() for w in workers))
    elapsed = time.perf_counter() - started
    for w, o in zip(workers, outboxes, strict=True):
        await w.close()
        await o.close()
    depth = await _depth_and_purge(queue)
    assert sum(sent) == n == depth, f"relays sent {sent}, queue holds {depth}, of {n}"
    return n / elapsed


async def _depth_and_purge(queue: str) -> int:
    conn = await aio_pika.connect(AMQP_URL)
    try:
        channel = await conn.channel()
        q = await channel.declare_queue(queue, passive=True)
        depth = q.declaration_result.message_count or 0
        await q.purge()
        return depth
    finally:
        await conn.close()


async def main(args: argparse.Namespace) -> int:
    # Named like its queue (the run's tag, when a test runs it): found by what it belongs to.
    schema = bench_queue_name("outbox").replace("-", "_").lower()
    sep = "&" if "?" in SERVER_URL else "?"
    url = f"{SERVER_URL}{sep}options={quote(f'-csearch_path={schema}')}"
    queue = bench_queue_name("pg-outbox")
    # The poll interval is an hour: a relay that finds the committed task was woken by NOTIFY.
    app = _app(queue, outbox_relay_interval_s=3600.0)
    with psycopg.connect(SERVER_URL, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        await app.declare()
        await migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, item text NOT NULL)")
        plain, with_row = await asyncio.to_thread(transaction_ms, url, app, queue, args.commits)
        latencies = await commit_to_confirm_ms(url, app, queue, args.commits)
        await _depth_and_purge(queue)
        rates = {
            k: [await drain_rate(url, app, queue, args.n, k) for _ in range(args.rounds)]
            for k in (1, 3)
        }
    finally:
        await app.close()
        with psycopg.connect(SERVER_URL, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn = await aio_pika.connect(AMQP_URL)
        try:
            channel = await conn.channel()
            for spec in app.handlers.values():
                for name, _ in queue_declarations(spec.queue_spec()):
                    await channel.queue_delete(name)
        finally:
            await conn.close()
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(
        f"PostgreSQL outbox benchmark: {args.commits} commits, drains of {args.n} rows x "
        f"{args.rounds} rounds, window {app.settings.outbox_relay_window}"
    )
    print("| measure | value |")
    print("|---|---|")
    print(f"| transaction with one order INSERT (median) | {plain:.2f} ms |")
    print(f"| ... plus add_to_outbox (median) | {with_row:.2f} ms (+{with_row - plain:.2f} ms) |")
    print(f"| commit -> confirm, LISTEN/NOTIFY (p50 / p99) | {p50:.1f} ms / {p99:.1f} ms |")
    for k, v in rates.items():
        print(
            f"| relay drain, {k} relay{'s' if k > 1 else ''} (median, min-max) | "
            f"{statistics.median(v):,.0f} tasks/s ({min(v):,.0f}-{max(v):,.0f}); each row once |"
        )
    verdict = "met" if p99 < TARGET_P99_MS else "MISSED"
    print(f"commit -> confirm p99 {p99:.1f} ms; target < {TARGET_P99_MS:.0f} ms: {verdict}")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.postgres_outbox", description=__doc__
    )
    parser.add_argument("--commits", type=int, default=300, help="timed single commits")
    parser.add_argument("--n", type=int, default=3000, help="rows per drain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny counts, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.commits, args.n, args.rounds = 20, 100, 1
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))

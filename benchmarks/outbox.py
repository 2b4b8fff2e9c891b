"""The local outbox: publishing into it with the broker down, and the relay's drain rate,
beside a confirmed ``publish`` and ``publish_many`` to the same broker, in one run.

    make bench-outbox                        # or: .venv/bin/python -m benchmarks.outbox
    .venv/bin/python -m benchmarks.outbox --n 3000 --rounds 3
    .venv/bin/python -m benchmarks.outbox --smoke

Cases (each round runs every case once, in a rotated order; figures are medians over the
rounds, with min-max; ratios are paired per round):

- ``publish``: ``App.publish`` one at a time, each awaiting its confirm (``--n-single``).
- ``publish_many``: one ``App.publish_many`` call of ``--n`` tasks (pipelined confirms).
- ``outbox publish (broker down)``: ``App.publish`` one at a time against a closed port: a
  refused connect, then one SQLite commit (WAL, synchronous=FULL) per task.
- ``outbox publish_many (broker down)``: one ``publish_many`` of ``--n`` tasks against the
  closed port: one transaction for the batch.
- ``relay drain``: ``--n`` rows in the outbox, drained by ``Relay.drain()`` to the broker
  (windows of ``outbox_relay_window`` rows, confirms awaited per window, one delete
  transaction per window).

Target: the relay drains at least 0.8x the rate of ``publish_many`` (paired median ratio).
Broker: ``WECLAW_MQ_AMQP_URL`` (default 127.0.0.1:5672), one quorum queue of the run's own,
deleted at the end. Results (the task store) are off in every case: Redis is not measured.
The payload is ``benchmarks.common.make_payload`` (1 KiB of JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aio_pika

from weclaw_mq import App, Settings
from weclaw_mq.outbox.relay import Relay
from weclaw_mq.wire.topology import queue_declarations

from .common import make_payload
from .infra import bench_queue_name

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TARGET = 0.8
CASES = (
    "publish",
    "publish_many",
    "outbox publish (broker down)",
    "outbox publish_many (broker down)",
    "relay drain",
)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class Bench:
    def __init__(self, n: int, n_single: int, folder: Path) -> None:
        self.n = n
        self.n_single = n_single
        self.queue = bench_queue_name("outbox")
        self.path = folder / "outbox.db"
        common = {
            "results_enabled": False,
            "outbox_path": str(self.path),
            "outbox_relay_in_app": False,
            "outbox_max_rows": 10 * n + 1000,
            "outbox_max_bytes": 10 * (n + 1000) * 2048,
        }
        self.up = self._app(Settings(amqp_url=AMQP_URL, **common))
        self.direct = self._app(Settings(amqp_url=AMQP_URL, results_enabled=False))
        dead = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
        self.down = self._app(Settings(amqp_url=dead, **common))
        self.payloads = [make_payload(i) for i in range(n)]

    def _app(self, settings: Settings) -> App:
        app = App("bench-outbox", settings=settings)

        @app.handler(self.queue)
        async def work(task: dict[str, object]) -> None:  # declared only, never consumed
            return None

        return app

    async def purge(self) -> None:
        conn = await aio_pika.connect(AMQP_URL)
        try:
            channel = await conn.channel()
            queue = await channel.declare_queue(self.queue, passive=True)
            await queue.purge()
        finally:
            await conn.close()

    async def delete_queues(self) -> None:
        """The queue and its delay and dead-letter queues (what ``declare`` made)."""
        conn = await aio_pika.connect(AMQP_URL)
        try:
            channel = await conn.channel()
            for spec in self.up.handlers.values():
                for name, _ in queue_declarations(spec.queue_spec()):
                    await channel.queue_delete(name)
        finally:
            await conn.close()

    async def case(self, name: str) -> float:
        """One run of case ``name``; tasks per second."""
        runs: dict[str, Callable[[], Awaitable[int]]] = {
            "publish": self.publish,
            "publish_many": self.publish_many,
            "outbox publish (broker down)": self.outbox_publish,
            "outbox publish_many (broker down)": self.outbox_publish_many,
        }
        if name == "relay drain":
            return await self.relay_drain()
        await self.purge()
        outbox = await self.up.start_outbox()
        assert (await outbox.stats()).rows == 0, "the outbox is not empty before a case"
        started = time.perf_counter()
        count = await runs[name]()
        elapsed = time.perf_counter() - started
        await self._drain_quietly()
        return count / elapsed

    async def publish(self) -> int:
        for p in self.payloads[: self.n_single]:
            await self.direct.publish(self.queue, p)
        return self.n_single

    async def publish_many(self) -> int:
        return len(await self.direct.publish_many(self.queue, self.payloads))

    async def outbox_publish(self) -> int:
        for p in self.payloads[: self.n_single]:
            await self.down.publish(self.queue, p)
        return self.n_single

    async def outbox_publish_many(self) -> int:
        return len(await self.down.publish_many(self.queue, self.payloads))

    async def relay_drain(self) -> float:
        """Tasks per second of one drain of ``n`` rows; the fill before it is not timed."""
        await self.purge()
        await self.down.publish_many(self.queue, self.payloads)
        outbox = await self.up.start_outbox()
        relay = Relay(outbox, self.up.settings, self.up.metrics)
        try:
            started = time.perf_counter()
            sent = await relay.drain()
            elapsed = time.perf_counter() - started
        finally:
            await relay.close()
        assert sent == self.n, f"the relay sent {sent} of {self.n}"
        return sent / elapsed

    async def _drain_quietly(self) -> None:
        """Empty the outbox after a case that filled it (untimed)."""
        outbox = await self.up.start_outbox()
        if (await outbox.stats()).rows:
            relay = Relay(outbox, self.up.settings, self.up.metrics)
            try:
                await relay.drain()
            finally:
                await relay.close()

    async def close(self) -> None:
        for app in (self.up, self.direct, self.down):
            await app.close()


async def main(args: argparse.Namespace) -> int:
    # Every case with the broker down logs a warning (and aiormq an error) per publish.
    for name in ("weclaw_mq", "aiormq", "aio_pika"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="bench-outbox-") as folder:
        bench = Bench(args.n, args.n_single, Path(folder))
        rates: dict[str, list[float]] = {c: [] for c in CASES}
        try:
            await bench.up.declare()
            for r in range(args.rounds):
                order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]
                for name in order:
                    rates[name].append(await bench.case(name))
        finally:
            await bench.close()
            await bench.delete_queues()
    ratios = [d / m for d, m in zip(rates["relay drain"], rates["publish_many"], strict=True)]
    print(
        f"outbox benchmark: n={args.n} (publish one at a time: {args.n_single}), "
        f"{args.rounds} rounds, window {Settings().outbox_relay_window}, broker {redact(AMQP_URL)}"
    )
    print("| case | tasks/s (median) | min-max |")
    print("|---|---|---|")
    for name in CASES:
        values = rates[name]
        print(
            f"| {name} | {statistics.median(values):,.0f} | {min(values):,.0f}-{max(values):,.0f} |"
        )
    median = statistics.median(ratios)
    held = sum(r >= TARGET for r in ratios)
    verdict = "met" if median >= TARGET else "MISSED"
    print(
        f"relay drain / publish_many: {median:.2f}x (min-max {min(ratios):.2f}-{max(ratios):.2f}); "
        f"target >= {TARGET}x: {verdict} (held in {held} of {len(ratios)} rounds)"
    )
    return 0


def redact(url: str) -> str:
    head, at, tail = url.rpartition("@")
    return f"{head.rsplit(':', 1)[0]}:***@{tail}" if at else url


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.outbox", description=__doc__)
    parser.add_argument("--n", type=int, default=3000, help="tasks per batch case and drain")
    parser.add_argument("--n-single", type=int, default=300, help="tasks for one-at-a-time cases")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny counts, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.n_single, args.rounds = 200, 20, 1
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))

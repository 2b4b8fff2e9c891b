"""FastStream 0.7 (``RabbitBroker``) on the same quorum queue, tuned as fairly as it allows.

Tuning (each a documented option): prefetch = concurrency through ``Channel(prefetch_count=N)``
(its default is unbounded), ``logger=None`` (its default logs two lines per message), and
``AckPolicy.REJECT_ON_ERROR``: ack after the handler returned. aiormq runs each delivery in
its own task, so up to ``prefetch`` handlers run at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from faststream import AckPolicy
from faststream.rabbit import Channel, QueueType, RabbitBroker, RabbitQueue

from ..common import ChildConfig, Tracker, emit, expect, stdin_lines
from .aio_hooks import track


async def consume(cfg: ChildConfig) -> None:
    reader = await stdin_lines()
    done = asyncio.Event()
    tracker = Tracker(cfg.count, done.set)
    track(tracker)
    sleep_s = cfg.sleep_s
    # The same arguments the orchestrator declared the queue with, so FastStream's own
    # declaration is an equivalent re-declare, not a conflict.
    arguments = {k: v for k, v in cfg.extra["queue_arguments"].items() if k != "x-queue-type"}
    broker = RabbitBroker(cfg.amqp_url, logger=None)
    # cast: its TypedDict of quorum arguments has no key for dead-lettering strategy etc.
    queue = RabbitQueue(cfg.queue, queue_type=QueueType.QUORUM, arguments=cast(Any, arguments))

    @broker.subscriber(
        queue,
        channel=Channel(prefetch_count=cfg.concurrency),
        ack_policy=AckPolicy.REJECT_ON_ERROR,
    )
    async def handle(task: dict[str, Any]) -> None:
        if sleep_s:
            await asyncio.sleep(sleep_s)

    await broker.connect()
    emit("ready")
    await expect(reader, "go")
    await broker.start()
    await done.wait()
    emit("done", **tracker.result())
    await expect(reader, "stop")
    await broker.stop()


def main() -> None:
    asyncio.run(consume(ChildConfig.from_argv()))


if __name__ == "__main__":
    main()

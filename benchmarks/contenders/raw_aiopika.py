"""The baseline: plain aio-pika written the way weclaw_mq's worker works.

consume: prefetch = concurrency, one task per delivery, ``json.loads`` of the body, the
handler, then a manual ack. With ``guard`` it makes by hand the Redis round trips weclaw_mq
makes per message (see ``REDIS_ROUND_TRIPS``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from ..common import (
    ChildConfig,
    Tracker,
    emit,
    encode,
    expect,
    latency_summary,
    make_payload,
    now_ns,
    stdin_lines,
)
from .aio_hooks import track

# weclaw_mq's process.py on a successful, guarded delivery: the claim (SET NX PX) with the
# "running" record, then the result with the done marker: two round trips, one script each
# there, a pipeline of two SETs each here.
REDIS_ROUND_TRIPS = 2
LEASE_MS = 30_000
TTL_MS = 24 * 3600 * 1000


def message(body: bytes, task_id: str) -> aio_pika.Message:
    """The same properties weclaw_mq puts on a task, so both send the same bytes."""
    return aio_pika.Message(
        body,
        message_id=task_id,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=datetime.now(UTC),
        headers={"x-weclaw-trace-id": uuid.uuid4().hex, "x-weclaw-attempt": 1},
    )


async def consume(cfg: ChildConfig, *, e2e: bool = False) -> None:
    reader = await stdin_lines()
    done = asyncio.Event()
    tracker = Tracker(cfg.count, done.set)
    track(tracker)
    redis: Any = None
    if cfg.guard:
        import redis.asyncio as aioredis  # only this variant pays for the import

        redis = aioredis.Redis.from_url(cfg.redis_url, socket_connect_timeout=5, socket_timeout=5)
        await redis.ping()
    latencies_ms: list[float] = []
    conn = await aio_pika.connect(cfg.amqp_url)
    channel = await conn.channel(publisher_confirms=False)
    await channel.set_qos(prefetch_count=cfg.concurrency)
    queue = await channel.get_queue(cfg.queue, ensure=False)
    in_flight: set[asyncio.Task[None]] = set()
    sleep_s = cfg.sleep_s

    async def handle(msg: AbstractIncomingMessage) -> None:
        task = json.loads(msg.body)
        if e2e and task["seq"] >= 0:  # seq -1: warm-up messages
            latencies_ms.append((now_ns() - task["sent_ns"]) / 1e6)
        if redis is None:
            if sleep_s:
                await asyncio.sleep(sleep_s)
            await msg.ack()
            return
        key = f"{cfg.queue}:{msg.message_id}"
        owner = uuid.uuid4().hex
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{key}:claim", owner, nx=True, px=LEASE_MS)
            pipe.set(f"{key}:state", "running", px=TTL_MS)
            claimed, _ = await pipe.execute()
        if not claimed:
            await msg.ack()  # a duplicate: never happens here, but keeps the shape honest
            return
        if sleep_s:
            await asyncio.sleep(sleep_s)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{key}:state", json.dumps({"status": "succeeded"}), px=TTL_MS)
            pipe.set(f"{key}:claim", "done", px=TTL_MS)
            await pipe.execute()
        await msg.ack()

    async def on_message(msg: AbstractIncomingMessage) -> None:
        task = asyncio.create_task(handle(msg))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    emit("ready", redis_round_trips=REDIS_ROUND_TRIPS if redis is not None else 0)
    await expect(reader, "go")
    tag = await queue.consume(on_message)
    emit("consuming")
    await done.wait()
    result = tracker.result()
    if e2e:
        result.update(latency_summary(latencies_ms))
    emit("done", **result)
    await expect(reader, "stop")
    await queue.cancel(tag)
    await conn.close()
    if redis is not None:
        await redis.aclose()


async def publish(cfg: ChildConfig) -> None:
    """One-at-a-time confirmed publishes (mandatory), or batches gathered on one channel."""
    reader = await stdin_lines()
    conn = await aio_pika.connect(cfg.amqp_url)
    channel = await conn.channel(publisher_confirms=True, on_return_raises=True)
    exchange = channel.default_exchange
    prefix = cfg.extra["task_prefix"]
    payloads = [make_payload(seq) for seq in range(cfg.count)]
    # One publish before the clock starts, as weclaw.py does: the channel is warm.
    warmup = message(encode(make_payload(-1)), f"{prefix}-warmup")
    await exchange.publish(warmup, routing_key=cfg.queue, mandatory=True)
    emit("ready")
    await expect(reader, "go")
    latencies_ms: list[float] = []
    started = now_ns()
    if cfg.mode == "publish":
        for seq in range(cfg.count):
            t0 = now_ns()
            body = encode(payloads[seq])
            await exchange.publish(
                message(body, f"{prefix}-{seq}"), routing_key=cfg.queue, mandatory=True
            )
            latencies_ms.append((now_ns() - t0) / 1e6)
    else:
        for first in range(0, cfg.count, cfg.batch):
            t0 = now_ns()
            seqs = range(first, min(first + cfg.batch, cfg.count))
            messages = [message(encode(payloads[s]), f"{prefix}-{s}") for s in seqs]
            await asyncio.gather(
                *(exchange.publish(m, routing_key=cfg.queue, mandatory=True) for m in messages)
            )
            latencies_ms.append((now_ns() - t0) / 1e6)
    elapsed_s = (now_ns() - started) / 1e9
    emit(
        "done",
        count=cfg.count,
        elapsed_s=elapsed_s,
        rate=cfg.count / elapsed_s,
        **latency_summary(latencies_ms),
    )
    await expect(reader, "stop")
    await conn.close()


def main() -> None:
    cfg = ChildConfig.from_argv()
    if cfg.mode in ("publish", "publish_many"):
        asyncio.run(publish(cfg))
    else:
        asyncio.run(consume(cfg, e2e=cfg.mode == "e2e"))


if __name__ == "__main__":
    main()

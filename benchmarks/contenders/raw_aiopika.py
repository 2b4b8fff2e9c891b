"""The baseline: plain aio-pika written the way weclaw_mq's worker works.

consume: prefetch = concurrency, one task per delivery, ``json.loads`` of the body, the
handler, then a manual ack. With ``guard`` it makes by hand the Redis calls weclaw_mq makes
per message: the same two Lua scripts (imported from weclaw_mq), registered with redis-py's
``register_script`` as weclaw_mq registers them, with the same KEYS and ARGV (keys built by
``weclaw_mq.contract.naming``), so the two differ only by the framework around those calls.
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

# weclaw_mq/worker/delivery.py on a successful, guarded delivery: the claim script (SET NX PX and
# the "running" record), then the finish script (the result record and the done marker): two
# EVALSHA round trips, here as there. Lease and TTLs are weclaw_mq's defaults.
REDIS_ROUND_TRIPS = 2
LEASE_MS = 30_000
TTL_MS = 24 * 3600 * 1000
DONE = "done"


def state_scripts() -> tuple[str, str]:
    """weclaw_mq's own claim and finish scripts (``weclaw_mq.state.redis``), byte for byte."""
    from weclaw_mq.state.redis import CLAIM_SCRIPT, FINISH_SCRIPT

    return CLAIM_SCRIPT, FINISH_SCRIPT


def task_state(queue: str, task_id: str, status: str) -> str:
    """A task record as weclaw_mq stores it (its TaskState fields), as JSON, by hand."""
    return json.dumps(
        {
            "task_id": task_id,
            "queue": queue,
            "status": status,
            "attempt": 1,
            "result": None,
            "error": None,
            "reason": None,
            "updated_at": datetime.now(UTC).isoformat(),
        },
        separators=(",", ":"),
    )


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


async def check_stored(redis: Any, queue: str, task_id: str) -> None:
    """After the timed window: the scripts stored what weclaw_mq's store (a succeeded record,
    the done marker), so KEYS/ARGV that no longer match weclaw_mq's cannot go unnoticed."""
    from weclaw_mq.contract.naming import guard_key, state_key

    status = await redis.hget(state_key(queue, task_id), "status")
    marker = await redis.get(guard_key(queue, task_id))
    if status != b"succeeded" or marker != DONE.encode():
        raise SystemExit(
            f"raw+Redis: task {task_id!r} has record status {status!r} and guard key "
            f"{marker!r}, not 'succeeded' and {DONE!r}: the KEYS/ARGV given to weclaw_mq's "
            "scripts no longer match what weclaw_mq passes"
        )


async def consume(cfg: ChildConfig, *, e2e: bool = False) -> None:
    reader = await stdin_lines()
    done = asyncio.Event()
    tracker = Tracker(cfg.count, done.set)
    track(tracker)
    redis: Any = None
    claim: Any = None
    finish: Any = None
    if cfg.guard:
        # Only this variant pays for these imports.
        import redis.asyncio as aioredis

        from weclaw_mq.contract.naming import (
            cancel_key,
            done_channel,
            guard_key,
            latest_key,
            state_key,
        )

        redis = aioredis.Redis.from_url(cfg.redis_url, socket_connect_timeout=5, socket_timeout=5)
        await redis.ping()
        claim_lua, finish_lua = state_scripts()
        claim = redis.register_script(claim_lua)
        finish = redis.register_script(finish_lua)
    latencies_ms: list[float] = []
    conn = await aio_pika.connect(cfg.amqp_url)
    channel = await conn.channel(publisher_confirms=False)
    await channel.set_qos(prefetch_count=cfg.concurrency)
    queue = await channel.get_queue(cfg.queue, ensure=False)
    in_flight: set[asyncio.Task[None]] = set()
    sleep_s = cfg.sleep_s
    last_task_id = ""

    async def handle(msg: AbstractIncomingMessage) -> None:
        task = json.loads(msg.body)
        if e2e and task["seq"] >= 0:  # seq -1: warm-up messages
            latencies_ms.append((now_ns() - task["sent_ns"]) / 1e6)
        if redis is None:
            if sleep_s:
                await asyncio.sleep(sleep_s)
            await msg.ack()
            return
        nonlocal last_task_id
        q, task_id = cfg.queue, msg.message_id or ""
        last_task_id = task_id
        guard, state, latest = guard_key(q, task_id), state_key(q, task_id), latest_key(task_id)
        # KEYS: guard, cancel marker, record, latest; ARGV: owner, lease ms, done value, queue,
        # status, record, ttl.
        owner = f"running:{uuid.uuid4().hex}"
        running = task_state(q, task_id, "running")
        answer = await claim(
            keys=[guard, cancel_key(task_id), state, latest],
            args=[owner, LEASE_MS, DONE, q, "running", running, TTL_MS],
        )
        if answer != b"acquired":
            await msg.ack()  # a duplicate: never happens here, but keeps the shape honest
            return
        if sleep_s:
            await asyncio.sleep(sleep_s)
        # KEYS: guard, record, latest; ARGV: done value, done ttl, status, record, ttl,
        # channel, queue.
        succeeded = task_state(q, task_id, "succeeded")
        await finish(
            keys=[guard, state, latest],
            args=[DONE, TTL_MS, "succeeded", succeeded, TTL_MS, done_channel(task_id), q],
        )
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
    if redis is not None:
        await check_stored(redis, cfg.queue, last_task_id)
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

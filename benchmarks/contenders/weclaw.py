"""weclaw_mq as a user runs it: an ``App`` with one handler, a ``Worker(app, concurrency=N)``.

Its default per-message pipeline (trace context, metrics) is always on. ``guard`` turns the
Redis idempotency guard and the result store on (settings ``results_enabled`` and
``handler(idempotent=...)``); off, no Redis call is made.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, SecretStr

import weclaw_mq.worker.incoming  # noqa: F401  # imported before track(): its messages count
from weclaw_mq import App, Settings, Worker
from weclaw_mq.worker import event_loop

from ..common import (
    ChildConfig,
    Tracker,
    WindowProfile,
    emit,
    expect,
    latency_summary,
    make_payload,
    now_ns,
    stdin_lines,
)
from .aio_hooks import track

# weclaw_mq/worker/delivery.py on a successful guarded delivery: the claim script (SET NX PX
# + the "running" record), then the result script (record + done marker): two EVALSHA.
REDIS_ROUND_TRIPS = 2


class BenchTask(BaseModel):
    """The benchmark payload (``common.make_payload``) as a handler's model."""

    seq: int
    sent_ns: int
    pad: str


def build_app(cfg: ChildConfig) -> App:
    settings = Settings(
        amqp_url=SecretStr(cfg.amqp_url),
        redis_url=SecretStr(cfg.redis_url),
        results_enabled=cfg.guard,
        concurrency=cfg.concurrency,
        # Steady state: the start's broker-load check (an Erlang CLI, about a second of CPU)
        # would land inside the measured window; make bench-start times starts with it on.
        broker_load_check=False,
        _env_file=None,  # type: ignore[call-arg]  # a stray .env must not change the run
    )
    return App("bench", settings=settings)


async def consume(cfg: ChildConfig, *, e2e: bool = False) -> None:
    reader = await stdin_lines()
    done = asyncio.Event()
    tracker = Tracker(cfg.count, done.set)
    track(tracker)
    latencies_ms: list[float] = []
    sleep_s = cfg.sleep_s
    profile = WindowProfile()
    app = build_app(cfg)

    @app.handler(cfg.queue, idempotent=cfg.guard)
    async def handle(task: dict[str, Any]) -> None:
        if e2e and task["seq"] >= 0:  # seq -1: warm-up messages
            latencies_ms.append((now_ns() - task["sent_ns"]) / 1e6)
        if sleep_s:
            await asyncio.sleep(sleep_s)

    worker = Worker(app, concurrency=cfg.concurrency)
    if cfg.guard:
        assert app.store is not None
        await app.store.get("warm-up")  # connect now, not inside the timed window
    emit("ready", redis_round_trips=REDIS_ROUND_TRIPS if cfg.guard else 0)
    await expect(reader, "go")
    profile.start()
    running = asyncio.create_task(worker.run())
    if e2e:  # the publisher starts only once the worker consumes
        await worker.ready.wait()
        emit("consuming")
    await done.wait()
    profile.stop()
    result = tracker.result()
    if e2e:
        result.update(latency_summary(latencies_ms))
    result.update(redis_batching(app))
    emit("done", **result)
    await expect(reader, "stop")
    worker.stop()
    await running
    await app.close()


def redis_batching(app: App) -> dict[str, float]:
    """Commands per Redis round trip of the store's auto-pipeline (state.pipelining)."""
    # Read off the store, not imported: importing it would load redis-py into a guard-off run.
    pipe: Any = getattr(app._store, "_pipe", None)
    if not getattr(pipe, "round_trips", 0):
        return {}
    return {"redis_per_round_trip": pipe.sent_commands / pipe.round_trips}


async def publish(cfg: ChildConfig) -> None:
    """``App.publish`` one at a time, or ``App.publish_many`` in batches of ``cfg.batch``."""
    reader = await stdin_lines()
    app = build_app(cfg)

    # A producer that knows the queue's handler validates each payload against its model
    # before sending (App.prepare): registered here, so the publish cases measure that too.
    # The payloads are dicts, as a caller's JSON would be: a BenchTask instance would skip
    # the check (it was validated when it was built).
    @app.handler(cfg.queue)
    async def handle(task: BenchTask) -> None:
        return None

    assert app.handlers[cfg.queue].model is BenchTask
    prefix = cfg.extra["task_prefix"]
    payloads = [make_payload(seq) for seq in range(cfg.count)]
    # Both contenders publish one message before the clock starts: connections (broker, and
    # Redis with results on) are open, as in a long-running producer.
    await app.publish(cfg.queue, make_payload(-1), task_id=f"{prefix}-warmup")
    emit("ready")
    await expect(reader, "go")
    latencies_ms: list[float] = []
    profile = WindowProfile()
    profile.start()
    started = now_ns()
    if cfg.mode == "publish":
        for seq in range(cfg.count):
            t0 = now_ns()
            await app.publish(cfg.queue, payloads[seq], task_id=f"{prefix}-{seq}")
            latencies_ms.append((now_ns() - t0) / 1e6)
    else:
        for first in range(0, cfg.count, cfg.batch):
            t0 = now_ns()
            seqs = range(first, min(first + cfg.batch, cfg.count))
            await app.publish_many(
                cfg.queue, [payloads[s] for s in seqs], task_ids=[f"{prefix}-{s}" for s in seqs]
            )
            latencies_ms.append((now_ns() - t0) / 1e6)
    elapsed_s = (now_ns() - started) / 1e9
    profile.stop()
    emit(
        "done",
        count=cfg.count,
        elapsed_s=elapsed_s,
        rate=cfg.count / elapsed_s,
        **latency_summary(latencies_ms),
    )
    await expect(reader, "stop")
    await app.close()


def main() -> None:
    cfg = ChildConfig.from_argv()
    loop = "uvloop" if cfg.extra.get("loop") == "uvloop" else "asyncio"
    if cfg.mode in ("publish", "publish_many"):
        event_loop.run(publish(cfg), loop)
    else:
        event_loop.run(consume(cfg, e2e=cfg.mode == "e2e"), loop)


if __name__ == "__main__":
    main()

"""weclaw_mq's own CPU per delivery, measured in isolation (no broker, no Redis).

    make bench-own-cost                      # or: .venv/bin/python -m benchmarks.own_cost
    .venv/bin/python -m benchmarks.own_cost --n 20000 --rounds 5

It drives ``weclaw_mq.worker.delivery.process()`` (one delivery, start to end: read the delivery,
trace context, decode and validate the body, the handler under its deadline, the handler
timing and outcome metrics, the ack through the Settler) with a stand-in for aio-pika's
IncomingMessage whose ``ack`` only counts. Guard and results are off: their cost is two Redis
script calls, which the consume benchmark measures against the same scripts called by hand.
This is a CPU harness, not a reliability test: nothing here fakes broker behaviour beyond
counting acks, and every delivery must end in exactly one ack (checked).

The baseline is the same loop with a bare handler call (the already-decoded task, then the
same counting ack); "own work" is the difference. Each round measures every variant once
(rotated order), ``--n`` deliveries each, as process CPU time; the figures are medians over
the rounds, with min-max. For reference it also prints what ``json.loads`` of the body costs
(what the raw aio-pika contender does instead of our decode + validation).

Not included: the worker's dispatch around ``process()`` (a task per delivery, which the raw
contender pays too) and the socket work of the ack (the broker client's, the same for both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from weclaw_mq import App, Settings
from weclaw_mq.contract import headers as wh
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.worker.deadlines import Deadlines
from weclaw_mq.worker.delivery import process
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.settle import Settler

from .common import encode, make_payload

QUEUE_DICT = "own-cost-dict"
QUEUE_MODEL = "own-cost-model"
WARMUP = 2000


class BenchTask(BaseModel):
    """The benchmark payload (``common.make_payload``) as a handler's model."""

    seq: int
    sent_ns: int
    pad: str


class Acks:
    def __init__(self) -> None:
        self.acked = 0
        self.nacked = 0


class StandInMessage:
    """What ``process()`` reads from an aio-pika IncomingMessage, and an ack that counts."""

    __slots__ = (
        "_acks",
        "body",
        "headers",
        "message_id",
        "priority",
        "processed",
        "redelivered",
        "routing_key",
        "timestamp",
    )

    def __init__(self, body: bytes, task_id: str, headers: dict[str, Any], acks: Acks) -> None:
        self.body = body
        self.message_id = task_id
        self.routing_key = "own-cost"  # a move's delay queue is that of the lane it came from
        self.priority: int | None = None
        self.headers = headers
        self.redelivered = False
        self.timestamp = datetime.now(UTC)
        self.processed = False
        self._acks = acks

    async def ack(self, multiple: bool = False) -> None:
        self._acks.acked += 1
        self.processed = True

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        self._acks.nacked += 1
        self.processed = True

    async def reject(self, requeue: bool = False) -> None:
        await self.nack(requeue=requeue)


def build_app() -> App:
    settings = Settings(results_enabled=False, _env_file=None)  # type: ignore[call-arg]
    app = App("own-cost", settings=settings)

    # The consume benchmark's handler (a dict task), and the same with a pydantic model.
    @app.handler(QUEUE_DICT, idempotent=False)
    async def handle_dict(task: dict[str, Any]) -> None:
        return None

    @app.handler(QUEUE_MODEL, idempotent=False)
    async def handle_model(task: BenchTask) -> None:
        return None

    return app


class NoPublisher:
    """Only a move to a delay or dead-letter queue publishes, and no delivery here may fail:
    a move would be a bug of this harness. It fails, so the Settler gives the message back
    (a nack), which the loop's check reports; nothing reaches a broker."""

    async def publish(self, queue: str, message: Any) -> None:
        raise RuntimeError(f"own_cost: a delivery was to be moved to {queue}")


def build_runtime(app: App) -> Runtime:
    """A worker's runtime with guard and results off, and no broker behind it."""
    deadlines = Deadlines()

    def take_over(*args: Any) -> None:
        raise AssertionError("no handler here outlives its timeout")

    return Runtime(
        app=app,
        settings=app.settings,
        settler=Settler(NoPublisher(), deadlines, app.metrics),  # type: ignore[arg-type]  # see NoPublisher
        deadlines=deadlines,
        metrics=app.metrics,
        store=None,
        results=None,
        take_over=take_over,
    )


Loop = Callable[[int], Awaitable[float]]  # n deliveries -> CPU seconds


def loops(app: App, rt: Runtime) -> dict[str, Loop]:
    body = encode(make_payload(1))
    task = json.loads(body)
    acks = Acks()

    def message(i: int) -> StandInMessage:
        headers = {wh.TRACE_ID: uuid.uuid4().hex, wh.ATTEMPT: 1}
        return StandInMessage(body, f"task-{i}", headers, acks)

    def checked(n: int, started: float) -> float:
        cpu = time.process_time() - started
        if acks.acked != n or acks.nacked:
            raise SystemExit(f"expected {n} acks and no nack, got {acks.acked} and {acks.nacked}")
        acks.acked = 0
        return cpu

    def through_process(spec: HandlerSpec) -> Loop:
        async def run(n: int) -> float:
            messages = [message(i) for i in range(n)]
            started = time.process_time()
            for m in messages:
                await process(m, spec, rt)  # type: ignore[arg-type]  # the stand-in
            return checked(n, started)

        return run

    async def bare(n: int) -> float:
        func = app.handlers[QUEUE_DICT].func
        messages = [message(i) for i in range(n)]
        started = time.process_time()
        for m in messages:
            await func(task)
            await m.ack()
        return checked(n, started)

    async def json_loads(n: int) -> float:
        messages = [message(i) for i in range(n)]
        started = time.process_time()
        for m in messages:
            json.loads(m.body)
            acks.acked += 1
        return checked(n, started)

    return {
        "bare": bare,
        "process, dict task": through_process(app.handlers[QUEUE_DICT]),
        "process, pydantic model": through_process(app.handlers[QUEUE_MODEL]),
        "json.loads of the body": json_loads,
    }


async def calls_per_delivery(n: int) -> dict[str, float]:
    """Python function calls per delivery of each process() variant, counted by cProfile:
    unlike CPU time, the same on a loaded machine as on a quiet one (the load-robust figure
    to compare two versions of the delivery path by)."""
    import cProfile
    import pstats

    app = build_app()
    rt = build_runtime(app)
    variants = loops(app, rt)
    out: dict[str, float] = {}
    for name in ("bare", "process, dict task", "process, pydantic model"):
        await variants[name](WARMUP)
        profile = cProfile.Profile()
        profile.enable()
        await variants[name](n)
        profile.disable()
        out[name] = pstats.Stats(profile).total_calls / n  # type: ignore[attr-defined]
    return out


async def measure(n: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds of CPU per delivery, per variant, one figure per round."""
    app = build_app()
    rt = build_runtime(app)
    variants = loops(app, rt)
    names = list(variants)
    for name in names:
        await variants[name](WARMUP)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            out[name].append(await variants[name](n) / n * 1e6)
    return out


def report(us: dict[str, list[float]], n: int, rounds: int) -> str:
    def med(name: str) -> float:
        return statistics.median(us[name])

    def line(label: str, values: list[float]) -> str:
        return (
            f"  {label:<40} {statistics.median(values):6.2f} us "
            f"(min {min(values):.2f}, max {max(values):.2f})"
        )

    bare = us["bare"]
    own = [p - b for p, b in zip(us["process, dict task"], bare, strict=True)]
    own_model = [p - b for p, b in zip(us["process, pydantic model"], bare, strict=True)]
    beyond_raw = [o - j for o, j in zip(own, us["json.loads of the body"], strict=True)]
    lines = [
        f"weclaw_mq own CPU per delivery: process() vs a bare handler call, {n} deliveries "
        f"x {rounds} rounds, 1 KiB JSON body, guard and results off",
        "",
        "CPU per delivery (median over rounds):",
        *(line(name, values) for name, values in us.items()),
        "",
        "own work per delivery = process() - bare (per round, paired):",
        line("dict task (as the consume benchmark)", own),
        line("pydantic model", own_model),
        line("dict task, beyond raw's json.loads", beyond_raw),
        "",
        f"OWN WORK PER DELIVERY: {statistics.median(own):.1f} us "
        f"(process() {med('process, dict task'):.1f} us - bare handler call + ack "
        f"{med('bare'):.1f} us)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.own_cost", description=__doc__)
    p.add_argument("--n", type=int, default=20_000, help="deliveries per variant per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds (median, min, max)")
    args = p.parse_args(argv)
    us = asyncio.run(measure(args.n, args.rounds))
    print(report(us, args.n, args.rounds))
    calls = asyncio.run(calls_per_delivery(min(args.n, 5000)))
    print("\nPython function calls per delivery (cProfile; the same under any machine load):")
    for name, count in calls.items():
        print(f"  {name:<40} {count:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

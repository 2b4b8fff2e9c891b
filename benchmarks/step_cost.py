"""What durable work costs (issue 40): a memoized step (``ctx.step``), and a long run.

    make bench-steps                         # or: .venv/bin/python -m benchmarks.step_cost
    .venv/bin/python -m benchmarks.step_cost --smoke          # tiny: that it runs
    .venv/bin/python -m benchmarks.step_cost --n 300 --steps 10 --rounds 5 --concurrency 1 10
    .venv/bin/python -m benchmarks.step_cost --parts long --long-s 12 --watch-s 1

1. Steps, on the shared Redis (no broker: the step path alone, as a handler runs it). For each
   ``--concurrency`` c, each round runs three variants in a rotated order, ``--n`` tasks each,
   c tasks at a time, every task ``--steps`` K calls of a small async function:
   ``bare`` calls it K times; ``fresh`` makes each call a ``ctx.step`` of a new task (its
   attempt reads the task's steps once, then each step is one write); ``replay`` is attempt 2
   of the same tasks right after ``fresh`` (the one read, then K answers from memory); and
   ``no redis`` runs the fresh steps on the memory store's step book (the step's own
   bookkeeping: occurrence, JSON, the record). Counted per variant: every request this
   process wrote to Redis (each a round trip: redis-py's ``send_packed_command`` and the
   store's lean pipeline write, wrapped here), and the step book's reads; timed: the
   process's CPU. Per step = (variant - bare) / (n x K), paired per round.
   Targets: a fresh step <= 1 round trip beyond its attempt's one read (<= 1 read per
   attempt), a replayed step 0 beyond it (exact counts: a miss fails the run), and
   <= 30 us of CPU per fresh step at concurrency 1 and 10 (median; printed MISSED if not).
2. Steps in a worker, on the shared broker and Redis (guard and results on): the same handler
   with its K calls as steps and as plain calls, ``--n`` tasks per variant; printed: CPU per
   task and its difference per step, and Redis requests per task (``notify_cost.measure``'s
   window: published first, then an in-process worker until all are acked).
3. A long run (``long_running=True``) of ``--long-s`` T seconds with ``long_run_watch_s``
   ``--watch-s`` W on the shared broker: the publishes the worker made (its own
   ``weclaw_mq_published`` counter, confirmed) until the result is stored, and again once the
   last watch copy came back (one period later). Target: <= T / period + 2 (the watch copy at
   the start, one re-park per period, the end's), where period is the delay queue the watch
   uses (the longest not over W). A miss fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection

from benchmarks.infra import bench_queue_name
from benchmarks.notify_cost import AMQP_URL, REDIS_URL, _clean, measure, spread
from weclaw_mq import App, Context, Settings, Worker
from weclaw_mq.contract.naming import STEPS_KEY_PREFIX, WATCH_KEY_PREFIX, queue_key_pattern
from weclaw_mq.state import pipelining
from weclaw_mq.state.steps import MemoryStepBook, RedisStepBook
from weclaw_mq.worker.long_runs import hop_ms

PARTS = ("steps", "worker", "long")
VARIANTS = ("bare", "fresh", "no redis")
CPU_BOUND_US = 30.0
ROUND_TRIP_BOUND = 1.0


# -- counting what reaches Redis ----------------------------------------------------------------
class Requests:
    """Every request this process writes to Redis (one round trip each), and the step book's
    reads, while ``counting()`` is on. Patched at the test level only: redis-py's
    ``send_packed_command`` (its commands, pipelines, health checks) and the store's lean
    pipeline write (``pipelining._write``, which bypasses it; its fallback into
    ``send_packed_command`` is not counted twice)."""

    def __init__(self) -> None:
        self.sent = 0
        self.step_reads = 0
        self._inside_lean = False

    @contextlib.contextmanager
    def counting(self) -> Iterator[Requests]:
        send, write, load = (
            AbstractConnection.send_packed_command,
            pipelining._write,
            RedisStepBook.load,
        )

        async def counted_send(conn: Any, command: Any, check_health: bool = True) -> None:
            if not self._inside_lean and command not in (b"", []):
                self.sent += 1
            await send(conn, command, check_health)

        async def counted_write(conn: Any, data: bytes) -> None:
            self.sent += 1
            self._inside_lean = True
            try:
                await write(conn, data)
            finally:
                self._inside_lean = False

        async def counted_load(book: RedisStepBook, queue: str, task_id: str) -> Any:
            self.step_reads += 1
            return await load(book, queue, task_id)

        AbstractConnection.send_packed_command = counted_send  # type: ignore[method-assign,assignment]
        pipelining._write = counted_write
        RedisStepBook.load = counted_load  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
            pipelining._write = write
            RedisStepBook.load = load  # type: ignore[method-assign]


REQUESTS = Requests()


async def forget_steps(queue: str) -> None:
    """The step hashes and watch keys a run on ``queue`` (its own) left."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = []
        for prefix in (STEPS_KEY_PREFIX, WATCH_KEY_PREFIX):
            pattern = queue_key_pattern(prefix, queue)
            keys += [k async for k in client.scan_iter(match=pattern, count=1000)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()


# -- 1. the step path alone -------------------------------------------------------------------
async def call(i: int) -> dict[str, int]:
    """The step's function: a small JSON result, no I/O (what is measured is the step)."""
    return {"i": i, "square": i * i}


@dataclass
class Sample:
    cpu_s: float
    requests: int
    step_reads: int


def _context(app: Any, queue: str, task_id: str, attempt: int) -> Context:
    return Context(
        task_id=task_id,
        trace_id=task_id,
        queue=queue,
        attempt=attempt,
        redelivered=attempt > 1,
        headers={},
        app=app,
    )


async def _tasks(c: int, ids: list[str], one: Callable[[str], Awaitable[None]]) -> Sample:
    """``one`` for every id, ``c`` at a time; the CPU and what reached Redis meanwhile."""
    queue_of_ids = iter(ids)

    async def lane() -> None:
        for task_id in queue_of_ids:
            await one(task_id)

    sent, reads, started = REQUESTS.sent, REQUESTS.step_reads, time.process_time()
    await asyncio.gather(*(lane() for _ in range(c)))
    return Sample(time.process_time() - started, REQUESTS.sent - sent, REQUESTS.step_reads - reads)


async def step_path(n: int, k: int, rounds: int, c: int) -> dict[str, list[Sample]]:
    queue = bench_queue_name("steps", f"c{c}")
    app = App("bench-steps", settings=Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL))
    assert app.store is not None
    await app.store.get("warm-up")  # connected, not inside a window
    # The memory store's book behind a stand-in App: the step's own work, no Redis.
    book = MemoryStepBook(ttl_s=600, clock=time.monotonic)
    no_redis = SimpleNamespace(store=SimpleNamespace(step_book=lambda: book), settings=app.settings)

    async def bare(task_id: str) -> None:
        for i in range(k):
            await call(i)

    def stepping(target: Any, attempt: int) -> Callable[[str], Awaitable[None]]:
        async def one(task_id: str) -> None:
            ctx = _context(target, queue, task_id, attempt)
            for i in range(k):
                await ctx.step("call", call, i)

        return one

    out: dict[str, list[Sample]] = {v: [] for v in (*VARIANTS, "replay")}
    try:
        with REQUESTS.counting():
            for r in range(-1, rounds):  # round -1: warm-up (scripts loaded, caches filled)
                ids = {v: [uuid.uuid4().hex for _ in range(n)] for v in VARIANTS}
                order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
                for variant in order:
                    one = {
                        "bare": bare,
                        "fresh": stepping(app, 1),
                        "no redis": stepping(no_redis, 1),
                    }[variant]
                    sample = await _tasks(c, ids[variant], one)
                    if r >= 0:
                        out[variant].append(sample)
                    if variant == "fresh":  # attempt 2 of the same tasks: every step replays
                        sample = await _tasks(c, ids["fresh"], stepping(app, 2))
                        if r >= 0:
                            out["replay"].append(sample)
                await forget_steps(queue)
    finally:
        await forget_steps(queue)
        await app.close()
    return out


def step_report(out: dict[str, list[Sample]], n: int, k: int, c: int) -> bool:
    """Print the step path's table; False when a round-trip target was missed."""
    bare = out["bare"]

    def per_step(variant: str) -> list[float]:
        return [
            (s.cpu_s - b.cpu_s) / (n * k) * 1e6 for s, b in zip(out[variant], bare, strict=True)
        ]

    def extra(variant: str, attr: str) -> list[float]:
        return [
            (getattr(s, attr) - getattr(b, attr)) / n
            for s, b in zip(out[variant], bare, strict=True)
        ]

    counts_met = True
    cpu_met = True
    print(
        f"\nsteps, concurrency {c}: {n} tasks x {k} steps x {len(bare)} rounds "
        "(the step path on the shared Redis, no broker)"
    )
    print(
        "| variant | CPU us/task | CPU us/step beyond bare | step reads/task "
        "| Redis round trips/task beyond bare | bound |"
    )
    print("|---|---|---|---|---|---|")
    cpu_task = {v: [s.cpu_s / n * 1e6 for s in out[v]] for v in out}
    print(f"| bare | {spread(cpu_task['bare'], '.1f')} | - | - | - | - |")
    for variant in ("fresh", "replay", "no redis"):
        cpu = per_step(variant)
        trips = extra(variant, "requests")
        reads = extra(variant, "step_reads")
        verdict = "-"
        if variant == "fresh":
            # The attempt's one read, then at most one round trip per fresh step.
            rt_ok = max(reads) <= 1 and max(trips) <= 1 + k * ROUND_TRIP_BOUND
            cpu_ok = statistics.median(cpu) <= CPU_BOUND_US
            verdict = (
                f"rt <= 1 + {k}: {'met' if rt_ok else 'MISSED'}; CPU/step <= "
                f"{CPU_BOUND_US:g} us: {'met' if cpu_ok else 'MISSED'}"
            )
            counts_met &= rt_ok
            cpu_met &= cpu_ok
        elif variant == "replay":
            rt_ok = max(reads) <= 1 and max(trips) <= 1  # the read, nothing per step
            verdict = f"rt <= 1 (the read): {'met' if rt_ok else 'MISSED'}"
            counts_met &= rt_ok
        print(
            f"| {variant} | {spread(cpu_task[variant], '.1f')} | {spread(cpu, '.1f')} "
            f"| {spread(reads, '.2f')} | {spread(trips, '.2f')} | {verdict} |"
        )
    fresh, local = per_step("fresh"), per_step("no redis")
    redis_part = [f - m for f, m in zip(fresh, local, strict=True)]
    print(
        f"where a fresh step's CPU goes: {statistics.median(local):.1f} us the step's own work "
        f"(no redis), {statistics.median(redis_part):.1f} us its Redis write and its share of "
        f"the read (fresh - no redis), medians"
    )
    if not cpu_met:
        print(f"CPU per fresh step at concurrency {c}: MISSED (bound {CPU_BOUND_US:g} us)")
    return counts_met


# -- 2. steps in a worker ---------------------------------------------------------------------
def _worker_app(queue: str, k: int, *, steps: bool) -> App:
    app = App("bench-steps", settings=Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL))

    @app.handler(queue)
    async def work(task: dict[str, int], ctx: Context) -> int:
        for i in range(k):
            if steps:
                await ctx.step("call", call, i)
            else:
                await call(i)
        return task["n"]

    return app


async def in_worker(n: int, k: int, rounds: int, c: int) -> None:
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "steps": []}
    variants = ("plain", "steps")
    with REQUESTS.counting():
        for r in range(rounds):
            for variant in variants[r % 2 :] + variants[: r % 2]:
                queue = bench_queue_name("steps-worker", variant)
                app = _worker_app(queue, k, steps=variant == "steps")
                sent = REQUESTS.sent
                try:
                    run = await measure(app, queue, n, c)
                finally:
                    await forget_steps(queue)
                runs[variant].append((run.cpu_us_per_task, (REQUESTS.sent - sent) / n))
    plain, steps = runs["plain"], runs["steps"]
    cpu_step = [(s[0] - p[0]) / k for s, p in zip(steps, plain, strict=True)]
    rt_task = [s[1] - p[1] for s, p in zip(steps, plain, strict=True)]
    print(
        f"\nsteps in a worker, concurrency {c}: {n} tasks x {k} calls x {rounds} rounds, "
        "guard + results, shared broker and Redis"
    )
    print("| handler | CPU us/task | Redis requests/task (publish included) |")
    print("|---|---|---|")
    for variant in variants:
        cpu = [x[0] for x in runs[variant]]
        rt = [x[1] for x in runs[variant]]
        print(f"| {k} {variant} calls | {spread(cpu, '.0f')} | {spread(rt, '.2f')} |")
    print(
        f"steps - plain, paired per round: CPU per step {spread(cpu_step, '.1f')} us, "
        f"Redis requests per task {spread(rt_task, '.2f')} (K = {k}: 1 read + {k} writes "
        "when none is pipelined with another task's command)"
    )


# -- 3. a long run's publishes ----------------------------------------------------------------
def _published(app: App) -> float:
    return sum(
        s.value
        for metric in app.metrics.registry.collect()
        if metric.name == "weclaw_mq_published"
        for s in metric.samples
        if s.name.endswith("_total") and s.labels.get("outcome") == "confirmed"
    )


def _deferred(app: App, queue: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_messages_total", {"queue": queue, "outcome": "deferred"}
    )
    return value or 0.0


async def long_run(long_s: float, watch_s: float) -> bool:
    queue = bench_queue_name("long-run")
    settings = Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL, long_run_watch_s=watch_s)
    app = App("bench-long-run", settings=settings)

    @app.handler(queue, long_running=True, timeout_s=long_s * 4 + 60)
    async def run(task: dict[str, float], ctx: Context) -> float:
        await asyncio.sleep(task["s"])
        return task["s"]

    producer = App("bench-long-run-producer", settings=settings)
    period_s = hop_ms(app.handlers[queue], settings) / 1000
    met = True
    try:
        await app.declare()
        # Room for one more: a worker full of long runs pauses its consumer, and the watch
        # copies would wait out the run in the queue (no re-park, nothing to count).
        worker = Worker(app, concurrency=2)
        running = asyncio.create_task(worker.run())
        await worker.ready.wait()
        task_id = await producer.publish(queue, {"s": long_s})
        started = time.perf_counter()
        await producer.result(task_id, queue=queue, timeout_s=long_s * 4 + 60)
        took = time.perf_counter() - started
        at_end, parked = _published(app), _deferred(app, queue)
        # The last watch copy comes back within a period: stale, acked, nothing published.
        await asyncio.sleep(period_s * 1.5 + 1)
        after = _published(app)
        worker.stop()
        await asyncio.wait_for(running, 30)
        bound = long_s / period_s + 2
        met = after <= bound
        print(
            f"\na long run: {long_s:g} s, long_run_watch_s {watch_s:g} (period {period_s:g} s), "
            f"result after {took:.1f} s"
        )
        print(
            f"publishes by the worker: {at_end:.0f} at the result ({parked:.0f} watch re-parks, "
            f"the deferred outcome), {after:.0f} once its last watch copy came back; bound "
            f"T / period + 2 = {bound:.0f}: {'met' if met else 'MISSED'}"
        )
    finally:
        await producer.close()
        await app.close()
        await _clean(app, queue)
        await forget_steps(queue)
    return met


async def main(args: argparse.Namespace) -> int:
    status = 0
    if "steps" in args.parts:
        for c in args.concurrency:
            out = await step_path(args.n, args.steps, args.rounds, c)
            if not step_report(out, args.n, args.steps, c):
                status = 1
    if "worker" in args.parts:
        await in_worker(args.worker_n, args.steps, args.rounds, 10)
    if "long" in args.parts and not await long_run(args.long_s, args.watch_s):
        status = 1
    return status


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=300, help="tasks per variant (step path)")
    parser.add_argument("--worker-n", type=int, default=1000, help="tasks per worker run")
    parser.add_argument("--steps", type=int, default=10, help="steps (calls) per task")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each runs every variant)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--long-s", type=float, default=12.0, help="the long run's length")
    parser.add_argument("--watch-s", type=float, default=1.0, help="its long_run_watch_s")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--smoke", action="store_true", help="tiny counts: that it runs")
    parsed = parser.parse_args()
    if parsed.smoke:
        parsed.n, parsed.worker_n, parsed.rounds, parsed.long_s = 30, 100, 1, 3.0
    sys.exit(asyncio.run(main(parsed)))

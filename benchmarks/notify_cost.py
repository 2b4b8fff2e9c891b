"""What result notifications (``notify=True``) cost a worker, on the real broker and Redis.

    make bench-notify                        # or: .venv/bin/python -m benchmarks.notify_cost
    .venv/bin/python -m benchmarks.notify_cost --n 2000 --rounds 3 --concurrency 10

Each round runs two variants, in an order rotated every round: the same guarded handler (a
no-op returning a small dict; guard and results on) with and without ``notify=True``. For each,
``--n`` tasks are published first (``publish_many``), then an in-process worker consumes them;
the window runs from the worker's start until every task is acked. A notify task pays one more
confirmed publish (to ``Q.results``, which nobody consumes here) between storing its result and
its ack. Printed: tasks/s and the process's CPU per task, the median and min-max over rounds,
and the ratio notify / off paired per round (both ran under the same machine load).

No target is asserted: the figures say what the notification costs
(docs/how-to/notifications.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from weclaw_mq import App, Settings, Worker

from .infra import delete_app_queues, forget_queue_keys

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0")
VARIANTS = ("off", "notify")


@dataclass(frozen=True)
class Run:
    tasks_per_s: float
    cpu_us_per_task: float


def _app(queue: str, *, notify: bool) -> App:
    app = App("bench-notify", settings=Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL))

    @app.handler(queue, notify=notify)
    async def work(task: dict[str, int]) -> dict[str, int]:
        return {"n": task["n"]}

    return app


def _acked(app: App, queue: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_messages_total", {"queue": queue, "outcome": "acked"}
    )
    return value or 0.0


async def _run(variant: str, n: int, concurrency: int) -> Run:
    queue = f"bench-notify-{variant}-{uuid.uuid4().hex[:8]}"
    return await measure(_app(queue, notify=variant == "notify"), queue, n, concurrency)


async def measure(
    app: App, queue: str, n: int, concurrency: int, *, from_ready: bool = False
) -> Run:
    """Publish ``n`` tasks to ``app``'s handler on ``queue``, then time an in-process worker
    of ``concurrency`` until all are acked; the queues and keys are deleted afterwards.

    ``from_ready``: the window opens once the worker consumes (its start, which declares
    the queues, is left out) and counts the tasks acked from then on."""
    try:
        await app.declare()
        for start in range(0, n, 500):
            await app.publish_many(queue, [{"n": i} for i in range(start, min(start + 500, n))])
        worker = Worker(app, concurrency=concurrency)
        cpu0, t0 = time.process_time(), time.perf_counter()
        running = asyncio.create_task(worker.run())
        timed = n
        if from_ready:
            await _first(running, worker.ready.wait())
            cpu0, t0 = time.process_time(), time.perf_counter()
            timed = n - int(_acked(app, queue))
        while _acked(app, queue) < n:
            if running.done():
                running.result()
            await asyncio.sleep(0.005)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        worker.stop()
        await asyncio.wait_for(running, 30)
        return Run(tasks_per_s=timed / elapsed, cpu_us_per_task=cpu / timed * 1e6)
    finally:
        await app.close()
        await _clean(app, queue)


async def _first(running: asyncio.Task[None], ready: Coroutine[Any, Any, object]) -> None:
    """Until ``ready`` ends, or fail with what ended ``running`` first."""
    waiting = asyncio.ensure_future(ready)
    await asyncio.wait({running, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done():
        waiting.cancel()
        running.result()
        raise RuntimeError("the worker ended before it consumed")


async def _clean(app: App, queue: str) -> None:
    await delete_app_queues(AMQP_URL, app)
    await forget_queue_keys(REDIS_URL, queue)


def spread(values: list[float], fmt: str) -> str:
    """The median and (min-max) of ``values``."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


async def main(n: int, rounds: int, concurrency: int) -> None:
    runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 2 :] + VARIANTS[: r % 2]
        for variant in order:
            runs[variant].append(await _run(variant, n, concurrency))
    print(f"notify cost: {n} tasks x {rounds} rounds, concurrency {concurrency}, guard + results")
    print("| variant | tasks/s | CPU us/task |")
    print("|---|---|---|")
    for variant in VARIANTS:
        rate = [x.tasks_per_s for x in runs[variant]]
        cpu = [x.cpu_us_per_task for x in runs[variant]]
        print(f"| {variant} | {spread(rate, ',.0f')} | {spread(cpu, '.0f')} |")
    rate_ratio = [
        a.tasks_per_s / b.tasks_per_s for a, b in zip(runs["notify"], runs["off"], strict=True)
    ]
    cpu_ratio = [
        a.cpu_us_per_task / b.cpu_us_per_task
        for a, b in zip(runs["notify"], runs["off"], strict=True)
    ]
    print(f"notify / off, paired per round: tasks/s {spread(rate_ratio, '.2f')}x, ", end="")
    print(f"CPU per task {spread(cpu_ratio, '.2f')}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="tasks per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each runs both variants)")
    parser.add_argument("--concurrency", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.rounds, args.concurrency))

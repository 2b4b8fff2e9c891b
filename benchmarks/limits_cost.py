"""What a per-key limit costs the guarded consume path, on the real broker and Redis.

    make bench-limits                        # or: .venv/bin/python -m benchmarks.limits_cost
    .venv/bin/python -m benchmarks.limits_cost --n 2000 --rounds 3 --concurrency 10 100
    .venv/bin/python -m benchmarks.limits_cost --variants guard concurrency rate

At each concurrency, each round runs the variants in an order rotated every round: the same
guarded handler (a no-op returning a small dict; guard and results on) without a limit
("guard"), with ``Limit(key=user, concurrency=2)`` ("concurrency", the costlier kind: an
admission and a release) and, asked for, with ``Limit(key=user, rate=1000)`` ("rate").
Every task has its own user, so no limit ever defers: what is measured is the price of the
admission (one script call) and, for concurrency, the slot's release (a batched ZREM). Timing
as in ``notify_cost.measure``: ``--n`` tasks published first, then a worker consumes them all;
the window opens once the worker consumes (its start declares the queues, more of them for a
limited handler: not a cost of the consume path).

Printed: tasks/s per variant (median, min-max over rounds) and the ratio limited / guard
paired per round. Target (issue 13): a limit costs at most 10 % of the throughput, i.e.
ratio >= 0.90 at concurrency 10 and 100.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid

from benchmarks.notify_cost import AMQP_URL, REDIS_URL, Run, measure, spread
from weclaw_mq import App, Limit, Settings

VARIANTS = ("guard", "concurrency", "rate")
TARGET_RATIO = 0.90

LIMITS = {
    "guard": None,
    "concurrency": Limit(key=lambda task: task["n"], concurrency=2),
    "rate": Limit(key=lambda task: task["n"], rate=1000, per_s=1.0),
}


def _app(queue: str, variant: str) -> App:
    app = App("bench-limits", settings=Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL))

    @app.handler(queue, limit=LIMITS[variant])
    async def work(task: dict[str, int]) -> dict[str, int]:
        return {"n": task["n"]}

    return app


async def _run(variant: str, n: int, concurrency: int) -> Run:
    queue = f"bench-limits-{variant}-{uuid.uuid4().hex[:8]}"
    # From the worker's start on: a limited handler declares five more delay queues (the
    # ladder's rungs that are not step queues), which is no cost of the consume path.
    return await measure(_app(queue, variant), queue, n, concurrency, from_ready=True)


async def main(n: int, rounds: int, concurrencies: list[int], variants: list[str]) -> bool:
    print(f"limit cost: {n} tasks x {rounds} rounds, guard + results, every task its own key")
    print("| concurrency | variant | tasks/s | CPU us/task | limited / guard (paired) |")
    print("|---|---|---|---|---|")
    met = True
    for concurrency in concurrencies:
        runs: dict[str, list[Run]] = {v: [] for v in variants}
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                runs[variant].append(await _run(variant, n, concurrency))
        for variant in variants:
            rate = [x.tasks_per_s for x in runs[variant]]
            cpu = [x.cpu_us_per_task for x in runs[variant]]
            ratio = [
                a.tasks_per_s / b.tasks_per_s
                for a, b in zip(runs[variant], runs["guard"], strict=True)
            ]
            paired = "-" if variant == "guard" else f"{spread(ratio, '.2f')}x"
            if variant != "guard" and statistics.median(ratio) < TARGET_RATIO:
                met = False
                paired += f" (below {TARGET_RATIO})"
            print(
                f"| {concurrency} | {variant} | {spread(rate, ',.0f')} | {spread(cpu, '.0f')} "
                f"| {paired} |"
            )
    print(f"target: limited / guard >= {TARGET_RATIO} (median): {'met' if met else 'MISSED'}")
    return met


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="tasks per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each runs every variant)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["guard", "concurrency"])
    args = parser.parse_args()
    if "guard" not in args.variants:
        parser.error("--variants needs guard: the ratios are against it")
    asyncio.run(main(args.n, args.rounds, args.concurrency, list(dict.fromkeys(args.variants))))

"""Fair share across tenants on the real broker and Redis: how soon one tenant's task starts
behind another tenant's backlog, and what fair share costs.

    make bench-fair-share                    # or: .venv/bin/python -m benchmarks.fair_share
    .venv/bin/python -m benchmarks.fair_share --smoke

1. Behind a backlog: a worker with concurrency C (10) runs a handler of WORK_MS (20 ms) over
   BACKLOG (2000) queued tasks of tenant "big" (``fair=Fair(lanes=4)``); once it is busy,
   tenant "small" publishes one task. We count the handler completions between that
   publish's confirm and the task's start (0 when it started before the confirm came back;
   target: at most C + 1, the issue's bound, in every one of RUNS runs) and its start
   latency from the publish. The same with three tenants' backlogs (2000 split over
   "big-0".."big-2": every lane but one busy). For reference, one run without fair share
   (one queue): the task waits for the whole backlog.
2. Cost: N queued tasks, a no-op handler, concurrency 10 and 100, consumed by a fair handler
   and by a plain one (timed from the first task's start to the last one's end; results on:
   the fair book lives beside them in Redis). One tenant (every task in Q: what a fair
   handler costs when only one tenant is busy) and four tenants (four lanes busy, taken in
   turn). Rounds alternate; ratios are paired per round, median over the rounds (target:
   fair at least 0.9 of plain). And the publish side: one ``publish`` at a time over four
   tenants (the fair book is asked once per tenant per second), fair against plain (target:
   at least 0.8).

On a shared 2-core machine the numbers are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from weclaw_mq import App, Settings, Worker
from weclaw_mq.policy.fair_share import Fair

from .infra import bench_queue_name, delete_app_queues, forget_queue_keys

RESULTS = Path(__file__).resolve().parent / "results"
CONSUME_TARGET = 0.9
PUBLISH_TARGET = 0.8
LANES = 4
IDEMPOTENT = False  # the consume path alone (the guard is measured by make bench-own-cost)


class Ask(BaseModel):
    tenant: str
    marker: bool = False


def _app(amqp_url: str, redis_url: str, queue: str, fair: bool, work_s: float) -> tuple[App, Any]:
    settings = Settings(amqp_url=amqp_url, redis_url=redis_url, _env_file=None)  # type: ignore[call-arg,arg-type]
    app = App(f"bench-fair-{uuid.uuid4().hex[:6]}", settings=settings)
    state: dict[str, Any] = {"done": 0, "marker": None, "busy": asyncio.Event()}

    async def work(task: Ask) -> None:
        state.setdefault("first", time.perf_counter())
        if task.marker and state["marker"] is None:
            state["marker"] = (state["done"], time.perf_counter())
            state["started"].set()
        if work_s:
            await asyncio.sleep(work_s)
        state["done"] += 1
        if state["done"] >= state.get("busy_at", 0):
            state["busy"].set()

    app.handler(
        queue,
        idempotent=IDEMPOTENT,
        tenant=lambda task: task.tenant,
        fair=Fair(lanes=LANES) if fair else None,
    )(work)
    return app, state


async def behind_run(
    amqp_url: str,
    redis_url: str,
    *,
    concurrency: int,
    backlog: int,
    heavy: int,
    work_s: float,
    fair: bool,
) -> tuple[int, float]:
    """(completions between the confirm and the start, start latency in s) of tenant
    "small"'s one task published behind ``backlog`` tasks of ``heavy`` other tenants."""
    queue = bench_queue_name("fair")
    app, state = _app(amqp_url, redis_url, queue, fair, work_s)
    state["busy_at"] = 2 * concurrency
    state["started"] = asyncio.Event()
    try:
        await app.declare()
        tenants = [f"big-{i}" for i in range(heavy)]
        for tenant in tenants:
            await app.publish_many(queue, [Ask(tenant=tenant)] * (backlog // heavy))
        worker = Worker(app, concurrency=concurrency)
        running = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(state["busy"].wait(), 60)
            published_at = time.perf_counter()
            await app.publish(queue, Ask(tenant="small", marker=True))
            before = state["done"]  # from the confirm: the task is queued
            timeout = backlog * work_s / concurrency * 3 + 10
            await asyncio.wait_for(state["started"].wait(), timeout)
        finally:
            worker.stop()
            await running
        done_at_start, started_at = state["marker"]
        return max(0, done_at_start - before), started_at - published_at
    finally:
        await app.close()
        await delete_app_queues(amqp_url, app)
        await forget_queue_keys(redis_url, queue)


def _given_back(app: App, queue: str) -> int:
    """Deliveries the worker gave back to their queue (each counts toward the delivery
    limit: the lanes' turns must give none back)."""
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_messages_total", {"queue": queue, "outcome": "requeued"}
    )
    return int(value or 0)


async def throughput_run(
    amqp_url: str, redis_url: str, *, concurrency: int, n: int, tenants: int, fair: bool
) -> tuple[float, int]:
    """Tasks per second of a no-op handler over ``n`` queued tasks of ``tenants`` tenants,
    and the deliveries given back to their queue meanwhile."""
    queue = bench_queue_name("fair")
    app, state = _app(amqp_url, redis_url, queue, fair, 0.0)
    state["busy_at"] = n
    try:
        await app.declare()
        for i in range(tenants):
            await app.publish_many(queue, [Ask(tenant=f"t-{i}")] * (n // tenants))
        total = n // tenants * tenants
        state["busy_at"] = total
        worker = Worker(app, concurrency=concurrency)
        running = asyncio.create_task(worker.run())
        try:
            try:
                await asyncio.wait_for(state["busy"].wait(), 120)
            except TimeoutError:
                raise RuntimeError(
                    f"{total - state['done']} of {total} tasks did not run within 120 s "
                    f"({_given_back(app, queue)} given back; see {queue}.dlq)"
                ) from None
            # From the first task's start: the worker's start (declares, consumers) is not
            # the consume path.
            elapsed = time.perf_counter() - state["first"]
        finally:
            worker.stop()
            await running
        return (total - 1) / elapsed, _given_back(app, queue)
    finally:
        await app.close()
        await delete_app_queues(amqp_url, app)
        await forget_queue_keys(redis_url, queue)


async def publish_run(amqp_url: str, redis_url: str, *, n: int, fair: bool) -> float:
    """Publishes per second, one ``publish`` at a time, over four tenants."""
    queue = bench_queue_name("fair")
    app, _ = _app(amqp_url, redis_url, queue, fair, 0.0)
    try:
        await app.declare()
        await app.publish(queue, Ask(tenant="warm-up"))
        start = time.perf_counter()
        for i in range(n):
            await app.publish(queue, Ask(tenant=f"t-{i % 4}"))
        return n / (time.perf_counter() - start)
    finally:
        await app.close()
        await delete_app_queues(amqp_url, app)
        await forget_queue_keys(redis_url, queue)


def _fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.3g}{unit} (min {min(values):.3g}, max {max(values):.3g})"


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    urls = (args.amqp_url, args.redis_url)
    c = args.concurrency
    work_s = args.work_ms / 1000
    out: dict[str, Any] = {
        "concurrency": c,
        "backlog": args.backlog,
        "work_ms": args.work_ms,
        "lanes": LANES,
        "behind": {},
    }
    for heavy in (1, 3):
        completions, latencies = [], []
        for _ in range(args.runs):
            k, s = await behind_run(
                *urls, concurrency=c, backlog=args.backlog, heavy=heavy, work_s=work_s, fair=True
            )
            completions.append(k)
            latencies.append(s)
        out["behind"][str(heavy)] = {"completions": completions, "latency_s": latencies}
    k, s = await behind_run(
        *urls, concurrency=c, backlog=args.backlog, heavy=1, work_s=work_s, fair=False
    )
    out["unfair"] = {"completions": k, "latency_s": s}
    out["throughput"] = {}
    for conc in args.throughput_concurrency:
        for tenants in (1, 4):
            fair_rates, plain_rates, ratios, given_back = [], [], [], []
            for _ in range(args.rounds):
                plain, _ = await throughput_run(
                    *urls, concurrency=conc, n=args.n, tenants=tenants, fair=False
                )
                fair, back = await throughput_run(
                    *urls, concurrency=conc, n=args.n, tenants=tenants, fair=True
                )
                plain_rates.append(plain)
                fair_rates.append(fair)
                ratios.append(fair / plain)
                given_back.append(back)
            out["throughput"][f"{conc}/{tenants}"] = {
                "fair": fair_rates,
                "plain": plain_rates,
                "ratio": ratios,
                "given_back": given_back,
            }
    pub_fair, pub_plain, pub_ratios = [], [], []
    for _ in range(args.rounds):
        plain = await publish_run(*urls, n=args.publishes, fair=False)
        fair = await publish_run(*urls, n=args.publishes, fair=True)
        pub_plain.append(plain)
        pub_fair.append(fair)
        pub_ratios.append(fair / plain)
    out["publish"] = {"fair": pub_fair, "plain": pub_plain, "ratio": pub_ratios}
    return out


def report(out: dict[str, Any]) -> str:
    c = out["concurrency"]
    lines = [
        f"FAIR SHARE: concurrency {c}, handler {out['work_ms']} ms, {out['lanes']} lanes, "
        f"{out['backlog']} tasks of other tenants queued",
    ]
    for heavy, row in out["behind"].items():
        worst = max(row["completions"])
        lines.append(
            f"  a new tenant's task behind {heavy} tenant(s)' backlog: completions between its "
            f"confirm and its start {_fmt(row['completions'])} over {len(row['completions'])} "
            f"runs (target <= C + 1 = {c + 1} in every run: "
            f"{'met' if worst <= c + 1 else 'MISSED'}); start latency "
            f"{_fmt(row['latency_s'], ' s')}"
        )
    unfair = out["unfair"]
    lines.append(
        f"  without fair share (one queue): {unfair['completions']} completions, "
        f"{unfair['latency_s']:.3g} s"
    )
    for key, row in out["throughput"].items():
        conc, tenants = key.split("/")
        ratio = statistics.median(row["ratio"])
        lines.append(
            f"  consume at concurrency {conc}, {tenants} tenant(s): fair {_fmt(row['fair'], '/s')}"
            f", plain {_fmt(row['plain'], '/s')}; fair / plain {_fmt(row['ratio'])} (target >= "
            f"{CONSUME_TARGET}: {'met' if ratio >= CONSUME_TARGET else 'MISSED'}); deliveries "
            f"given back to their queue {sum(row['given_back'])} (target 0: "
            f"{'met' if not any(row['given_back']) else 'MISSED'})"
        )
    pub = out["publish"]
    ratio = statistics.median(pub["ratio"])
    lines.append(
        f"  publish one at a time: fair {_fmt(pub['fair'], '/s')}, plain "
        f"{_fmt(pub['plain'], '/s')}; fair / plain {_fmt(pub['ratio'])} (target >= "
        f"{PUBLISH_TARGET}: {'met' if ratio >= PUBLISH_TARGET else 'MISSED'})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = Settings()
    p = argparse.ArgumentParser(prog="python -m benchmarks.fair_share", description=__doc__)
    p.add_argument("--amqp-url", default=defaults.amqp_url.get_secret_value())
    p.add_argument("--redis-url", default=defaults.redis_url.get_secret_value())
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--backlog", type=int, default=2000)
    p.add_argument("--work-ms", type=float, default=20.0)
    p.add_argument("--runs", type=int, default=5, help="runs behind a backlog")
    p.add_argument("--n", type=int, default=3000, help="tasks per throughput run")
    p.add_argument("--publishes", type=int, default=500, help="publishes per publish run")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds")
    p.add_argument("--throughput-concurrency", type=int, nargs="+", default=[10, 100])
    p.add_argument("--smoke", action="store_true", help="tiny counts: the script still runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.backlog, args.runs, args.n, args.rounds, args.publishes = 200, 1, 200, 1, 50
        args.throughput_concurrency = [10]
    out = asyncio.run(measure(args))
    print(report(out))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("fair-share-smoke.json" if args.smoke else "fair-share.json")).write_text(
        json.dumps(out, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

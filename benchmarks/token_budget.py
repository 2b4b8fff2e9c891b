"""Token limits against a provider with real limits: goodput and 429s, budgeted vs not.

    make bench-token-budget            # or: .venv/bin/python -m benchmarks.token_budget
    .venv/bin/python -m benchmarks.token_budget --smoke

A local stand-in for a provider (``weclaw_mq.testing.fake_provider``) allows ``--tokens`` per
sliding window of ``--window-s`` seconds to one model. Three workers (concurrency 8 each, in
this process, on the shared broker and Redis) drain a backlog of tasks of ~100 tokens each
whose handler calls it; on a 429 the handler raises ``Retry(after_s=<Retry-After>)``. Run
twice, the same backlog: without a limit ("unbudgeted") and with
``Limit(key=model, tokens=<the provider's>, per_s=<its window>)`` ("budgeted", estimate = the
prompt's tokens + max_tokens, usage reported). After a warm-up of one window, printed per run:
the 429s the provider answered, and the goodput: tokens it served per window, against its
limit.

Targets (issue 31): budgeted, 0 429s after the warm-up and a goodput of at least 95 % of the
provider's limit.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.infra import bench_queue_name
from benchmarks.notify_cost import AMQP_URL, REDIS_URL
from weclaw_mq import App, Context, Limit, Retry, RetryPolicy, Settings, Worker, retry_after_s
from weclaw_mq.testing.fake_provider import FakeProvider, ModelLimits, serving, tokens_of
from weclaw_mq.wire.topology import queue_declarations

MODEL = "bench-model"
WORKERS = 3
CONCURRENCY = 8
TARGET_GOODPUT = 0.95
PROMPT = "w" * 200  # 50 tokens
MAX_TOKENS = 50  # the answer's: 100 tokens a task


@dataclass
class Result:
    name: str
    refused_after_warmup: int
    refused: int
    goodput: float  # tokens served per window after the warm-up, over the provider's limit
    seconds: float


def _estimate(task: dict[str, Any]) -> int:
    return tokens_of(task["prompt"]) + int(task["max_tokens"])


def _app(queue: str, client: httpx.AsyncClient, limit: Limit | None) -> App:
    settings = Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL, broker_load_check=False)
    app = App("bench-token-budget", settings=settings)

    @app.handler(queue, limit=limit, retry=RetryPolicy(max_retries=100, delay_s=0.1))
    async def complete(task: dict[str, Any], ctx: Context) -> None:
        response = await client.post("/v1/complete", json=task)
        if response.status_code == 429:
            raise Retry("rate limited", after_s=retry_after_s(response.headers.get("Retry-After")))
        response.raise_for_status()
        usage = response.json()["usage"]
        ctx.usage(input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"])

    return app


async def _run(
    name: str, tokens: int, window_s: float, windows: int, limit_for: Callable[[], Limit | None]
) -> Result:
    provider = FakeProvider({MODEL: ModelLimits(tokens, requests=100_000, window_s=window_s)})
    queue = bench_queue_name("token", name)
    # A backlog of one window more than the run can serve: the workers are never idle.
    count = (windows + 1) * tokens // (tokens_of(PROMPT) + MAX_TOKENS)
    async with serving(provider) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        apps = [_app(queue, client, limit_for()) for _ in range(WORKERS)]
        await apps[0].declare()
        task = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        await apps[0].publish_many(queue, [task] * count)
        workers = [Worker(app, concurrency=CONCURRENCY) for app in apps]
        running = [asyncio.create_task(w.run()) for w in workers]
        started = time.monotonic()
        await asyncio.sleep(window_s)  # the warm-up window
        refused_then, billed_then = provider.refused, sum(provider.bill.values())
        await asyncio.sleep(window_s * windows)  # the measured windows
        refused_now, billed_now = provider.refused, sum(provider.bill.values())
        seconds = time.monotonic() - started
        for worker in workers:
            worker.stop()
        await asyncio.gather(*running)
        for app in apps:
            await app.close()
        await _delete(apps[0])
    return Result(
        name,
        refused_now - refused_then,
        refused_now,
        (billed_now - billed_then) / windows / tokens,
        seconds,
    )


async def _delete(app: App) -> None:
    conn = await app.broker.connect(name="bench-token-budget-cleanup")
    try:
        channel = await conn.channel()
        for spec in app.handlers.values():
            for name, _ in queue_declarations(spec.queue_spec()):
                await channel.queue_delete(name)
    finally:
        await conn.close()


async def main(tokens: int, window_s: float, windows: int) -> bool:
    print(
        f"token budget: a provider allowing {tokens} tokens per {window_s:g} s window to one "
        f"model; {WORKERS} workers x concurrency {CONCURRENCY}, tasks of "
        f"{tokens_of(PROMPT) + MAX_TOKENS} tokens, {windows} windows measured after one of "
        "warm-up"
    )
    runs = [
        await _run("unbudgeted", tokens, window_s, windows, lambda: None),
        await _run(
            "budgeted",
            tokens,
            window_s,
            windows,
            lambda: Limit(
                key=lambda t: t["model"], tokens=tokens, per_s=window_s, estimate=_estimate
            ),
        ),
    ]
    print(f"{'run':<12} {'429s after warm-up':>19} {'429s in all':>12} {'goodput':>8}")
    for r in runs:
        print(f"{r.name:<12} {r.refused_after_warmup:>19} {r.refused:>12} {r.goodput:>8.1%}")
    budgeted = runs[1]
    ok = budgeted.refused_after_warmup == 0 and budgeted.goodput >= TARGET_GOODPUT
    print(
        f"target: budgeted, 0 429s after the warm-up and goodput >= {TARGET_GOODPUT:.0%}: "
        f"{budgeted.refused_after_warmup} and {budgeted.goodput:.1%}: "
        f"{'met' if ok else 'MISSED'}"
    )
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny: two 1-s windows")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.window_s, args.windows = 1000, 1.0, 2
    asyncio.run(main(args.tokens, args.window_s, args.windows))

"""What chains and groups (``weclaw_mq.workflows``) cost, on the real broker and Redis.

    make bench-workflows                     # or: .venv/bin/python -m benchmarks.workflows
    .venv/bin/python -m benchmarks.workflows --chains 300 --parts 1000 --rounds 3

Three measurements, each against a baseline run in the same round (so both saw the same load):

- **chain overhead**: ``--chains`` 3-stage chains (``app.chain``) against as many 3-stage
  pipelines chained by hand (each stage's handler publishes the next with
  ``ctx.publish(..., task_id=...)``, as before workflows existed). The window runs from the
  first start to the last stage's last ack; the ratio chain / by hand (target <= 1.2x), in
  time and in the CPU of the process (which runs the worker and the starts: on a machine
  shared with other load, the steadier of the two).
- **fan-in rate**: one group of ``--parts`` parts and a callback, published first, then an
  in-process worker started: parts joined per second until the callback ended, against the
  plain guarded consume rate of as many tasks to the same handler (its bound: a part costs a
  task plus its join step).
- **the join step alone**: ``--joins`` parts of one group counted straight through the store
  (``RedisWorkflowStore.join``, 64 at a time, the auto-pipeline batching them): how many
  joins one group's keys take per second, to compare with the consume rate above. A join is
  one script of O(1) work (``HSETNX`` and ``HINCRBY``) on the group's two keys.

Printed: the medians and (min-max) over ``--rounds``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from weclaw_mq import App, Context, Settings, Worker
from weclaw_mq.contract.naming import (
    CHAIN_RECORD_QUEUE,
    GROUP_RECORD_QUEUE,
    GUARD_KEY_PREFIX,
    STATE_KEY_PREFIX,
    WORKFLOW_DEADLINES_KEY,
    queue_key_pattern,
    state_key,
    workflow_key,
    workflow_parts_key,
)
from weclaw_mq.state.workflow_records import workflows_of

from .infra import delete_app_queues

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0")
CONCURRENCY = 32


def _settings() -> Settings:
    return Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL)


def _acked(app: App, queue: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_messages_total", {"queue": queue, "outcome": "acked"}
    )
    return value or 0.0


async def _until_acked(app: App, queue: str, n: int, running: asyncio.Task[None]) -> None:
    while _acked(app, queue) < n:
        if running.done():
            running.result()
        await asyncio.sleep(0.005)


async def _start(app: App) -> tuple[Worker, asyncio.Task[None]]:
    worker = Worker(app, concurrency=CONCURRENCY)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 30)
    return worker, running


async def _stop(worker: Worker, running: asyncio.Task[None]) -> None:
    worker.stop()
    await asyncio.wait_for(running, 30)


async def _in_batches(calls: list[Any], size: int = 50) -> list[Any]:
    out: list[Any] = []
    for first in range(0, len(calls), size):
        out += await asyncio.gather(*calls[first : first + size])
    return out


# -- chain overhead ---------------------------------------------------------------------------


async def chain_seconds(n: int, *, by_hand: bool) -> tuple[float, float]:
    """Seconds from the first start to the last stage's last ack, for ``n`` 3-stage runs, and
    this process's CPU seconds meanwhile (its worker and its publishes)."""
    tag = uuid.uuid4().hex[:8]
    queues = [f"bench-wf-{'hand' if by_hand else 'chain'}-{tag}-{s}" for s in "abc"]
    app = App("bench-workflows", settings=_settings())

    @app.handler(queues[0])
    async def first(n: int, ctx: Context) -> int:
        if by_hand:
            await ctx.publish(queues[1], n + 1, task_id=f"{ctx.task_id}.1")
            return n
        return n + 1

    @app.handler(queues[1])
    async def second(n: int, ctx: Context) -> int:
        if by_hand:
            await ctx.publish(queues[2], n + 1, task_id=f"{ctx.task_id}.2")
            return n
        return n + 1

    @app.handler(queues[2])
    async def third(n: int) -> int:
        return n

    ids: list[str] = []
    try:
        worker, running = await _start(app)
        t0, cpu0 = time.perf_counter(), time.process_time()
        if by_hand:
            await _in_batches([app.publish(queues[0], i) for i in range(n)])
        else:
            ids = await _in_batches([app.chain(queues, i) for i in range(n)])
        await _until_acked(app, queues[2], n, running)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await _stop(worker, running)
        return elapsed, cpu
    finally:
        await app.close()
        await _clean(app, queues, ids)


# -- fan-in -----------------------------------------------------------------------------------


async def fan_in_rate(parts: int, *, group: bool) -> tuple[float, float]:
    """Parts (or plain tasks) per second through a worker started after they were published,
    and per second published (``app.group``, or ``publish_many`` in batches of 1,000)."""
    tag = uuid.uuid4().hex[:8]
    queue, merge_queue = f"bench-wf-part-{tag}", f"bench-wf-merge-{tag}"
    app = App("bench-workflows", settings=_settings())

    @app.handler(queue)
    async def part(n: int) -> int:
        return n

    @app.handler(merge_queue)
    async def merge(results: list[int]) -> int:
        return len(results)

    ids: list[str] = []
    try:
        await app.declare()
        p0 = time.perf_counter()
        if group:
            ids = [await app.group(queue, range(parts), then=merge_queue)]
        else:
            for first in range(0, parts, 1000):
                await app.publish_many(queue, list(range(first, min(first + 1000, parts))))
        published_per_s = parts / (time.perf_counter() - p0)
        worker = Worker(app, concurrency=CONCURRENCY)
        t0 = time.perf_counter()
        running = asyncio.create_task(worker.run())
        if group:
            await _until_acked(app, merge_queue, 1, running)
        else:
            await _until_acked(app, queue, parts, running)
        elapsed = time.perf_counter() - t0
        await _stop(worker, running)
        return parts / elapsed, published_per_s
    finally:
        await app.close()
        await _clean(app, [queue, merge_queue], ids)


async def join_rate(joins: int) -> float:
    """Joins per second of one group's parts, straight through the store."""
    app = App("bench-workflows", settings=_settings())
    wid = f"bench-wf-join-{uuid.uuid4().hex[:8]}"
    try:
        flows = workflows_of(app.store)
        assert flows is not None
        await flows.create(
            wid, "{}", kind="group", size=joins, policy="fail", deadline_ms=2**50, keep_ms=600_000
        )
        outcome = {"status": "succeeded", "result": 1}
        t0 = time.perf_counter()
        answers = await _in_batches(
            [flows.join(wid, i, outcome, ends_group=None) for i in range(joins)], 64
        )
        elapsed = time.perf_counter() - t0
        assert answers[-1].step.value == "joined", answers[-1]
        return joins / elapsed
    finally:
        await app.close()
        await _clean(app, [], [wid])


async def _clean(app: App, queues: list[str], workflow_ids: list[str]) -> None:
    await delete_app_queues(AMQP_URL, app)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys: list[Any] = []
        for queue in queues:
            for prefix in (GUARD_KEY_PREFIX, STATE_KEY_PREFIX):
                keys += [k async for k in client.scan_iter(queue_key_pattern(prefix, queue))]
        task_ids = {k.rsplit(b":{", 1)[1].removesuffix(b"}").decode() for k in keys}
        keys += [f"weclaw_mq:latest:{{{t}}}".encode() for t in task_ids | set(workflow_ids)]
        for wid in workflow_ids:
            keys += [workflow_key(wid), workflow_parts_key(wid)]
            keys += [state_key(q, wid) for q in (CHAIN_RECORD_QUEUE, GROUP_RECORD_QUEUE)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
        if workflow_ids:
            await client.zrem(WORKFLOW_DEADLINES_KEY, *workflow_ids)
    finally:
        await client.aclose()


def spread(values: list[float], fmt: str) -> str:
    """The median and (min-max) of ``values``."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


async def main(chains: int, parts: int, joins: int, rounds: int) -> None:
    chain_s: list[float] = []
    hand_s: list[float] = []
    chain_cpu: list[float] = []
    hand_cpu: list[float] = []
    group_rate: list[float] = []
    plain_rate: list[float] = []
    group_pub: list[float] = []
    plain_pub: list[float] = []
    join: list[float] = []
    for r in range(rounds):
        order = [False, True] if r % 2 else [True, False]
        for by_hand in order:
            seconds, cpu = await chain_seconds(chains, by_hand=by_hand)
            (hand_s if by_hand else chain_s).append(seconds)
            (hand_cpu if by_hand else chain_cpu).append(cpu)
        for group in order:
            rate, published = await fan_in_rate(parts, group=group)
            (group_rate if group else plain_rate).append(rate)
            (group_pub if group else plain_pub).append(published)
        join.append(await join_rate(joins))
    ratio = [c / h for c, h in zip(chain_s, hand_s, strict=True)]
    cpu_ratio = [c / h for c, h in zip(chain_cpu, hand_cpu, strict=True)]
    fan = [g / p for g, p in zip(group_rate, plain_rate, strict=True)]
    print(f"workflows: {rounds} rounds, worker concurrency {CONCURRENCY}, guard + results on")
    print("| measurement | value |")
    print("|---|---|")
    print(f"| {chains} 3-stage chains (app.chain), s | {spread(chain_s, '.2f')} |")
    print(f"| {chains} 3-stage pipelines by hand (ctx.publish), s | {spread(hand_s, '.2f')} |")
    print(f"| chain / by hand, paired per round (target <= 1.2x) | {spread(ratio, '.2f')}x |")
    print(f"| chain / by hand, CPU of the process, paired | {spread(cpu_ratio, '.2f')}x |")
    print(f"| {parts}-part group, parts joined/s | {spread(group_rate, ',.0f')} |")
    print(f"| {parts} plain guarded tasks, tasks/s (the bound) | {spread(plain_rate, ',.0f')} |")
    print(f"| group / plain, paired per round | {spread(fan, '.2f')}x |")
    print(f"| app.group start, parts published/s | {spread(group_pub, ',.0f')} |")
    print(f"| publish_many of as many plain tasks, tasks/s | {spread(plain_pub, ',.0f')} |")
    print(f"| join step alone, one {joins}-part group, joins/s | {spread(join, ',.0f')} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chains", type=int, default=300, help="chains per run")
    parser.add_argument("--parts", type=int, default=1000, help="parts of the group")
    parser.add_argument("--joins", type=int, default=10_000, help="joins of the store alone")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.chains, args.parts, args.joins, args.rounds))

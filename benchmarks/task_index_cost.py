"""The task index: what it costs the guarded consume path, and how fast a page of a million is.

    make bench-task-index                    # or: .venv/bin/python -m benchmarks.task_index_cost
    .venv/bin/python -m benchmarks.task_index_cost --smoke     # tiny: that it runs
    .venv/bin/python -m benchmarks.task_index_cost --n 2000 --rounds 3 --concurrency 10 100
    .venv/bin/python -m benchmarks.task_index_cost --parts pages --tasks 1000000 --pages 20

1. Consume, on the shared broker and Redis: the same guarded handler (a no-op returning a small
   dict; guard and results on) with ``WECLAW_MQ_TASK_INDEX`` on and off, in an order rotated
   every round. Timing as in ``notify_cost.measure`` (``--n`` tasks published first, the window
   opens once the worker consumes). With the index on, the claim's "running" record and the
   finish's final record each append a timeline event in their own scripts (the index entry
   itself was written with the "queued" record at publish, outside the window). Printed:
   tasks/s and CPU per task per variant (median, min-max over rounds), and on / off of both,
   paired per round (CPU per task is the steadier on a busy machine). Target (issue 29): at
   most 5 % slower, i.e. tasks/s on / off >= 0.95 (median).
3. The same store calls alone, no broker (``--parts store``), on the benchmark's own
   redis-server: each task's claim and finish, 100 at a time, the "queued" records written
   before the window; this process's CPU and Redis's own time per task, index on vs off.
2. ``list_tasks``, on a redis-server of the benchmark's own (a unix socket in a temp folder,
   stopped at the end: a million entries in the shared Redis would be everyone's): ``--tasks``
   tasks indexed and recorded as a busy deployment leaves them (10 queues; 97 % succeeded, 2 %
   dead-lettered, 1 % running), filled by Lua calls of 10,000 tasks each, four at a time.
   Then pages of 50: newest first, one queue, a sparse status (dead_lettered: its own
   index), a status found by scanning (running), and a page from a cursor 90 % deep.
   Printed per query: the page's wall time and Redis's own time (``INFO commandstats``:
   microseconds spent in the commands the page sent), median and max over ``--pages``
   pages. Target: < 100 ms a page.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from benchmarks.infra import bench_queue_name, forget_task_index
from benchmarks.notify_cost import AMQP_URL, REDIS_URL, Run, measure, spread
from weclaw_mq import App, Settings, TaskQuery, TaskStatus
from weclaw_mq.contract.naming import (
    STATE_KEY_PREFIX,
    TASK_INDEX_KEY,
    TASK_INDEX_QUEUES_KEY,
    task_index_queue_key,
    task_index_status_key,
)
from weclaw_mq.state import RedisTaskStore, TaskState, new_owner
from weclaw_mq.state.task_index import make_cursor

VARIANTS = ("off", "on")
PARTS = ("consume", "store", "pages")
S_QUEUED = TaskStatus.QUEUED
TARGET_RATIO = 0.95
TARGET_PAGE_MS = 100.0
QUEUES = 10
PAGE = 50


# -- 1. the consume path ---------------------------------------------------------------------
def _app(queue: str, variant: str) -> App:
    settings = Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL, task_index=variant == "on")
    app = App("bench-task-index", settings=settings)

    @app.handler(queue)
    async def work(task: dict[str, int]) -> dict[str, int]:
        return {"n": task["n"]}

    return app


async def _consume(variant: str, n: int, concurrency: int) -> Run:
    queue = bench_queue_name("task-index", variant)
    try:
        return await measure(_app(queue, variant), queue, n, concurrency, from_ready=True)
    finally:
        await forget_task_index(REDIS_URL, queue)


async def consume_cost(n: int, rounds: int, concurrencies: list[int]) -> bool:
    print(f"task index cost: {n} tasks x {rounds} rounds, guard + results, index on vs off")
    print("| concurrency | index | tasks/s | CPU us/task | tasks/s on / off | CPU on / off |")
    print("|---|---|---|---|---|---|")
    met = True
    for concurrency in concurrencies:
        runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for variant in VARIANTS[r % 2 :] + VARIANTS[: r % 2]:
                runs[variant].append(await _consume(variant, n, concurrency))
        ratio = [
            a.tasks_per_s / b.tasks_per_s for a, b in zip(runs["on"], runs["off"], strict=True)
        ]
        cpu_ratio = [
            a.cpu_us_per_task / b.cpu_us_per_task
            for a, b in zip(runs["on"], runs["off"], strict=True)
        ]
        for variant in VARIANTS:
            rate = [x.tasks_per_s for x in runs[variant]]
            cpu = [x.cpu_us_per_task for x in runs[variant]]
            paired, cpu_paired = "-", "-"
            if variant == "on":
                paired = f"{spread(ratio, '.3f')}x"
                cpu_paired = f"{spread(cpu_ratio, '.3f')}x"
                if statistics.median(ratio) < TARGET_RATIO:
                    met = False
                    paired += f" (below {TARGET_RATIO})"
            print(
                f"| {concurrency} | {variant} | {spread(rate, ',.0f')} | {spread(cpu, '.0f')} "
                f"| {paired} | {cpu_paired} |"
            )
    print(f"target: on / off >= {TARGET_RATIO} (median): {'met' if met else 'MISSED'}")
    return met


# -- 3. the store alone ----------------------------------------------------------------------
async def _claims_and_finishes(store: RedisTaskStore, queue: str, ids: list[str]) -> None:
    """Each task's claim (with its "running" record) and finish (its result), 100 at a time."""
    gate = asyncio.Semaphore(100)

    async def one(task_id: str) -> None:
        async with gate:
            owner = new_owner()
            running = TaskState(task_id=task_id, queue=queue, status=TaskStatus.RUNNING, attempt=1)
            await store.claim(queue, task_id, owner, running=running)
            done = running.model_copy(update={"status": TaskStatus.SUCCEEDED, "result": {"n": 1}})
            await store.finish(queue, task_id, done, owner=owner)

    await asyncio.gather(*(one(t) for t in ids))


async def store_cost(tasks: int, rounds: int) -> None:
    """The consume path's store calls alone (no broker): CPU of this process and Redis's own
    time per task, index on vs off, each round both in a rotated order; the tasks' "queued"
    records (and with the index on their entries and timelines) written before the window,
    as a publish does."""
    with own_redis() as url:
        client = aioredis.Redis.from_url(url, socket_timeout=120)
        cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
        server: dict[str, list[float]] = {v: [] for v in VARIANTS}
        try:
            for r in range(rounds):
                for variant in VARIANTS[r % 2 :] + VARIANTS[: r % 2]:
                    store = RedisTaskStore(
                        client, ttl_s=600, lease_s=30, done_ttl_s=600, task_index=variant == "on"
                    )
                    ids = [uuid.uuid4().hex for _ in range(tasks)]
                    queued = [
                        TaskState(task_id=t, queue="q", status=TaskStatus.QUEUED) for t in ids
                    ]
                    await store.record_many(queued, only_if_new=True)
                    before, started = await _command_usec(client), time.process_time()
                    await _claims_and_finishes(store, "q", ids)
                    cpu[variant].append((time.process_time() - started) / tasks * 1e6)
                    server[variant].append((await _command_usec(client) - before) / tasks)
        finally:
            await client.aclose()
    print(f"\nthe store alone: {tasks} claims + finishes x {rounds} rounds, 100 at a time")
    print("| index | client CPU us/task | Redis us/task |")
    print("|---|---|---|")
    for variant in VARIANTS:
        print(f"| {variant} | {spread(cpu[variant], '.1f')} | {spread(server[variant], '.1f')} |")


# -- 2. a page of a million ------------------------------------------------------------------
@contextlib.contextmanager
def own_redis() -> Iterator[str]:
    """A redis-server on a unix socket in a temp folder, stopped (by its pid) on exit."""
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server: apt-get install redis-server (Debian)")
    folder = Path(tempfile.mkdtemp(prefix="bench-task-index-"))
    socket = folder / "redis.sock"
    args = ["--port", "0", "--unixsocket", str(socket), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        ["redis-server", *args, "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the benchmark's own redis-server did not start")
            time.sleep(0.05)
        yield f"unix://{socket}?db=0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


# Tasks first..last of the fill: each gets its record (as the store writes it), its entry in
# the index and its queue's, and a sparse status's entry. KEYS: none (a private Redis); ARGV:
# first, last, base ms, state JSON template (%s: task id, %s: queue, %s: status), prefixes.
_FILL = """
local first, last, base = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local template, state_prefix, index, dead = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
for i = first, last do
  local task = string.format('task-%08d', i)
  local queue = string.format('bench-q%d', i % 10)
  local status = 'succeeded'
  if i % 100 < 2 then status = 'dead_lettered' elseif i % 100 == 2 then status = 'running' end
  local member = string.len(queue) .. ':' .. queue .. ':' .. task
  local key = state_prefix .. ':' .. string.len(queue) .. ':' .. queue .. ':{' .. task .. '}'
  redis.call('HSET', key, 'status', status, 'state', string.format(template, task, queue, status))
  local at = base + i
  redis.call('ZADD', index, at, member)
  redis.call('ZADD', index .. ':q:' .. queue, at, member)
  if status == 'dead_lettered' then redis.call('ZADD', dead, at, member) end
end
return last - first + 1
"""


def _template() -> str:
    state = TaskState(
        task_id="TASK", queue="QUEUE", status=TaskStatus.SUCCEEDED, attempt=1, result={"n": 1}
    )
    return (
        state.model_dump_json()
        .replace('"TASK"', '"%s"')
        .replace('"QUEUE"', '"%s"')
        .replace('"succeeded"', '"%s"')
    )


async def _fill(client: aioredis.Redis, tasks: int) -> float:
    started = time.perf_counter()
    fill = client.register_script(_FILL)
    base = int(time.time() * 1000) - tasks
    args = [STATE_KEY_PREFIX, TASK_INDEX_KEY, task_index_status_key("dead_lettered")]
    step = 10_000
    template = _template()
    # A few calls in flight at a time: each is one bulk write of 10,000 tasks in Redis.
    for start in range(0, tasks, step * 4):
        await asyncio.gather(
            *(
                fill(keys=[], args=[first, min(first + step, tasks) - 1, base, template, *args])
                for first in range(start, min(start + step * 4, tasks), step)
            )
        )
    for q in range(QUEUES):
        await client.sadd(TASK_INDEX_QUEUES_KEY, task_index_queue_key(f"bench-q{q}"))
    return time.perf_counter() - started


async def _command_usec(client: aioredis.Redis) -> float:
    stats = await client.info("commandstats")
    return sum(float(v["usec"]) for k, v in stats.items() if isinstance(v, dict) and "usec" in v)


async def _timed(
    store: RedisTaskStore, client: aioredis.Redis, query: TaskQuery
) -> tuple[float, float, Any]:
    before = await _command_usec(client)
    started = time.perf_counter()
    page = await store.list_tasks(query)
    wall_ms = (time.perf_counter() - started) * 1000
    # Less the INFO call's own few microseconds (counted in commandstats too).
    server_ms = (await _command_usec(client) - before) / 1000
    return wall_ms, server_ms, page


async def page_speed(tasks: int, pages: int) -> bool:
    met = True
    with own_redis() as url:
        client = aioredis.Redis.from_url(url, socket_timeout=120)
        store = RedisTaskStore(client, ttl_s=86400, lease_s=30, done_ttl_s=86400)
        try:
            filled_s = await _fill(client, tasks)
            indexed = await client.zcard(TASK_INDEX_KEY)
            index_bytes = await client.memory_usage(TASK_INDEX_KEY) or 0
            print(
                f"\nlist_tasks: {indexed:,} tasks indexed in {filled_s:.1f} s (Lua, 10,000 "
                f"a call); the overall index ~{index_bytes / max(indexed, 1):.0f} "
                f"bytes a task; pages of {PAGE}, {pages} each"
            )
            deep = await client.zrange(
                TASK_INDEX_KEY, int(indexed * 0.9), int(indexed * 0.9), desc=True, withscores=True
            )
            deep_cursor = make_cursor(int(deep[0][1]), 0) if deep else None
            queries = {
                "newest first": TaskQuery(limit=PAGE),
                "one queue": TaskQuery(queue="bench-q3", limit=PAGE),
                "status dead_lettered (own index)": TaskQuery(
                    status=TaskStatus.DEAD_LETTERED, limit=PAGE
                ),
                "status running (scanned, 1 %)": TaskQuery(status=TaskStatus.RUNNING, limit=PAGE),
                "a cursor 90 % deep": TaskQuery(limit=PAGE, cursor=deep_cursor),
            }
            print("| query | rows | scanned | wall ms (median, max) | Redis ms (median, max) |")
            print("|---|---|---|---|---|")
            for name, query in queries.items():
                walls, servers = [], []
                page = None
                for _ in range(pages):
                    wall_ms, server_ms, page = await _timed(store, client, query)
                    walls.append(wall_ms)
                    servers.append(server_ms)
                assert page is not None
                if statistics.median(walls) >= TARGET_PAGE_MS:
                    met = False
                print(
                    f"| {name} | {len(page.tasks)} | {page.scanned:,} "
                    f"| {statistics.median(walls):.1f}, {max(walls):.1f} "
                    f"| {statistics.median(servers):.2f}, {max(servers):.2f} |"
                )
        finally:
            await store.close()
            await client.aclose()
    print(f"target: a page < {TARGET_PAGE_MS:.0f} ms (median): {'met' if met else 'MISSED'}")
    return met


async def main(args: argparse.Namespace) -> None:
    if "consume" in args.parts:
        await consume_cost(args.n, args.rounds, args.concurrency)
    if "store" in args.parts:
        await store_cost(args.store_tasks, args.rounds)
    if "pages" in args.parts:
        await page_speed(args.tasks, args.pages)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="tasks per consume run")
    parser.add_argument("--rounds", type=int, default=7, help="consume rounds (each runs both)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--tasks", type=int, default=1_000_000, help="tasks indexed for paging")
    parser.add_argument("--pages", type=int, default=20, help="pages timed per query")
    parser.add_argument("--store-tasks", type=int, default=5000, help="tasks per store round")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--smoke", action="store_true", help="tiny counts: that it runs")
    parsed = parser.parse_args()
    if parsed.smoke:
        parsed.n, parsed.rounds, parsed.concurrency = 100, 1, [10]
        parsed.tasks, parsed.pages, parsed.store_tasks = 20_000, 2, 200
    asyncio.run(main(parsed))

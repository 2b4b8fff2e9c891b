"""The web console's Tasks page over a big task index: the server's time for a page of 50.

    make bench-console                          # or: .venv/bin/python -m benchmarks.console_page
    .venv/bin/python -m benchmarks.console_page --smoke       # tiny: that it runs
    .venv/bin/python -m benchmarks.console_page --tasks 1000000 --pages 20

On a redis-server of the benchmark's own (``task_index_cost.own_redis``: a million entries in
the shared Redis would be everyone's), ``--tasks`` tasks are indexed and recorded as a busy
deployment leaves them (``task_index_cost._fill``: 10 queues; 97 % succeeded, 2 %
dead-lettered, 1 % running). The console (``create_console``) is then asked for pages of 50
in this process through httpx's ASGI transport, so the time is the server's own (the guard,
``App.tasks``, the template), no network: the whole Tasks page, its live fragment, the JSON,
and a filtered fragment (one queue, then the sparse status ``dead_lettered``). Baseline, in the
same run and on the same Redis: ``App.tasks`` alone for the same query, so the console's own
share (guard and rendering) is the difference. Printed: median and max per request over
``--pages``. Target (issue 29): a page of 50 out of 1,000,000 in under 100 ms of server time.

Then the overview's load: 1, then ``--consoles`` open overview pages, each polling
``/api/overview`` every 2 s as the page's script does, for ``--seconds``, against the shared
broker (two handler queues that do not exist: a passive declare each, nothing created) and
the benchmark's Redis (the worker registry). Printed per case: the requests served, the reads
of the broker and Redis they caused (``Overview`` reads once per 2 s whoever asks), and
Redis's commands. Target (issue 29): open consoles add no load: 20 cost the reads 1 does.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import redis.asyncio as aioredis

from benchmarks.task_index_cost import _fill, own_redis
from weclaw_mq import App, Settings, TaskQuery, TaskStatus
from weclaw_mq.console import create_console
from weclaw_mq.contract.naming import TASK_INDEX_KEY
from weclaw_mq.state import RedisTaskStore

TARGET_MS = 100.0
PAGE = 50


async def _times(pages: int, call: Callable[[], Awaitable[Any]]) -> list[float]:
    await call()  # the first call of each warms its template and scripts
    times = []
    for _ in range(pages):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1000)
    return times


async def page_time(tasks: int, pages: int) -> bool:
    met = True
    with own_redis() as url:
        client = aioredis.Redis.from_url(url)
        try:
            filled_s = await _fill(client, tasks)
            indexed = await client.zcard(TASK_INDEX_KEY)
            store = RedisTaskStore(client, ttl_s=86400, lease_s=30, done_ttl_s=86400)
            app = App("bench-console", settings=Settings(redis_url=url), store=store)
            for q in range(10):  # the console shows the app's handler queues

                async def work(task: dict[str, int]) -> None:
                    return None

                app.handler(f"bench-q{q}")(work)
            web = create_console(app)
            transport = httpx.ASGITransport(app=web)
            print(
                f"\nconsole Tasks page: {indexed:,} tasks indexed in {filled_s:.1f} s; "
                f"pages of {PAGE}, {pages} each, in-process (server time, no network)"
            )
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:

                def get(path: str) -> Callable[[], Awaitable[Any]]:
                    async def call() -> None:
                        response = await c.get(path)
                        assert response.status_code == 200, response.text[:300]
                        assert response.text.count("data-task=") >= 1 or path.startswith("/api")

                    return call

                def index(query: TaskQuery) -> Callable[[], Awaitable[Any]]:
                    async def call() -> None:
                        page = await app.tasks(query)
                        assert len(page.tasks) == PAGE

                    return call

                dead = TaskStatus.DEAD_LETTERED
                rows: list[tuple[str, Callable[[], Awaitable[Any]], bool]] = [
                    ("App.tasks, newest 50 (baseline)", index(TaskQuery(limit=PAGE)), False),
                    ("GET /tasks (the whole page)", get("/tasks"), True),
                    ("GET /fragments/tasks (its live refresh)", get("/fragments/tasks"), True),
                    ("GET /api/tasks (JSON)", get("/api/tasks"), True),
                    ("App.tasks, one queue (baseline)", index(TaskQuery(queue="bench-q3")), False),
                    (
                        "GET /fragments/tasks?queue=bench-q3",
                        get("/fragments/tasks?queue=bench-q3"),
                        True,
                    ),
                    ("App.tasks, dead_lettered (baseline)", index(TaskQuery(status=dead)), False),
                    (
                        "GET /fragments/tasks?status=dead_lettered",
                        get("/fragments/tasks?status=dead_lettered"),
                        True,
                    ),
                ]
                print("| request | server ms (median, max) |")
                print("|---|---|")
                for name, call, held in rows:
                    times = await _times(pages, call)
                    if held and statistics.median(times) >= TARGET_MS:
                        met = False
                    print(f"| {name} | {statistics.median(times):.1f}, {max(times):.1f} |")
            await store.close()
        finally:
            await client.aclose()
    print(f"target: a console page < {TARGET_MS:.0f} ms (median): {'met' if met else 'MISSED'}")
    return met


POLL_S = 2.0  # the page's own pace (REFRESH_MS)


async def overview_load(url: str, seconds: float, consoles: list[int]) -> bool:
    client = aioredis.Redis.from_url(url)
    store = RedisTaskStore(client, ttl_s=86400, lease_s=30, done_ttl_s=86400)
    app = App("bench-console-overview", settings=Settings(redis_url=url), store=store)
    suffix = uuid.uuid4().hex[:8]
    for q in range(2):

        async def work(task: dict[str, int]) -> None:
            return None

        app.handler(f"bench-console-{suffix}-q{q}")(work)
    web = create_console(app)
    overview = web.state.console.overview
    reads = 0
    read = overview._read

    async def counted() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return await read()

    overview._read = counted  # count the reads: the benchmark's probe, not the console's
    print(
        f"\nconsole overview: N pages polling /api/overview every {POLL_S:g} s for "
        f"{seconds:g} s (2 handler queues on the shared broker, the registry in Redis)"
    )
    print("| open pages | requests | broker + Redis reads | Redis commands |")
    print("|---|---|---|---|")
    results: dict[int, int] = {}
    transport = httpx.ASGITransport(app=web)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            for n in consoles:
                reads = 0
                served = 0
                before = await _command_calls(client)
                end = time.monotonic() + seconds

                async def page(offset_s: float, end: float) -> None:
                    nonlocal served
                    # Pages opened at different moments, each then on the page's own pace.
                    await asyncio.sleep(offset_s)
                    while time.monotonic() < end:
                        response = await c.get("/api/overview")
                        assert response.status_code == 200, response.text[:300]
                        served += 1
                        await asyncio.sleep(POLL_S)

                await asyncio.gather(*(page(POLL_S * i / n, end) for i in range(n)))
                calls = await _command_calls(client) - before - 1  # less the INFO itself
                results[n] = reads
                print(f"| {n} | {served} | {reads} | {calls} |")
    finally:
        await app.close()
        await client.aclose()
    few, many = results[min(consoles)], results[max(consoles)]
    met = many <= few + 1  # a read in flight at the window's edge
    print(
        f"target: {max(consoles)} pages cause the reads 1 does ({many} vs {few}): "
        f"{'met' if met else 'MISSED'}"
    )
    return met


async def _command_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values() if isinstance(v, dict) and "calls" in v)


async def main(args: argparse.Namespace) -> None:
    await page_time(args.tasks, args.pages)
    with own_redis() as url:
        await overview_load(url, args.seconds, [1, args.consoles])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000, help="tasks indexed")
    parser.add_argument("--pages", type=int, default=20, help="requests timed per row")
    parser.add_argument("--consoles", type=int, default=20, help="open overview pages")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long they poll")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: that it runs")
    parsed = parser.parse_args()
    if parsed.smoke:
        parsed.tasks, parsed.pages, parsed.consoles, parsed.seconds = 20_000, 2, 3, 4.0
    asyncio.run(main(parsed))

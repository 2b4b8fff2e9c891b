"""A guarded worker's Redis connections do not grow with its concurrency (issue 25, item 7).

Every command of a delivery's path shares a bounded number of pooled connections: the store's
claims, finishes, records and lease renewals go through its auto-pipeline (one round trip at
a time), cancel requests through one subscription, ``ctx.emit``'s writes through at most
``streaming.redis.WRITES_IN_FLIGHT`` at once, a limit's admissions and releases through at
most ``llm.limiting.ROUND_TRIPS_IN_FLIGHT``. So concurrency 2,000 runs on a handful.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import wait_until
from weclaw_mq import App, Context, Limit, TaskStatus, Worker
from weclaw_mq.state import redis_clients
from weclaw_mq.state.redis_clients import client_name
from weclaw_mq.worker.consume import REDIS_CONNECTIONS_NEEDED

CONCURRENCY = 2000
# The target; and what the worker's three pools (task store, stream store, limiter)
# may take at most by the bound it checks at start.
MAX_CONNECTIONS = 64
POOLS_BOUND = 3 * REDIS_CONNECTIONS_NEEDED


async def _connections_named(redis_url: str, name: str) -> int:
    client = aioredis.Redis.from_url(redis_url)
    try:
        clients = await client.client_list()
    finally:
        await client.aclose()
    return sum(1 for c in clients if c.get("name") == name)


@pytest.mark.parametrize(
    ("limited", "guarded"),
    [(False, True), (True, True), (False, False)],
    ids=["guarded", "guarded-keyed-limit", "unguarded-results-on"],
)
async def test_a_worker_at_concurrency_2000_holds_at_most_64_redis_connections(
    make_app: Callable[..., App],
    qname: str,
    redis_url: str,
    limited: bool,
    guarded: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its clients get a name of their own: connections that earlier tests run by the same
    # pytest process left open (several files share one process in a full run) carry the
    # process's name, and are not this worker's.
    name = f"{client_name()}-{qname}"
    monkeypatch.setattr(redis_clients, "client_name", lambda: name)
    # Unguarded with results on, each delivery reads the cancel marker instead of claiming.
    # 2,000 confirms while the same broker delivers to 2,000 consumers' slots: the default
    # 10 s left 368 unconfirmed once under a loaded full run.
    app = make_app("conns", confirm_timeout_s=60.0)
    release = asyncio.Event()
    started = 0
    # 50 keys of 40 tasks each, every one admitted: 2,000 admissions and releases.
    limit = Limit(key=lambda task: task["n"] % 50, concurrency=100) if limited else None

    @app.handler(qname, idempotent=guarded, limit=limit)
    async def handle(task: dict[str, Any], ctx: Context) -> dict[str, int]:
        nonlocal started
        started += 1
        await ctx.emit("thinking")  # the stream store's write, too
        await release.wait()
        return {"n": task["n"]}

    worker = Worker(app, concurrency=CONCURRENCY)
    running = asyncio.create_task(worker.run())
    try:
        await wait_until(worker.ready.is_set, 30, "the worker to consume")
        ids = await app.publish_many(qname, [{"n": i} for i in range(CONCURRENCY)])
        await wait_until(
            lambda: started == CONCURRENCY and worker.in_flight == CONCURRENCY,
            120,
            f"{CONCURRENCY} handlers in flight",
        )
        # Every handler in flight has claimed (or read its cancel marker), written its
        # "running" record and emitted.
        used = await _connections_named(redis_url, name)
        assert 0 < used <= min(MAX_CONNECTIONS, POOLS_BOUND), f"{used} connections in flight"
        release.set()

        async def all_succeeded() -> bool:
            states = await asyncio.gather(*(app.status(t, queue=qname) for t in ids))
            return all(s is not None and s.status is TaskStatus.SUCCEEDED for s in states)

        deadline = asyncio.get_running_loop().time() + 120
        while not await all_succeeded():
            assert asyncio.get_running_loop().time() < deadline, "not every task succeeded"
            await asyncio.sleep(0.5)
        used = await _connections_named(redis_url, name)
        assert used <= min(MAX_CONNECTIONS, POOLS_BOUND), f"{used} connections at the end"
    finally:
        release.set()
        worker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 60)

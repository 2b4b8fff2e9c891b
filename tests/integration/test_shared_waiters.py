"""Waiters share connections: every ``result()`` and ``stream()`` of a process is woken through
one subscription (``state.redis_wakeups``) and reads through the store's shared connections,
so thousands of them fit a small pool, and ``publish`` and ``status()`` keep answering.

Connections are counted on the real Redis (``CLIENT LIST``), by a client name of the test's
own set in the URL (``?client_name=``): the pool names every connection it opens.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import SHORT_TTLS, close_apps, settings_for, wait_until
from weclaw_mq import App, TaskStatus
from weclaw_mq.contract.naming import done_channel, stream_key
from weclaw_mq.state import TaskState
from weclaw_mq.streaming import StreamEvent
from weclaw_mq.streaming.events import chunk_entry, encode_data

# A small pool: before, each waiter held one of these for its whole wait.
POOL = 8
WAITERS = 10_000
# One pub/sub connection, the auto-pipeline's one in flight, and a spare for a lone command.
MOST_CONNECTIONS = 4


class Job(BaseModel):
    n: int = 0


def _named(redis_url: str, name: str) -> str:
    return f"{redis_url}{'&' if '?' in redis_url else '?'}client_name={name}"


async def _connections(client: aioredis.Redis, name: str) -> int:
    return sum(1 for c in await client.client_list() if c.get("name") == name)


@pytest.fixture
async def named_app(broker_url: str, redis_url: str, qname: str) -> AsyncIterator[tuple[App, str]]:
    """An app whose Redis connections carry a name of this test's (and a pool of ``POOL``);
    closed, its queues and task keys deleted, at teardown."""
    name = f"t-waiters-{uuid.uuid4().hex[:8]}"
    settings = settings_for(
        broker_url, _named(redis_url, name), redis_max_connections=POOL, **SHORT_TTLS
    )
    app = App(qname, settings=settings)
    try:
        yield app, name
    finally:
        await close_apps([app], broker_url, redis_url)


async def test_ten_thousand_result_waiters_share_a_few_connections_and_publish_still_answers(
    named_app: tuple[App, str], qname: str, redis_url: str
) -> None:
    app, name = named_app

    @app.handler(qname)
    async def work(task: Job) -> None:  # declared, never consumed: the records are ours
        return None

    await app.declare()
    store = app.results
    assert store is not None
    ids = [uuid.uuid4().hex for _ in range(WAITERS)]
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
    waiters = [asyncio.ensure_future(app.result(t, queue=qname, timeout_s=120)) for t in ids]
    try:
        sample = [done_channel(t) for t in ids[:: WAITERS // 20]] + [done_channel(ids[-1])]

        async def subscribed_or_failed() -> bool:
            if any(w.done() for w in waiters):
                return True
            counts = await client.pubsub_numsub(*sample)
            return all(n >= 1 for _, n in counts)

        # The waiters are subscribed (the last of them too), or some failed.
        await wait_until(subscribed_or_failed, 60, "the waiters to subscribe")
        failed = [w for w in waiters if w.done()]
        assert not failed, f"{len(failed)} waiters ended early: {failed[0].exception()!r}"
        used = await _connections(client, name)
        assert 1 <= used <= MOST_CONNECTIONS, f"{WAITERS} waiters hold {used} connections"
        # The pool still serves everything else: a publish with its record, a status read.
        published = await asyncio.wait_for(app.publish(qname, Job(n=1)), 30)
        queued = await asyncio.wait_for(app.status(published, queue=qname), 30)
        assert queued is not None and queued.status is TaskStatus.QUEUED
        # Finals for all: every waiter is woken by its notification and answers succeeded.
        await store.record_many(
            [TaskState(task_id=t, queue=qname, status=TaskStatus.SUCCEEDED) for t in ids]
        )
        states = await asyncio.wait_for(asyncio.gather(*waiters), 60)
        assert {s.status for s in states} == {TaskStatus.SUCCEEDED}
        assert [s.task_id for s in states] == ids
        assert await _connections(client, name) <= MOST_CONNECTIONS
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await client.aclose()


READERS = 2_000


async def test_two_thousand_stream_readers_share_a_few_connections_and_each_gets_its_chunk(
    named_app: tuple[App, str], qname: str, redis_url: str
) -> None:
    app, name = named_app

    @app.handler(qname)
    async def work(task: Job) -> None:  # declared, never consumed: the writes are ours
        return None

    await app.declare()
    store = app.results
    assert store is not None
    ids = [uuid.uuid4().hex for _ in range(READERS)]
    await store.record_many(
        [TaskState(task_id=t, queue=qname, status=TaskStatus.QUEUED) for t in ids],
        only_if_new=True,
    )
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)

    async def read_all(task_id: str) -> list[StreamEvent]:
        return [e async for e in app.stream(task_id, queue=qname)]

    readers = [asyncio.ensure_future(read_all(t)) for t in ids]
    try:
        # Each reader watches its stream and waits for its task's final state.
        sample = [stream_key(t) for t in ids[:: READERS // 20]] + [stream_key(ids[-1])]
        sample += [done_channel(t) for t in ids[:: READERS // 20]]

        async def subscribed_or_failed() -> bool:
            if any(r.done() for r in readers):
                return True
            counts = await client.pubsub_numsub(*sample)
            return all(n >= 1 for _, n in counts)

        await wait_until(subscribed_or_failed, 60, "the readers to subscribe")
        failed = [r for r in readers if r.done()]
        assert not failed, f"{len(failed)} readers ended early: {failed[0].exception()!r}"
        # Two pools (the task store's and the stream store's), each a few connections.
        used = await _connections(client, name)
        assert 1 <= used <= 2 * MOST_CONNECTIONS, f"{READERS} readers hold {used} connections"
        assert (await asyncio.wait_for(app.status(ids[0], queue=qname), 30)) is not None
        # A chunk for each (one write each, as ctx.emit makes), then the final states.
        for task_id in ids:
            await app.streams.write(
                task_id, [chunk_entry(task_id, 1, encode_data(task_id))], session_id=None
            )
        await store.record_many(
            [TaskState(task_id=t, queue=qname, status=TaskStatus.SUCCEEDED) for t in ids]
        )
        streams = await asyncio.wait_for(asyncio.gather(*readers), 120)
        for task_id, events in zip(ids, streams, strict=True):
            assert [(e.kind, e.data) for e in events] == [("chunk", task_id), ("final", None)]
        assert await _connections(client, name) <= 2 * MOST_CONNECTIONS
    finally:
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await client.aclose()


async def test_waiters_outlive_their_subscription_connection_being_killed(
    named_app: tuple[App, str], qname: str, redis_url: str
) -> None:
    app, name = named_app
    store = app.results
    assert store is not None
    ids = [uuid.uuid4().hex for _ in range(50)]
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
    waiters = [asyncio.ensure_future(app.result(t, queue=qname, timeout_s=60)) for t in ids]
    try:

        async def subscriber() -> int | None:
            found = [
                int(c["id"])
                for c in await client.client_list()
                if c.get("name") == name and int(c.get("sub", 0)) > 0
            ]
            return found[0] if found else None

        await wait_until(subscriber, 30, "the waiters' subscription")
        killed = await subscriber()
        await client.execute_command("CLIENT", "KILL", "ID", str(killed))
        # Written while (or right after) the subscription is gone: each waiter still answers,
        # woken by the lost connection's re-read, its re-subscription or its poll.
        await store.record_many(
            [TaskState(task_id=t, queue=qname, status=TaskStatus.SUCCEEDED) for t in ids]
        )
        states = await asyncio.wait_for(asyncio.gather(*waiters), 30)
        assert {s.status for s in states} == {TaskStatus.SUCCEEDED}
        # And a waiter after that is woken by a subscription made again.
        late = uuid.uuid4().hex
        waiter = asyncio.ensure_future(app.result(late, queue=qname, timeout_s=60))
        await wait_until(subscriber, 30, "a new subscription")
        assert (await subscriber()) != killed
        await store.record(TaskState(task_id=late, queue=qname, status=TaskStatus.SUCCEEDED))
        assert (await asyncio.wait_for(waiter, 30)).status is TaskStatus.SUCCEEDED
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await client.aclose()

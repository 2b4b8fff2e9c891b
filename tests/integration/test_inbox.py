"""Per-session inbox (real broker, real Redis): replies wait for a client that is away, are
received oldest first, removed only once confirmed, bounded, and expire with a trace."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import wait_until
from weclaw_mq import App, Context, Reject, TaskState, TaskStatus
from weclaw_mq.contract.naming import inbox_key, inbox_trace_key, stream_key
from weclaw_mq.streaming import Inbox, MemoryStreamStore, StreamEvent
from weclaw_mq.streaming.events import Entry, chunk_entry, encode_data, final_entry
from weclaw_mq.streaming.protocol import LIVE_READ_BATCH
from weclaw_mq.streaming.reading import FINALS_KEPT


class Ask(BaseModel):
    n: int
    reject: bool = False


@pytest.fixture
async def session(redis_url: str) -> AsyncIterator[str]:
    """A session id of this test's own; its inbox keys are deleted at teardown."""
    session_id = f"s-{uuid.uuid4().hex[:12]}"
    yield session_id
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.delete(inbox_key(session_id), inbox_trace_key(session_id))
    finally:
        await client.aclose()


def replying_app(make_app: Callable[..., App], qname: str, **settings: object) -> App:
    app = make_app(**settings)

    @app.handler(qname, retry=None)
    async def reply(task: Ask, ctx: Context) -> dict[str, int]:
        await ctx.emit(f"thinking about {task.n}")
        if task.reject:
            raise Reject("no")
        return {"n": task.n}

    return app


async def publish_and_finish(app: App, qname: str, session_id: str, count: int) -> list[str]:
    ids = [await app.publish(qname, Ask(n=i), session_id=session_id) for i in range(count)]
    for task_id in ids:
        await app.result(task_id, timeout_s=20)
    return ids


async def take(inbox: Inbox, count: int, timeout_s: float = 20.0) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    async with asyncio.timeout(timeout_s):
        async for event in inbox:
            out.append(event)
            if len(out) == count:
                break
    return out


def finals(events: list[StreamEvent]) -> list[StreamEvent]:
    return [e for e in events if e.kind == "final"]


async def test_twenty_replies_wait_are_received_in_order_and_go_only_once_confirmed(
    make_app, start_worker, qname, session
):
    app = replying_app(make_app, qname)
    await start_worker(app)
    ids = await publish_and_finish(app, qname, session, 20)  # no client connected meanwhile

    # Each reply is its attempt marker, its chunk and its final: 60 events.
    first = await take(app.inbox(session), 60)
    assert [e.task_id for e in finals(first)] == ids
    assert [e.result for e in finals(first)] == [{"n": i} for i in range(20)]
    assert [(e.kind, e.data) for e in first[:3]] == [
        ("attempt", None),
        ("chunk", "thinking about 0"),
        ("final", None),
    ]
    await app.inbox(session).confirm(finals(first)[11].id)

    second = app.inbox(session)
    rest = await take(second, 24)
    assert [e.task_id for e in finals(rest)] == ids[12:]
    assert rest == first[36:]
    assert await second.pending() == rest
    await second.confirm(rest[-1].id)
    assert await app.inbox(session).pending() == []

    # Live: a client that is connected gets a new reply as it is written.
    live = asyncio.create_task(take(app.inbox(session), 3))
    [new_id] = await publish_and_finish(app, qname, session, 1)
    assert [e.task_id for e in await live] == [new_id] * 3


async def test_pending_replies_past_the_ttl_are_gone_and_an_expired_record_names_them(
    make_app, start_worker, qname, session
):
    app = replying_app(make_app, qname, inbox_ttl_s=0.3)
    await start_worker(app)
    ids = await publish_and_finish(app, qname, session, 3)
    inbox = app.inbox(session)

    async def all_expired() -> bool:
        # Entries expire as their time comes: one or more "expired" records, nothing else.
        pending = await inbox.pending()
        expired = [e.data for e in pending if e.kind == "expired"]
        return len(expired) == len(pending) and (
            [t for data in expired for t in data["tasks"]],
            sum(data["entries"] for data in expired),
        ) == (ids, 9)

    await wait_until(all_expired, timeout_s=10, what="the three replies to expire")


async def test_a_full_inbox_drops_its_oldest_entries_and_counts_them(
    make_app, start_worker, qname, session
):
    app = replying_app(make_app, qname, inbox_max_entries=5)
    await start_worker(app)
    ids = await publish_and_finish(app, qname, session, 3)
    pending = await app.inbox(session).pending()
    assert [(e.task_id, e.kind) for e in pending] == [
        (ids[1], "chunk"),
        (ids[1], "final"),
        (ids[2], "attempt"),
        (ids[2], "chunk"),
        (ids[2], "final"),
    ]
    assert await app.inbox(session).dropped() == 4


async def test_a_dead_lettered_task_ends_its_stream_and_reaches_the_inbox(
    make_app, start_worker, qname, session
):
    app = replying_app(make_app, qname)
    await start_worker(app)
    task_id = await app.publish(qname, Ask(n=1, reject=True), session_id=session)
    async with asyncio.timeout(20):
        events = [e async for e in app.stream(task_id)]
    assert [e.kind for e in events] == ["attempt", "chunk", "final"]
    assert (events[-1].status, events[-1].reason) == ("dead_lettered", "rejected")
    await wait_until(
        lambda: _has_final(app.inbox(session)), what="the dead-letter to reach the inbox"
    )
    [final] = finals(await app.inbox(session).pending())
    assert (final.task_id, final.status, final.reason) == (task_id, "dead_lettered", "rejected")


async def _has_final(inbox: Inbox) -> bool:
    return bool(finals(await inbox.pending()))


async def test_a_duplicate_copy_writes_the_final_again_and_readers_drop_it(
    make_app, start_worker, qname, session
):
    app = replying_app(make_app, qname)
    await start_worker(app)
    [task_id] = await publish_and_finish(app, qname, session, 1)
    # The same task again: the guard acks it unrun, and writes the stored final to the inbox
    # again (what a crash between storing the result and acking leads to).
    await app.publish(qname, Ask(n=0), task_id=task_id, session_id=session)
    await wait_until(
        lambda: _raw_finals(app, session, 2), what="the duplicate's final to be written"
    )
    assert [e.kind for e in await app.inbox(session).pending()] == ["attempt", "chunk", "final"]


async def _raw_finals(app: App, session_id: str, count: int) -> bool:
    events = await app.streams.read_inbox(session_id, "0-0", 0)
    return len(finals(events)) == count


def test_a_session_id_with_a_brace_is_refused_before_anything_is_sent(make_app, qname):
    app = replying_app(make_app, qname)
    with pytest.raises(Exception, match="session id"):
        app.prepare(qname, Ask(n=1), session_id="a{b}")


async def test_a_session_stream_remembers_a_bounded_number_of_finals_and_drops_a_recent_copy(
    make_app, session
):
    app = make_app()

    def final(n: int) -> Entry:
        state = TaskState(task_id=f"t{n}", queue="q", status=TaskStatus.SUCCEEDED, attempt=1)
        return final_entry(state)

    many = FINALS_KEPT * 3
    # Many replies over a stream's life, then a copy of the last one (a crashed worker's),
    # then one more reply.
    entries = [final(n) for n in range(many)] + [final(many - 1), final(many)]
    await app.streams.deliver(session, entries)
    events = aiter(app.inbox(session))
    got = [await anext(events) for _ in range(many + 1)]
    # The copy was dropped; what the reader keeps to drop copies is bounded, not one entry
    # per final it ever yielded (read from the generator's frame: no API exposes it).
    assert [e.task_id for e in got] == [f"t{n}" for n in range(many + 1)]
    seen = events.ag_frame.f_locals["finals"]  # type: ignore[attr-defined]
    assert len(seen) <= FINALS_KEPT
    await events.aclose()  # type: ignore[attr-defined]


async def test_a_live_reader_reads_a_few_dozen_entries_at_a_time_from_either_store(
    make_app, session, redis_url
):
    # What a live reader read waits in its memory until its consumer takes it (an SSE
    # client may never): it asks for LIVE_READ_BATCH at a time, and both stores keep that.
    entries = [chunk_entry(f"t{n}", 1, encode_data("w")) for n in range(LIVE_READ_BATCH * 3)]
    task_id = f"task-of-{session}"
    try:
        for streams in (make_app().streams, MemoryStreamStore()):
            await streams.deliver(session, entries)
            batch = await streams.read_inbox(session, "0-0", 0, count=LIVE_READ_BATCH)
            assert [e.task_id for e in batch] == [f"t{n}" for n in range(LIVE_READ_BATCH)]
            await streams.write(task_id, entries, session_id=None)
            read = await streams.read(task_id, "0-0", 0, count=LIVE_READ_BATCH)
            assert len(read) == LIVE_READ_BATCH
    finally:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await client.delete(stream_key(task_id))
        finally:
            await client.aclose()

"""Streamed partial output: ``ctx.emit`` in a handler, ``App.stream`` anywhere (real broker,
real Redis). A stream read live, late, and resumed from every event id gives exactly the
chunks in order, and always ends with the final event."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import collect, delete_queues, running_private_redis, settings_for
from tests.integration.fixture_apps.worker_app import Job
from tests.integration.processes import queue_names
from tests.private_servers import PrivateRedis
from weclaw_mq import App, Context, MemoryTaskStore, Retry
from weclaw_mq.contract.naming import stream_key
from weclaw_mq.errors import StreamLimitError
from weclaw_mq.state import TaskState, TaskStatus
from weclaw_mq.streaming import MemoryStreamStore, StreamEvent
from weclaw_mq.streaming.emitter import MAX_IN_FLIGHT_BYTES
from weclaw_mq.streaming.events import final_entry, id_key


class Words(BaseModel):
    words: list[str]
    fail_first: bool = False


def texts(events: list[StreamEvent]) -> list[Any]:
    return [e.data for e in events if e.kind == "chunk"]


def add_speaker(app: App, qname: str, gate: asyncio.Event | None = None) -> None:
    """A handler that emits each word; with ``gate``, it waits after the second word."""

    @app.handler(qname)
    async def speak(task: Words, ctx: Context) -> dict[str, str]:
        for i, word in enumerate(task.words):
            await ctx.emit(word)
            if gate is not None and i == 1:
                await gate.wait()  # readers connect mid-stream
        if task.fail_first and ctx.attempt == 1:
            raise Retry("first attempt fails after streaming")
        return {"text": " ".join(task.words)}


def streaming_app(
    make_app: Callable[..., App], qname: str, gate: asyncio.Event | None = None
) -> App:
    app = make_app(retry_delay_s=0.05)
    add_speaker(app, qname, gate)
    return app


# The events of a task whose first run fails after emitting "a" and "b", less the final.
RETRIED_RUNS = [
    ("attempt", 1, None),
    ("chunk", 1, "a"),
    ("chunk", 1, "b"),
    ("attempt", 2, None),
    ("chunk", 2, "a"),
    ("chunk", 2, "b"),
]


async def test_a_stream_read_live_late_and_resumed_from_every_id_gives_the_chunks_once(
    make_app, start_worker, qname
):
    gate = asyncio.Event()
    app = streaming_app(make_app, qname, gate)
    await start_worker(app)
    words = [f"w{i}" for i in range(12)]
    task_id = await app.publish(qname, Words(words=words))
    live = asyncio.create_task(collect(app.stream(task_id)))
    await asyncio.sleep(0)
    gate.set()
    live_events = await live
    late_events = await collect(app.stream(task_id))

    assert [e.kind for e in live_events] == ["attempt"] + ["chunk"] * 12 + ["final"]
    assert texts(live_events) == words
    assert live_events == late_events
    final = live_events[-1]
    assert (final.status, final.result) == ("succeeded", {"text": " ".join(words)})
    ids = [e.id for e in live_events]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    for n, event in enumerate(live_events):
        assert await collect(app.stream(task_id, after=event.id)) == live_events[n + 1 :]


async def test_a_retried_attempt_is_marked_and_its_final_comes(make_app, start_worker, qname):
    app = streaming_app(make_app, qname)
    await start_worker(app)
    task_id = await app.publish(qname, Words(words=["a", "b"], fail_first=True))
    events = await collect(app.stream(task_id))
    assert [(e.kind, e.attempt, e.data) for e in events[:-1]] == RETRIED_RUNS
    assert (events[-1].kind, events[-1].status, events[-1].attempt) == ("final", "succeeded", 2)


def shown_text(events: list[StreamEvent]) -> list[Any]:
    """What a client shows: the chunks since the last "attempt" marker."""
    shown: list[Any] = []
    for event in events:
        if event.kind == "attempt":
            shown = []
        elif event.kind == "chunk":
            shown.append(event.data)
    return shown


async def test_a_worker_killed_mid_stream_streams_again_under_a_new_marker(open_fleet, qname):
    words = [f"word{i}" for i in range(20)]
    async with open_fleet(
        guard_lease_s=1.0,  # the dead worker's claim lapses fast
        retry_delay_s=0.2,
    ) as fleet:
        first = await fleet.start_consuming(mode="stream", sleep_s=0.05)
        task_id = await fleet.app.publish(qname, Job(text=" ".join(words)))
        events: list[StreamEvent] = []
        async with asyncio.timeout(30):
            stream = fleet.app.stream(task_id)
            async for event in stream:
                events.append(event)
                if len(texts(events)) == 5:
                    first.kill()  # SIGKILL mid-stream
                    await fleet.start_consuming(mode="stream", sleep_s=0.01)
            # (the loop ends at the final event)
    markers = [i for i, e in enumerate(events) if e.kind == "attempt"]
    assert len(markers) == 2, [e.kind for e in events]
    killed_run = texts(events[markers[0] : markers[1]])
    assert len(killed_run) >= 5 and killed_run == words[: len(killed_run)]
    assert texts(events[markers[1] :]) == words
    assert shown_text(events) == words
    final = events[-1]
    assert (final.kind, final.status, final.result) == (
        "final",
        "succeeded",
        {"echo": " ".join(words)},
    )


class TestARedisRestart:
    """A private Redis, restarted (stopped with SIGTERM, started again on the same socket):
    with ``appendonly yes`` the stream is all there; without AOF (and no RDB) it is gone."""

    @pytest.fixture(params=[True, False], ids=["aof", "no-aof"])
    def restartable(self, request, private_servers) -> Iterator[PrivateRedis]:
        yield from running_private_redis(private_servers, appendonly=request.param)

    @pytest.fixture
    def redis_url(self, restartable: PrivateRedis) -> str:
        return restartable.url

    async def test_the_stream_survives_only_with_aof(
        self, make_app, start_worker, qname, restartable
    ):
        app = streaming_app(make_app, qname)
        await start_worker(app)
        task_id = await app.publish(qname, Words(words=["kept", "on", "disk"]))
        before = await collect(app.stream(task_id))
        assert texts(before) == ["kept", "on", "disk"]
        await asyncio.to_thread(restartable.stop)
        await asyncio.to_thread(restartable.start)
        after = await app.streams.read(task_id, "0-0", 0)
        assert after == (before if restartable.appendonly else [])


@pytest.fixture
async def memory_app(broker_url: str, qname: str) -> AsyncIterator[tuple[App, list[float]]]:
    """An App on MemoryTaskStore and MemoryStreamStore, and the stream store's clock.
    Requested before ``start_worker``, it is torn down after the worker stopped."""
    now = [1_000_000.0]
    streams = MemoryStreamStore(inbox_ttl_s=60, clock=lambda: now[0])
    settings = settings_for(broker_url, "redis://unused:1/0", retry_delay_s=0.05)
    app = App("memory", settings=settings, store=MemoryTaskStore(), streams=streams)
    yield app, now
    await app.close()
    await delete_queues(broker_url, queue_names(app))


def without_ids(events: list[StreamEvent]) -> list[StreamEvent]:
    return [dataclasses.replace(e, id="") for e in events]


async def test_the_memory_stores_keep_the_same_rules(memory_app, start_worker, qname):
    app, now = memory_app
    add_speaker(app, qname)
    await start_worker(app)
    task_id = await app.publish(qname, Words(words=["a", "b"], fail_first=True), session_id="s1")
    events = await collect(app.stream(task_id))
    assert [(e.kind, e.attempt, e.data) for e in events[:-1]] == RETRIED_RUNS
    assert (events[-1].kind, events[-1].attempt, events[-1].result) == ("final", 2, {"text": "a b"})
    for n, event in enumerate(events):
        assert await collect(app.stream(task_id, after=event.id)) == events[n + 1 :]
    inbox = app.inbox("s1")
    pending = await inbox.pending()
    assert without_ids(pending) == without_ids(events)
    await inbox.confirm(pending[2].id)
    assert await inbox.pending() == pending[3:]
    now[0] += 61
    [expired] = await inbox.pending()
    assert (expired.kind, expired.data) == ("expired", {"tasks": [task_id], "entries": 4})


async def test_a_chunk_over_the_bounds_raises_in_the_handler_and_is_not_written(
    make_app, start_worker, qname
):
    app = make_app(stream_max_chunk_bytes=10, stream_max_chunks=2)
    refused: list[str] = []

    @app.handler(qname)
    async def speak(task: Words, ctx: Context) -> str:
        for chunk in task.words:
            try:
                await ctx.emit(chunk)
            except (StreamLimitError, TypeError) as e:
                refused.append(f"{type(e).__name__}: {e}")
        with contextlib.suppress(TypeError):
            await ctx.emit(object())  # not JSON
        try:
            await ctx.emit(float("nan"))  # no JSON form (it used to be written as null)
        except TypeError as e:
            refused.append(f"{type(e).__name__}: {e}")
        return "done"

    await start_worker(app)
    task_id = await app.publish(qname, Words(words=["short", "x" * 20, "ok", "third"]))
    events = await collect(app.stream(task_id))
    assert texts(events) == ["short", "ok"]
    assert refused == [
        "StreamLimitError: a chunk of 22 bytes (as JSON) is over the limit of 10 "
        "(WECLAW_MQ_STREAM_MAX_CHUNK_BYTES)",
        "StreamLimitError: a run may emit at most 2 chunks (WECLAW_MQ_STREAM_MAX_CHUNKS)",
        "TypeError: ctx.emit takes str or JSON data: NaN and infinities have no JSON form; "
        "send null or a string",
    ]


async def test_a_task_the_broker_expires_unrun_ends_its_stream_as_expired(make_app, qname):
    app = streaming_app(make_app, qname)
    await app.declare()  # no worker: the broker expires the task at the head of Q
    task_id = await app.publish(qname, Words(words=["never"]), ttl_s=0.3)
    events = await collect(app.stream(task_id))
    assert [(e.kind, e.status, e.reason) for e in events] == [("final", "expired", "expired")]


async def test_readers_racing_to_end_a_stream_write_one_final_and_a_new_run_gets_its_own(
    make_app, qname, redis_url
):
    app = make_app()
    streams = app.streams
    state = TaskState(task_id=f"race-{qname}", queue=qname, status=TaskStatus.DEAD_LETTERED)
    try:
        ids = await asyncio.gather(
            *(streams.end(state.task_id, final_entry(state)) for _ in range(5))
        )
        assert len(set(ids)) == 1
        # Run again (an ops requeue) and ended otherwise: a new final.
        again = state.model_copy(update={"status": TaskStatus.SUCCEEDED, "result": 1})
        assert id_key(await streams.end(state.task_id, final_entry(again))) > id_key(ids[0])
        events = await streams.read(state.task_id, "0-0", 0)
        assert [(e.kind, e.status) for e in events] == [
            ("final", "dead_lettered"),
            ("final", "succeeded"),
        ]
    finally:
        client = aioredis.Redis.from_url(redis_url)
        await client.delete(stream_key(state.task_id))
        await client.aclose()


async def test_a_handler_emitting_faster_than_redis_waits_with_a_bounded_backlog(
    make_app, start_worker, qname
):
    # Big chunks back to back, with no pause: Redis cannot take them as fast as emit returns.
    chunk = "x" * 60_000
    count = 200
    app = make_app()

    @app.handler(qname)
    async def flood(task: Words, ctx: Context) -> int:
        assert ctx.emitter is not None
        peak = 0
        for _ in range(count):
            await ctx.emit(chunk)
            peak = max(peak, ctx.emitter.in_flight_bytes)  # in flight only grows in emit
        return peak

    await start_worker(app)
    task_id = await app.publish(qname, Words(words=[]))
    state = await app.result(task_id, timeout_s=60)
    assert 0 < state.result <= MAX_IN_FLIGHT_BYTES, state.result
    # Slowed to Redis's pace, not cut short: every chunk is in the stream, in order.
    events = await collect(app.stream(task_id), timeout_s=60)
    assert texts(events) == [chunk] * count

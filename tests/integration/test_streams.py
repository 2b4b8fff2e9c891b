"""Streamed partial output: ``ctx.emit`` in a handler, ``App.stream`` anywhere (real broker,
real Redis). A stream read live, late, and resumed from every event id gives exactly the
chunks in order, and always ends with the final event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from weclaw_mq import App, Context, Retry
from weclaw_mq.streaming import StreamEvent


class Words(BaseModel):
    words: list[str]
    fail_first: bool = False


async def collect(events: AsyncIterator[StreamEvent], timeout_s: float = 20.0) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    async with asyncio.timeout(timeout_s):
        async for event in events:
            out.append(event)
    return out


def texts(events: list[StreamEvent]) -> list[Any]:
    return [e.data for e in events if e.kind == "chunk"]


def streaming_app(
    make_app: Callable[..., App], qname: str, gate: asyncio.Event | None = None
) -> App:
    app = make_app(retry_delay_s=0.05)

    @app.handler(qname)
    async def speak(task: Words, ctx: Context) -> dict[str, str]:
        for i, word in enumerate(task.words):
            await ctx.emit(word)
            if gate is not None and i == 1:
                await gate.wait()  # readers connect mid-stream
        if task.fail_first and ctx.attempt == 1:
            raise Retry("first attempt fails after streaming")
        return {"text": " ".join(task.words)}

    return app


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
    assert [(e.kind, e.attempt, e.data) for e in events[:-1]] == [
        ("attempt", 1, None),
        ("chunk", 1, "a"),
        ("chunk", 1, "b"),
        ("attempt", 2, None),
        ("chunk", 2, "a"),
        ("chunk", 2, "b"),
    ]
    assert (events[-1].kind, events[-1].status, events[-1].attempt) == ("final", "succeeded", 2)

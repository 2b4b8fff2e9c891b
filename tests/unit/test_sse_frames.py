"""The example API's Server-Sent Events framing (``producers.sse``), without a server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from producers.sse import KEEPALIVE_FRAME, RECONNECT_MS, event_frames, frame
from weclaw_mq.streaming.events import StreamEvent

CHUNK = StreamEvent(id="17-0", kind="chunk", task_id="t1", attempt=2, data="Hello ")
FINAL = StreamEvent(id="17-1", kind="final", task_id="t1", attempt=2, status="succeeded")
RETRY_LINE = b"retry: %d\n\n" % RECONNECT_MS


def test_a_frame_carries_the_id_the_kind_and_the_event_as_one_json_line() -> None:
    raw = frame(CHUNK)

    head, data = raw.removesuffix(b"\n\n").rsplit(b"\n", 1)
    assert head == b"id: 17-0\nevent: chunk"
    assert data.startswith(b"data: ")
    assert json.loads(data.removeprefix(b"data: ")) == {
        "id": "17-0",
        "kind": "chunk",
        "task_id": "t1",
        "attempt": 2,
        "data": "Hello ",
    }


def test_a_chunk_with_newlines_stays_on_one_data_line() -> None:
    event = StreamEvent(id="1-0", kind="chunk", task_id="t", data="two\nlines\r\n")

    raw = frame(event)

    assert raw.count(b"\n") == 4  # id, event, data, and the blank line ending the frame
    assert json.loads(raw.split(b"data: ")[1])["data"] == "two\nlines\r\n"


async def collect(frames: AsyncGenerator[bytes, None], until: int) -> list[bytes]:
    got: list[bytes] = []
    async for raw in frames:
        got.append(raw)
        if len(got) == until:
            break
    return got


async def test_a_task_stream_ends_after_its_final_event() -> None:
    async def events() -> AsyncIterator[StreamEvent]:
        yield CHUNK
        yield FINAL
        raise AssertionError("read past the final event")

    got = [raw async for raw in event_frames(events(), end_on_final=True)]

    assert got == [RETRY_LINE, frame(CHUNK), frame(FINAL)]


async def test_a_quiet_source_gets_keep_alive_comments_and_its_read_is_not_cut() -> None:
    more = asyncio.Event()

    async def events() -> AsyncIterator[StreamEvent]:
        yield CHUNK
        await more.wait()  # quiet, like an inbox with nothing new
        yield FINAL

    frames = event_frames(events(), keepalive_s=0.01)
    got = await collect(frames, until=4)
    more.set()
    got += await collect(frames, until=1)
    await frames.aclose()

    assert got == [RETRY_LINE, frame(CHUNK), KEEPALIVE_FRAME, KEEPALIVE_FRAME, frame(FINAL)]


async def test_a_failing_source_ends_the_response_cleanly_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def events() -> AsyncIterator[StreamEvent]:
        yield CHUNK
        raise ConnectionError("redis went away")

    got = [raw async for raw in event_frames(events())]

    assert got == [RETRY_LINE, frame(CHUNK)]
    assert "ConnectionError: redis went away" in caplog.text


async def test_a_client_gone_closes_the_source() -> None:
    closed = asyncio.Event()

    async def events() -> AsyncIterator[StreamEvent]:
        try:
            yield CHUNK
            await asyncio.Event().wait()  # never more
        finally:
            closed.set()

    frames = event_frames(events())
    await collect(frames, until=2)
    await frames.aclose()

    assert closed.is_set()

"""Server-Sent Events framing for the example API: stream events become ``text/event-stream``.

Why SSE and not a WebSocket: the traffic is one way (the server tells, the browser listens;
prompts go in with a plain ``POST /tasks``), and resuming is built in. Every frame carries
the event's id; a browser's ``EventSource`` reconnects by itself after a dropped connection
and sends the last id it saw in the ``Last-Event-ID`` header, which is exactly the ``after=``
a task stream and an inbox take. A WebSocket would need our own reconnect loop, our own
"last id" message and our own keep-alives, and it does not pass through every HTTP proxy
the way a long GET response does.

``event_frames`` turns an async iterator of ``StreamEvent`` into frames. It reads the source
in a task of its own, so it can write a keep-alive comment while the source is quiet (a
proxy or the browser would otherwise close an idle connection) without cancelling the
source's read half-way.

What one client costs is bounded, however slowly it reads: the reader stops reading when
``buffer_bytes`` of frames wait for the client (the source itself reads a few dozen events
at a time, ``LIVE_READ_BATCH``), and the server's socket buffer stops taking frames at its
high-water mark. A client that takes nothing for ``stall_s`` (its socket full all along:
a tab in the background of a stalled laptop, or a hostile client that never reads) is
dropped: the response stops, its reader and buffers are released, and the server closes
the connection (uvicorn logs "ASGI callable returned without completing response").
``EventStreams`` holds these bounds and counts the clients, per API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import pydantic_core
from fastapi.responses import StreamingResponse
from starlette.types import Send

from weclaw_mq import StreamEvent
from weclaw_mq.streaming.events import FINAL

log = logging.getLogger("producers.sse")

MEDIA_TYPE = "text/event-stream"
# No proxy buffering (nginx reads X-Accel-Buffering), no cache: each frame goes out as written.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# How long EventSource waits before reconnecting (its default is about 3 s).
RECONNECT_MS = 1000
KEEPALIVE_S = 15.0
KEEPALIVE_FRAME = b": keep-alive\n\n"
# Frames read ahead of one client: the reader waits while this many bytes wait for it.
BUFFER_BYTES = 64 * 1024
# A client whose socket took nothing for this long is dropped (two keep-alives' worth).
STALL_S = 30.0


@dataclass
class EventStreams:
    """The bounds of one API's event streams, and what they did (for its tests and logs):
    ``open`` responses, clients ``dropped`` for not reading, and ``peak_buffered``, the
    most bytes of frames that ever waited for one client."""

    buffer_bytes: int = BUFFER_BYTES
    stall_s: float = STALL_S
    open: int = 0
    dropped: int = 0
    peak_buffered: int = 0


def frame(event: StreamEvent) -> bytes:
    """One SSE frame: ``id``, ``event`` (the kind) and the event as one line of JSON."""
    fields = {k: v for k, v in dataclasses.asdict(event).items() if v is not None}
    data = pydantic_core.to_json(fields)
    return b"id: %s\nevent: %s\ndata: %s\n\n" % (event.id.encode(), event.kind.encode(), data)


class EventStreamResponse(StreamingResponse):
    """``event_frames`` as a response that drops a client whose socket takes nothing for
    ``streams.stall_s``, and counts it in ``streams``."""

    def __init__(
        self,
        events: AsyncIterator[StreamEvent],
        streams: EventStreams,
        *,
        end_on_final: bool = False,
    ) -> None:
        self._streams = streams
        frames = event_frames(events, end_on_final=end_on_final, streams=streams)
        super().__init__(frames, media_type=MEDIA_TYPE, headers=HEADERS)

    async def stream_response(self, send: Send) -> None:
        streams = self._streams
        streams.open += 1
        frames = self.body_iterator
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in frames:
                body = {"type": "http.response.body", "body": chunk, "more_body": True}
                try:
                    # The server's send waits while the socket's buffer is full.
                    async with asyncio.timeout(streams.stall_s):
                        await send(body)
                except TimeoutError:
                    streams.dropped += 1
                    log.warning(
                        "dropped an event stream client that read nothing for %.3g s",
                        streams.stall_s,
                    )
                    return  # unfinished: the server closes the connection
                # Frames already buffered come without a wait: let the loop run between
                # two, so a connection lost after one write is seen before the next.
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            streams.open -= 1
            aclose = getattr(frames, "aclose", None)
            if aclose is not None:
                # Its reader stops now, not when the collector finds it; shielded, as a
                # client gone cancels this response's every await.
                await asyncio.shield(aclose())


async def event_frames(
    events: AsyncIterator[StreamEvent],
    *,
    end_on_final: bool = False,
    keepalive_s: float = KEEPALIVE_S,
    streams: EventStreams | None = None,
) -> AsyncGenerator[bytes, None]:
    """The frames of ``events`` (after a ``retry:`` line), with a keep-alive comment
    whenever the source was quiet for ``keepalive_s``; at most ``streams.buffer_bytes`` of
    frames are read ahead of the consumer (one larger frame alone).

    ``end_on_final``: stop after the first "final" event (a task stream ends there).
    """
    streams = streams or EventStreams()
    ready = FrameBuffer(streams)
    reader = asyncio.create_task(_read(events, ready, end_on_final))
    try:
        yield b"retry: %d\n\n" % RECONNECT_MS
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    raw = await ready.get()
            except TimeoutError:
                yield KEEPALIVE_FRAME
                continue
            if raw is None:
                await asyncio.wait({reader})  # it is closing its source
                if (error := reader.exception()) is not None:
                    # Ended cleanly, the response makes EventSource reconnect (after
                    # RECONNECT_MS) with Last-Event-ID: a Redis blip costs a resume, no more.
                    log.warning("event stream ended early: %s: %s", type(error).__name__, error)
                return
            yield raw
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader


class FrameBuffer:
    """Frames waiting for one client, oldest first, at most ``streams.buffer_bytes`` (a
    frame larger than that waits alone); ``None`` marks the end of the source."""

    def __init__(self, streams: EventStreams) -> None:
        self._streams = streams
        self._frames: deque[bytes | None] = deque()
        self.size = 0
        # One event for both sides: a buffer is never both empty and full, so only one
        # side ever waits on it.
        self._changed = asyncio.Event()

    async def put(self, raw: bytes | None) -> None:
        n = 0 if raw is None else len(raw)
        while self.size and self.size + n > self._streams.buffer_bytes:
            await self._wait()
        self._frames.append(raw)
        self.size += n
        if self.size > self._streams.peak_buffered:
            self._streams.peak_buffered = self.size
        self._changed.set()

    async def get(self) -> bytes | None:
        while not self._frames:
            await self._wait()
        raw = self._frames.popleft()
        self.size -= 0 if raw is None else len(raw)
        self._changed.set()
        return raw

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()


async def _read(events: AsyncIterator[StreamEvent], ready: FrameBuffer, end_on_final: bool) -> None:
    # None tells event_frames the source ended; if it failed, event_frames reads the error
    # from this task's result. Cancelled, it puts nothing: nobody is reading any more.
    try:
        async for event in events:
            await ready.put(frame(event))
            if end_on_final and event.kind == FINAL:
                break
    except Exception:
        await ready.put(None)
        raise
    finally:
        # Cancelled between two events, the source is suspended at its yield: close it now,
        # not when the garbage collector finds it.
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
    await ready.put(None)

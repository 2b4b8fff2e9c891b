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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import pydantic_core

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
# Events read ahead of the client: the source waits when the client is this far behind.
READ_AHEAD = 64


def frame(event: StreamEvent) -> bytes:
    """One SSE frame: ``id``, ``event`` (the kind) and the event as one line of JSON."""
    fields = {k: v for k, v in dataclasses.asdict(event).items() if v is not None}
    data = pydantic_core.to_json(fields)
    return b"id: %s\nevent: %s\ndata: %s\n\n" % (event.id.encode(), event.kind.encode(), data)


async def event_frames(
    events: AsyncIterator[StreamEvent],
    *,
    end_on_final: bool = False,
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncGenerator[bytes, None]:
    """The frames of ``events`` (after a ``retry:`` line), with a keep-alive comment
    whenever the source was quiet for ``keepalive_s``.

    ``end_on_final``: stop after the first "final" event (a task stream ends there).
    """
    ready: asyncio.Queue[StreamEvent | None] = asyncio.Queue(maxsize=READ_AHEAD)
    reader = asyncio.create_task(_read(events, ready))
    try:
        yield b"retry: %d\n\n" % RECONNECT_MS
        while True:
            try:
                event = await asyncio.wait_for(ready.get(), keepalive_s)
            except TimeoutError:
                yield KEEPALIVE_FRAME
                continue
            if event is None:
                await asyncio.wait({reader})  # it is closing its source
                if (error := reader.exception()) is not None:
                    # Ended cleanly, the response makes EventSource reconnect (after
                    # RECONNECT_MS) with Last-Event-ID: a Redis blip costs a resume, no more.
                    log.warning("event stream ended early: %s: %s", type(error).__name__, error)
                return
            yield frame(event)
            if end_on_final and event.kind == FINAL:
                return
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader


async def _read(
    events: AsyncIterator[StreamEvent], ready: asyncio.Queue[StreamEvent | None]
) -> None:
    # None tells event_frames the source ended; if it failed, event_frames reads the error
    # from this task's result. Cancelled, it puts nothing: nobody is reading any more.
    try:
        async for event in events:
            await ready.put(event)
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

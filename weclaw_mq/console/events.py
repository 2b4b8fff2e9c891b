"""A task's stream (``App.stream``) relayed to the page as Server-Sent Events: one SSE event
per stream event, named by its kind (``attempt``, ``chunk``, ``final``), its stream id as the
SSE ``id``, so a browser that reconnects (``Last-Event-ID``) resumes with exactly the events
after the last it got. The response ends after the final event, or after one ``problem``
event when the stream cannot be read (results off, Redis away).

A task not known yet is waited for (``App.stream`` does); a comment line every
``KEEPALIVE_S`` keeps proxies from closing a quiet stream, and tells the server when the
page went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator

from weclaw_mq.app import App
from weclaw_mq.errors import WeclawMQError
from weclaw_mq.streaming.events import FINAL, StreamEvent

KEEPALIVE_S = 15.0


def sse_frame(event: StreamEvent) -> str:
    """One event as an SSE frame (``data`` is the event as JSON, on one line)."""
    document = dataclasses.asdict(event)
    data = json.dumps(document, default=str, separators=(",", ":"))
    return f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n"


async def relay(
    app: App, task_id: str, *, queue: str | None, after: str | None
) -> AsyncIterator[str]:
    """The SSE text of the task's events after ``after``, then live, to its final event."""
    events = app.stream(task_id, after, queue=queue).__aiter__()
    pending: asyncio.Task[StreamEvent] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield ": keepalive\n\n"
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            except WeclawMQError as e:  # results off, Redis away: say so, and stop
                yield f"event: problem\ndata: {json.dumps({'error': str(e)})}\n\n"
                return
            finally:
                pending = None
            yield sse_frame(event)
            if event.kind == FINAL:
                return
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        closing = getattr(events, "aclose", None)
        if closing is not None:
            with contextlib.suppress(Exception):
                await closing()

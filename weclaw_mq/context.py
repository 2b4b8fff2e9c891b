"""The typed context a handler receives as its second argument."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import StreamWriteError

if TYPE_CHECKING:
    from .app import App
    from .streaming.emitter import Emitter


@dataclass(frozen=True)
class Context:
    task_id: str
    trace_id: str
    queue: str
    attempt: int
    redelivered: bool
    headers: Mapping[str, Any]
    app: App = field(repr=False)
    # Every line logged through it (or any logger, via TraceLogFilter) carries the task's ids.
    logger: logging.Logger = field(default=logging.getLogger("weclaw_mq.handler"), repr=False)
    # The session (user or conversation) the task was published for, if any: its streamed
    # chunks and final reply also go to that session's inbox.
    session_id: str | None = None
    # Writes this run's chunks (``emit``); the worker sets it, and drains it before storing
    # the result.
    emitter: Emitter | None = field(default=None, repr=False)
    # Set when the task is cancelled (``App.cancel``); the handler is then cancelled too
    # (a CancelledError at its next await), and may wait on this in a task of its own.
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        """Was the task cancelled (``App.cancel``)? Its outcome no longer counts."""
        return self.cancel_requested.is_set()

    async def publish(self, queue: str, payload: Any, **kwargs: Any) -> str:
        """Publish a follow-up task; it inherits this task's trace id."""
        return await self.app.publish(queue, payload, trace_id=self.trace_id, **kwargs)

    async def emit(self, chunk: Any) -> None:
        """Stream a piece of partial output (str or JSON data) to ``App.stream(task_id)``
        readers, and to the session's inbox. Returns at once: chunks are written in order in
        the background, all of them before the result is stored.

        ``StreamLimitError`` for a chunk over ``stream_max_chunk_bytes`` (as JSON) or past
        ``stream_max_chunks`` in this run; ``StreamWriteError`` once an earlier write failed
        (let it fail the attempt: the retry streams again under a new "attempt" marker).
        """
        if self.emitter is None:
            raise StreamWriteError("this context has no stream (it was not built by a worker)")
        await self.emitter.emit(chunk)

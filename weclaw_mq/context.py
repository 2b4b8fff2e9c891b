"""The typed context a handler receives as its second argument."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weclaw_mq.errors import StreamWriteError

if TYPE_CHECKING:
    from weclaw_mq.app import App
    from weclaw_mq.streaming.emitter import Emitter


@dataclass(frozen=True)
class Context:
    """What a handler knows about the task it runs; the worker builds it.

    Args:
        task_id: The task's id.
        trace_id: The task's trace id, inherited by the tasks it publishes.
        queue: The handler queue.
        attempt: This attempt's number (1 = the first run).
        redelivered: Whether the broker delivered this message before.
        headers: The message's AMQP headers.
        app: The App that runs the handler.
        logger: Every line logged through it (or any logger, via ``TraceLogFilter``)
            carries the task's ids.
        session_id: The session (user or conversation) the task was published for, if any:
            its streamed chunks and final reply also go to that session's inbox.
        emitter: Writes this run's chunks (``emit``); the worker sets it, and drains it
            before storing the result.
        cancel_requested: Set when the task is cancelled (``App.cancel``); the handler is
            then cancelled too (a ``CancelledError`` at its next await), and may wait on
            this in a task of its own.
    """

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
        """Publish a follow-up task; it inherits this task's trace id.

        Args:
            queue: The handler queue of the follow-up task.
            payload: The task.
            **kwargs: The other options of ``App.publish`` (``trace_id`` excepted).

        Returns:
            The follow-up task's id.

        Raises:
            ConfigurationError: As ``App.publish`` raises it (and its subclasses).
            PayloadError: As ``App.publish`` raises it (and its subclasses).
            PublishFailedError: As ``App.publish`` raises it (and its subclasses).
        """
        return await self.app.publish(queue, payload, trace_id=self.trace_id, **kwargs)

    async def emit(self, chunk: Any) -> None:
        """Stream a piece of partial output to ``App.stream(task_id)`` readers and the inbox.

        The session's inbox gets it too. Chunks are written in order in the background, all
        of them before the result is stored. It returns at once, unless 1 MiB of earlier
        chunks is still being written (``streaming.emitter.MAX_IN_FLIGHT_BYTES``): then it
        waits for room.

        Args:
            chunk: A str or JSON data.

        Raises:
            TypeError: The chunk is neither a str nor JSON data.
            StreamLimitError: The chunk is over ``stream_max_chunk_bytes`` (as JSON), or past
                ``stream_max_chunks`` in this run.
            StreamWriteError: An earlier write failed (let it fail the attempt: the retry
                streams again under a new "attempt" marker), or this context has no stream
                (it was not built by a worker).
        """
        if self.emitter is None:
            raise StreamWriteError("this context has no stream (it was not built by a worker)")
        await self.emitter.emit(chunk)

"""The typed context a handler receives as its second argument."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from weclaw_mq.errors import StreamWriteError

if TYPE_CHECKING:
    from weclaw_mq.app import App
    from weclaw_mq.handlers.lifespan import Provider
    from weclaw_mq.streaming.emitter import Emitter

_T = TypeVar("_T")


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
            this in a task of its own. A plain-``def`` handler reads ``cancelled`` instead.
        loop: The worker's event loop, for a plain-``def`` handler's ``emit_sync`` and
            ``publish_sync`` from its thread; the worker sets it for those handlers only.
        usage_sink: Where ``usage`` reports the run's model calls (the worker sets it for a
            handler with a token limit, or in an App with prices).
        model: The model the worker chose for this run, None to use the handler's own: a
            tenant past its ``Cap(action="downgrade")`` gets the cap's cheaper model here.
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
    # The worker's event loop, for a plain def's emit_sync and publish_sync from its thread.
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    # Where ``usage`` reports the run's model calls (llm.usage), when anything counts them.
    usage_sink: Callable[[int, int, str | None], None] | None = field(default=None, repr=False)
    # The model the worker chose for this run (a tenant past its cap, downgraded), else None.
    model: str | None = None

    @property
    def cancelled(self) -> bool:
        """Was the task cancelled (``App.cancel``)? Its outcome no longer counts.

        Safe to read from a plain-``def`` handler's thread: such a handler is not interrupted
        by a cancel, it reads this between its steps and returns early.
        """
        return self.cancel_requested.is_set()

    def usage(
        self, *, input_tokens: int = 0, output_tokens: int = 0, model: str | None = None
    ) -> None:
        """Report the model tokens this run used; call it once per model call.

        A handler with a token limit (``Limit(tokens=...)``) is admitted with an estimate;
        what it reports here replaces the estimate in the limit's window when the run ends,
        so the estimate's error does not accumulate. In an App with prices, each call is
        costed and recorded on the task and in its tenant's and model's daily totals
        (``weclaw-mq costs``). Safe from a plain-``def`` handler's thread.

        Args:
            input_tokens: The prompt's tokens, as the provider counted them.
            output_tokens: The answer's tokens.
            model: The model called; default ``ctx.model``, else ``"-"``.

        Raises:
            ValueError: A count that is not an int of at least 0.
        """
        for name, count in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"ctx.usage {name} must be an int >= 0, got {count!r}")
        if self.usage_sink is not None:
            self.usage_sink(input_tokens, output_tokens, model)

    def use(self, provider: Provider[_T]) -> _T:
        """The open resource of ``provider``, registered with ``@app.resource``.

        Safe from a plain-``def`` handler's thread (it only reads).

        Args:
            provider: The resource's generator function.

        Returns:
            What it yielded, typed as the provider's annotation says.

        Raises:
            ResourceUnavailableError: ``provider`` is not a resource of the App, or the App's
                lifespan is not open.
        """
        return self.app.lifespan.use(provider)

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

    def publish_sync(self, queue: str, payload: Any, **kwargs: Any) -> str:
        """``publish`` from a plain-``def`` handler's thread: it waits for the confirm there.

        The publish itself runs on the worker's event loop, and raises what ``publish``
        raises (``ConfigurationError``, ``PayloadError``, ``PublishFailedError``).

        Args:
            queue: As ``publish``.
            payload: As ``publish``.
            **kwargs: As ``publish``.

        Returns:
            The follow-up task's id.

        Raises:
            RuntimeError: Called on an event loop (an ``async def`` awaits ``publish``), or
                this context has no loop (it was not built by a worker for a plain ``def``).
        """
        return self._on_loop(self.publish(queue, payload, **kwargs), "publish")

    def emit_sync(self, chunk: Any) -> None:
        """``emit`` from a plain-``def`` handler's thread: it waits there for the chunk's turn.

        The emit itself runs on the worker's event loop and returns at once, unless 1 MiB of
        earlier chunks is still being written (then the thread waits for room, as ``emit``).

        Args:
            chunk: A str or JSON data.

        Raises:
            RuntimeError: Called on an event loop (an ``async def`` awaits ``emit``), or this
                context has no loop (it was not built by a worker for a plain ``def``).
            TypeError: As ``emit`` raises it.
            StreamLimitError: As ``emit`` raises it.
            StreamWriteError: As ``emit`` raises it; also once the attempt ended without the
                handler (its timeout, a cancel): an abandoned call streams nothing more.
        """
        self._on_loop(self.emit(chunk), "emit")

    def _on_loop(self, work: Coroutine[Any, Any, _T], name: str) -> _T:
        """Run ``work`` on the worker's loop and wait for it in this (the handler's) thread."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            on_a_loop = False
        else:
            on_a_loop = True
        if on_a_loop or self.loop is None:
            work.close()
            raise RuntimeError(
                f"ctx.{name}_sync blocks, so it would stall this event loop: use "
                f"'await ctx.{name}(...)' in an async def"
                if on_a_loop
                else f"ctx.{name}_sync is for a plain-def handler run by a worker (this "
                "context has no event loop to run it on)"
            )
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

"""The typed context a handler receives as its second argument."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from weclaw_mq.errors import ConfigurationError, StepError, StreamWriteError
from weclaw_mq.state.steps import HasSteps, StepMemo, Usage, made, step_billing, step_key
from weclaw_mq.streaming.emitter import emitted_chunks

if TYPE_CHECKING:
    from weclaw_mq.app import App
    from weclaw_mq.handlers.lifespan import Provider
    from weclaw_mq.streaming.emitter import Emitter

_T = TypeVar("_T")


@dataclass
class _Running:
    """The step running in this (asyncio or thread) context: its key, the model calls
    reported inside it (``ctx.usage``), and when it started (``time.perf_counter``)."""

    ctx: Context
    key: str
    usage: list[Usage] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


@contextlib.contextmanager
def _inside(ctx: Context, key: str) -> Iterator[_Running]:
    """The step's function runs inside this: ``ctx.step_key`` and ``ctx.usage`` see it."""
    running = _Running(ctx, key)
    token = _running_step.set(running)
    try:
        yield running
    finally:
        _running_step.reset(token)


# Set while a step's function runs: asyncio tasks and threads started inside it inherit it.
_running_step: contextvars.ContextVar[_Running | None] = contextvars.ContextVar(
    "weclaw_mq_step", default=None
)


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
    # This run's view of the task's recorded steps (ctx.step), made at its first step.
    _memo: list[StepMemo] = field(default_factory=list, init=False, repr=False, compare=False)

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
        (``weclaw-mq costs``) as the attempt ends; inside a step (``ctx.step``), as the step
        is recorded (with the step too), and a replay of that step reports nothing again.
        Safe from a plain-``def`` handler's thread.

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
        running = _running_step.get()
        if running is not None and running.ctx is self:  # recorded with the step too
            running.usage.append((model or self.model or "-", input_tokens, output_tokens))
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

    # -- memoized steps (weclaw_mq.state.steps) ---------------------------------------------
    async def step(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once per task: a later attempt gets its recorded result.

        The step is recorded by this task, this queue, ``name`` and its occurrence (the 1st,
        2nd... call with ``name`` in this run): a retry or a redelivery after a crash gets
        back what the step returned, without calling ``fn``, as long as the task's record is
        kept. So call steps in the same order on every attempt. The first step of a run
        reads the task's steps (one Redis round trip); a replay costs none after it, a fresh
        step one write. ``ctx.step_key`` is the step's idempotency key while ``fn`` runs, and
        the model calls ``ctx.usage`` reports then are recorded with the step, and billed
        in the cost ledger (an App with prices) as its record is written, not again at the
        attempt's end: a worker killed later has billed them all the same, and a replay
        bills nothing.

        A step that raises is not recorded (it runs again on the next attempt). A step whose
        call ended but whose record was not written (the worker died in between, Redis
        failed) runs again too: a step is at-least-once; pass ``ctx.step_key`` to a provider
        that takes an idempotency key to make even that once.

        Args:
            name: The step's name, the same on every attempt.
            fn: A function or a coroutine function (anything whose call returns a value or
                an awaitable). A blocking call belongs in a thread: pass
                ``asyncio.to_thread, fn`` (or use ``step_sync`` in a plain ``def``).
            *args: ``fn``'s arguments.
            **kwargs: ``fn``'s keyword arguments.

        Returns:
            What ``fn`` returned, as JSON data (a fresh call's result goes through JSON too,
            so a replay returns the same: a dict for a pydantic model, a list for a tuple).

        Raises:
            StepError: ``fn`` returned something that is not JSON or is over
                ``step_max_bytes`` (nothing recorded), or this is a step inside a step.
            ConfigurationError: The App keeps no task store (results off and no handler
                guarded), or one that keeps no steps.
            StateUnavailableError: Redis failed reading or writing the steps (the attempt
                fails; the next one replays what was recorded).
        """
        memo, occurrence, seq, key = self._step_started(name)
        recorded = await memo.recorded(name, occurrence)
        if recorded is not None:
            return recorded.result
        with _inside(self, key) as running:
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        return await self._record(memo, name, (occurrence, seq), value, running)

    def step_sync(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``step`` from a plain-``def`` handler's thread: ``fn`` runs in this thread.

        Reading and writing the record runs on the worker's event loop (as ``publish_sync``
        does); everything else is as ``step``.

        Args:
            name: As ``step``.
            fn: A plain function (called in this thread).
            *args: As ``step``.
            **kwargs: As ``step``.

        Returns:
            As ``step``.

        Raises:
            RuntimeError: Called on an event loop (an ``async def`` awaits ``step``), or this
                context has no loop (it was not built by a worker for a plain ``def``).
            TypeError: ``fn`` returned an awaitable (use ``step`` in an ``async def``).
            StepError: As ``step``.
            ConfigurationError: As ``step``.
            StateUnavailableError: As ``step``.
        """
        memo, occurrence, seq, key = self._step_started(name)
        recorded = self._on_loop(memo.recorded(name, occurrence), "step")
        if recorded is not None:
            return recorded.result
        with _inside(self, key) as running:
            value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()
            raise TypeError(
                f"step {name!r}: ctx.step_sync takes a plain function; await ctx.step(...) "
                "in an async def for a coroutine function"
            )
        called = (occurrence, seq)
        return self._on_loop(self._record(memo, name, called, value, running), "step")

    @property
    def step_key(self) -> str:
        """The running step's idempotency key, the same on every attempt of the task.

        ``"<task id>:<queue>:<name>:<occurrence>"``. Read it inside the step's function (in
        its thread, or in tasks it starts) and pass it to a provider's idempotency key.

        Raises:
            RuntimeError: No step of this context is running here.
        """
        running = _running_step.get()
        if running is None or running.ctx is not self:
            raise RuntimeError("ctx.step_key is read inside a step's function (ctx.step)")
        return running.key

    def _step_started(self, name: str) -> tuple[StepMemo, int, int, str]:
        """This run's memo, the step's occurrence, its place in the run and its key; refuses
        a step in a step."""
        if not isinstance(name, str) or not name:
            raise StepError(f"a step's name is a non-empty str, got {name!r}")
        running = _running_step.get()
        if running is not None and running.ctx is self:
            raise StepError(
                f"step {name!r} called inside step {running.key!r}: steps do not nest (a "
                "replay of the outer one would skip it, and shift every later occurrence)"
            )
        if not self._memo:
            store = self.app.store
            if not isinstance(store, HasSteps):
                raise ConfigurationError(
                    "ctx.step records steps in the task store: this App has "
                    + (
                        "none (results off and no handler guarded)"
                        if store is None
                        else f"a {type(store).__name__}, which keeps no steps"
                    )
                )
            # A race of two first steps in two threads makes two memos; one is kept.
            self._memo.append(StepMemo(store.step_book(), self.queue, self.task_id))
        memo = self._memo[0]
        occurrence, seq = memo.next_occurrence(name)
        return memo, occurrence, seq, step_key(self.task_id, self.queue, name, occurrence)

    async def _record(
        self,
        memo: StepMemo,
        name: str,
        called: tuple[int, int],
        value: Any,
        running: _Running,
    ) -> Any:
        """Record a step that returned ``value``; ``called``: its occurrence and place."""
        record, body = made(
            name,
            called[0],
            value,
            duration_s=time.perf_counter() - running.started,
            attempt=self.attempt,
            usage=running.usage,
            max_bytes=self.app.settings.step_max_bytes,
            seq=called[1],
        )
        bill = step_billing.get()
        if bill is not None and record.usage:
            # Billed before the record is written: a kill between them repeats the call,
            # and the provider bills that again too (the ledger stays its bill).
            await bill(record.usage)
        await memo.save(record, body)
        return record.result

    # -- continuing a stream after a crash ------------------------------------------------
    async def emitted(self) -> list[Any]:
        """The chunks this task's stream holds now, as its readers see them, to go on from.

        A run re-started after a crash or a failure reads what the earlier run emitted (the
        chunks after the stream's last "attempt" marker; [] when none, or when the task
        ended since), and continues the generation from there: pass the text as the
        model's prefix, and emit only what follows. Called before this run's first
        ``emit``, it makes this run write no "attempt" marker: readers keep the earlier
        text and get the rest after it, with no gap and no duplicate. (Called later, it
        returns this run's own chunks too, written so far, and changes nothing.)

        Returns:
            The chunks, oldest first (str or JSON data, as emitted).

        Raises:
            StreamWriteError: This context has no stream (it was not built by a worker).
            StateUnavailableError: The stream store failed or did not answer.
        """
        if self.emitter is None:
            raise StreamWriteError("this context has no stream (it was not built by a worker)")
        chunks = await emitted_chunks(self.app.streams, self.task_id)
        if chunks:
            self.emitter.continue_text()
        return chunks

    def emitted_sync(self) -> list[Any]:
        """``emitted`` from a plain-``def`` handler's thread (it reads on the worker's loop).

        Returns:
            As ``emitted``.

        Raises:
            RuntimeError: As ``emit_sync`` raises it.
            StreamWriteError: As ``emitted``.
            StateUnavailableError: As ``emitted``.
        """
        return self._on_loop(self.emitted(), "emitted")

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

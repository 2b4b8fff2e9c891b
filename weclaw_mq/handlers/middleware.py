"""Middleware: the team's own code around every handler run and every publish.

A ``Middleware`` subclass overrides any of its async hooks; ``app.add_middleware(m)`` adds it
to the App's chain. ``admit``, ``before_*`` and ``around_run`` hooks run in the order the
middleware was added, ``after_*`` hooks in reverse (the first added wraps all the others),
once each per run or publish:

- ``admit(run)``: the task passed the worker's own gates (not a duplicate, not expired, not
  cancelled; the guard's claim is held) and the handler's own gates (its cap, fallback chain
  and limits, themselves middleware of the LLM layer) come next. It answers None to go on, a
  ``Defer`` to park the task without spending an attempt (until a time, or to be asked again
  after a delay), or a ``DeadLetter`` to move it to the DLQ with a reason; it may set
  ``run.model`` (the model the handler runs on); raising is the attempt's failure
  (``Reject`` dead-letters at once, ``Retry`` retries). The hooks run under
  the handler's ``timeout_s`` with the claim's lease kept: one past it ends the attempt as a
  ``HandlerTimeout``.
- ``before_run(run)``: the task is admitted (not a duplicate, not expired, not cancelled,
  within its limits) and its handler is about to be called. An exception here is the
  attempt's failure, retried or dead-lettered like the handler's own (the handler is not
  called, the later ``before_run`` hooks are skipped). It runs under the handler's timeout
  and cancel requests: the hooks and the handler share one deadline.
- ``around_run(run, call)``: around the handler's call, after the ``before_run`` hooks, under
  the same deadline and cancel watch; ``await call()`` runs the rest (the next middleware's
  ``around_run``, then the handler) and returns its result, which the hook returns. An
  exception is the attempt's failure.
- ``after_call(run, call)``: the handler's call ended (it returned, raised, timed out, or never
  started), outside its deadline, before the attempt's end is decided and stored; last added
  first. ``call`` says how (``CallEnd``). It answers None to let that stand, an exception to
  be the attempt's failure as the retry policy sees it (in place of ``call.error``), or a
  ``Defer`` to park the task without spending the attempt. An exception raised here is the
  attempt's failure. They run under the handler's ``timeout_s``, counted afresh, with the
  claim's lease kept: one past it fails the attempt as a ``HandlerTimeout``.
- ``let_go(run)``: a run this middleware's ``admit`` let through will not reach
  ``after_call``: a later ``admit`` hook parked or failed it, or the worker gave the message
  back (it stops hard, or the handler was abandoned at its deadline). A plain function, for
  freeing what ``admit`` took (a slot, a reservation) without a round trip of its own.
- ``after_run(run, end)``: the attempt has ended and its message is settled; ``end.outcome``
  is how, as ``weclaw_mq_messages_total{outcome}`` counts it (acked, retried, dead_lettered,
  cancelled, and deferred, duplicate or requeued when the ending could not go as decided).
  An exception here is logged (a middleware's first with its traceback, then one short line
  a minute with the count): the message is settled already. The worker gives the hooks
  5 s (``worker.run_hooks.AFTER_RUN_TIMEOUT_S``), then cancels them.
- ``before_publish(publish)``: before a task is sent (``publish``, each task of
  ``publish_many``, ``ctx.publish``); it may add headers to ``publish.message``. An exception
  here is the publish's: nothing is sent, the caller gets it.
- ``after_publish(publish, error)``: once the broker confirmed (``error`` None), or the
  publish failed; an exception here is logged.

``run.state`` and ``publish.state`` are dicts for a middleware's own values between its
hooks; ``run.model`` is the model chosen for the run (by an ``admit`` hook), and ``run.usage``
the model calls the handler reported so far (``ctx.usage``). ``before_run`` runs in the
delivery's own task, so a ``ContextVar`` it sets is seen by the handler (a plain ``def``'s
thread gets a copy of the context).

A handler's own middleware (its cap, fallback chain and limits: ``weclaw_mq.llm``) runs after
the App's, in the same hooks: the library's LLM features use this seam and no other.

With no middleware the worker and the publisher make no call for it: one attribute check per
delivery and per publish (``make bench-own-cost`` counts the calls).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aio_pika

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.policy.retry import DeadLetterReason

log = logging.getLogger("weclaw_mq.middleware")

# After a hook's first failure (logged with its traceback), at most one line per hook per
# this many seconds, with the count: a hook that always fails must not flood the log.
REPEAT_LOG_S = 60.0


@dataclass
class Run:
    """One run of a handler, as middleware sees it.

    Args:
        task_id: The task's id.
        trace_id: The task's trace id.
        queue: The handler queue.
        attempt: This attempt's number (1 = the first run).
        redelivered: Whether the broker delivered this message before.
        headers: The message's AMQP headers. The task's next copy (a retry, a deferral, its
            dead letter) carries them: a hook may add its own ``x-`` headers here.
        task: The task as the handler receives it (validated by its model).
        session_id: The task's session, if any.
        size: The message body's length in bytes.
        state: The middleware's own values between its hooks (``admit`` to ``after_run``).
        model: The model chosen for the run (a fallback chain's, a cap's downgrade), or
            None; an ``admit`` hook may set it (``ctx.model`` in the handler).
        usage: The model calls the handler reported so far (``ctx.usage``), in order.
    """

    task_id: str
    trace_id: str
    queue: str
    attempt: int
    redelivered: bool
    headers: dict[str, Any]
    task: Any
    session_id: str | None = None
    size: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    usage: list[Usage] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    """One model call a run reported (``ctx.usage``).

    Args:
        model: The model called (the run's model when the handler named none), or ``-``.
        input_tokens: The call's input tokens.
        output_tokens: The call's output tokens.
        at: When it was reported (``time.monotonic()``); not compared.
    """

    model: str
    input_tokens: int
    output_tokens: int
    at: float = field(default_factory=time.monotonic, compare=False)


@dataclass(frozen=True)
class Defer:
    """An ``admit`` hook's answer: park the task without spending an attempt.

    With ``until``, the task waits until then (hopping through the handler's delay queues)
    and is admitted again; with ``after_s``, it is asked again after that long; with neither,
    after the handler's first retry delay. Its ``queued`` record says so (``deferred``, by
    ``by``), and its first deferral is logged at INFO (``quiet``: DEBUG, for a deferral that
    is routine under load).

    Args:
        why: Why, in the log line and the task's record.
        until: When it may run (an aware datetime), or None.
        after_s: Ask again after this many seconds, or None.
        by: What deferred it, in the record (``TaskState.deferred.by``).
        quiet: Log its deferrals at DEBUG.
    """

    why: str
    until: datetime | None = None
    after_s: float | None = None
    by: str = "middleware"
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.until is not None and self.after_s is not None:
            raise ConfigurationError("Defer takes until= or after_s=, not both")
        if self.until is not None and self.until.tzinfo is None:
            raise ConfigurationError(f"Defer(until=) needs an aware datetime, got {self.until}")
        if self.after_s is not None and not 0 <= self.after_s <= 86_400:
            raise ConfigurationError(f"Defer(after_s=) must be 0..86400 s, got {self.after_s}")
        if not self.by or not self.by.isprintable() or len(self.by) > 64:
            raise ConfigurationError(f"Defer(by=) must be 1..64 printable characters: {self.by!r}")


@dataclass(frozen=True)
class DeadLetter:
    """An ``admit`` hook's answer: move the task to its DLQ now, without running it.

    Args:
        error: Why, as the DLQ and the task's record show it.
        reason: The dead-letter reason (``x-weclaw-dead-letter-reason``), one of
            ``weclaw_mq.policy.retry.DeadLetterReason``'s values.
    """

    error: BaseException
    reason: str = "rejected"

    def __post_init__(self) -> None:
        if self.reason not in DeadLetterReason._value2member_map_:
            known = ", ".join(r.value for r in DeadLetterReason)
            raise ConfigurationError(f"DeadLetter(reason=) must be one of {known}: {self.reason!r}")


@dataclass(frozen=True)
class CallEnd:
    """How the handler's call ended, for ``after_call``.

    Args:
        result: What it returned (None unless it returned).
        error: What it raised (a timeout as ``HandlerTimeout``), or None.
        cancelled: A cancel request came while it ran: its outcome no longer counts.
        started: False when the call never started (no thread was free for a plain
            ``def``): the attempt is not spent.
    """

    result: Any
    error: BaseException | None
    cancelled: bool = False
    started: bool = True


@dataclass(frozen=True)
class RunEnd:
    """How a run ended, for ``after_run``.

    Args:
        outcome: How its message was settled (``Outcome``).
        result: What the handler returned (None unless it returned).
        error: The attempt's failure (the handler's exception, a timeout, a ``before_run``
            hook's exception), or None.
        duration_s: From the first ``before_run`` hook to the settle, in seconds.
    """

    outcome: Outcome
    result: Any
    error: BaseException | None
    duration_s: float


@dataclass
class Publish:
    """One task being published, as middleware sees it.

    Args:
        queue: The handler queue it is published to.
        task_id: The task's id.
        message: The AMQP message about to be sent: ``before_publish`` may add headers.
        state: The middleware's own values between ``before_publish`` and ``after_publish``.
    """

    queue: str
    task_id: str
    message: aio_pika.Message
    state: dict[str, Any] = field(default_factory=dict)


class Middleware:
    """Subclass it and override the hooks you need; every hook here does nothing."""

    async def admit(self, run: Run) -> Defer | DeadLetter | None:
        """Called before the handler runs; may park the task without an attempt.

        Args:
            run: The run (``run.task`` is decoded; the guard's claim is held).

        Returns:
            None to go on, a ``Defer``, or a ``DeadLetter``. Raising fails the attempt
            (``Reject``: to the DLQ now).
        """
        return None

    async def after_call(self, run: Run, call: CallEnd) -> BaseException | Defer | None:
        """Called when the handler's call ended, before the attempt's end is decided.

        Args:
            run: The run (``run.usage``: every model call it reported).
            call: How the call ended.

        Returns:
            None to let it stand, the exception the retry policy should see instead of
            ``call.error``, or a ``Defer`` to park the task without spending the attempt.
        """
        return None

    def let_go(self, run: Run) -> None:
        """Called instead of ``after_call`` for a run ``admit`` let through: free what it took.

        The run will not end its call here: a later ``admit`` hook parked or failed it, or
        the worker gave its message back (a hard stop, an abandoned handler).

        Args:
            run: The run.
        """

    async def around_run(self, run: Run, call: Callable[[], Awaitable[Any]]) -> Any:
        """Called around the handler's call, under its deadline; returns what ``call`` did.

        Args:
            run: The run.
            call: Runs the rest (later middleware, then the handler); returns its result.

        Returns:
            The run's result (what ``await call()`` returned, as a rule).
        """
        return await call()

    async def before_run(self, run: Run) -> None:
        """Called before the handler runs; raising fails the attempt.

        Args:
            run: The run.
        """

    async def after_run(self, run: Run, end: RunEnd) -> None:
        """Called once the attempt's message is settled.

        Args:
            run: The run.
            end: How it ended.
        """

    async def before_publish(self, publish: Publish) -> None:
        """Called before a task is sent; raising fails the publish (nothing is sent).

        Args:
            publish: The task being published.
        """

    async def after_publish(self, publish: Publish, error: BaseException | None) -> None:
        """Called once the publish is confirmed (``error`` None) or failed.

        Args:
            publish: The task published.
            error: Why it failed, or None.
        """


def _wrapped(
    middleware: Middleware, run: Run, call: Callable[[], Awaitable[Any]]
) -> Callable[[], Awaitable[Any]]:
    async def wrapped() -> Any:
        return await middleware.around_run(run, call)

    return wrapped


def _overrides(middleware: Middleware, hook: str) -> bool:
    return getattr(type(middleware), hook) is not getattr(Middleware, hook)


class Chain:
    """An App's middleware in order, each hook's list holding only those that override it."""

    def __init__(self) -> None:
        self.middleware: list[Middleware] = []
        self._admit: list[Middleware] = []
        self._around_run: list[Middleware] = []
        self._before_run: list[Middleware] = []
        self._after_run: list[Middleware] = []
        self._after_call: list[Middleware] = []
        self._let_go: list[Middleware] = []
        self._before_publish: list[Middleware] = []
        self._after_publish: list[Middleware] = []
        # Read per delivery and per publish instead of a call: anything to run at all?
        self.runs = False
        self.admits = False
        self.wraps = False
        self.calls = False  # after_call or let_go hooks: the run's end is told to them
        self.befores = False  # before_run hooks
        self.afters = False  # after_run hooks: the settle's outcome is noted for them
        self.publishes = False
        # (middleware id, hook) -> [failures not yet logged, when a line was last logged]
        self._failures: dict[tuple[int, str], list[float]] = {}

    def add(self, middleware: Middleware) -> None:
        """Append ``middleware``: its ``before_*`` hooks run after those added before it."""
        if not isinstance(middleware, Middleware):
            raise ConfigurationError(
                f"add_middleware takes a weclaw_mq.Middleware instance, got {middleware!r}"
            )
        if any(m is middleware for m in self.middleware):
            raise ConfigurationError(f"{middleware!r} is added twice")
        self.middleware.append(middleware)
        for hook, members in (
            ("admit", self._admit),
            ("around_run", self._around_run),
            ("before_run", self._before_run),
            ("before_publish", self._before_publish),
        ):
            if _overrides(middleware, hook):
                members.append(middleware)
        if _overrides(middleware, "let_go"):
            self._let_go.append(middleware)
        for hook, members in (
            ("after_run", self._after_run),
            ("after_call", self._after_call),
            ("after_publish", self._after_publish),
        ):
            if _overrides(middleware, hook):
                members.insert(0, middleware)  # the last added runs first
        self.admits = bool(self._admit)
        self.wraps = bool(self._around_run)
        self.calls = bool(self._after_call or self._let_go)
        self.befores = bool(self._before_run)
        self.afters = bool(self._after_run)
        self.runs = bool(
            self._before_run or self._after_run or self.wraps or self.admits or self.calls
        )
        self.publishes = bool(self._before_publish or self._after_publish)

    def joined(self, own: Sequence[Middleware]) -> Chain:
        """A chain of this one's middleware, then ``own`` (a handler's): ``self`` when
        ``own`` is empty."""
        if not own:
            return self
        chain = Chain()
        for middleware in (*self.middleware, *own):
            chain.add(middleware)
        return chain

    def admit(self, run: Run) -> Awaitable[Defer | DeadLetter | None]:
        """Each ``admit`` in order, until one parks or dead-letters the task; an exception is
        raised (the attempt's failure). Those that let it through before are let go. The
        caller checks the answer's type."""
        if len(self._admit) == 1:  # the hook's own coroutine: no frame of ours to resume
            return self._admit[0].admit(run)
        return self._admit_each(run)

    async def _admit_each(self, run: Run) -> Defer | DeadLetter | None:
        for i, middleware in enumerate(self._admit):
            try:
                answer = await middleware.admit(run)
                if answer is not None and not isinstance(answer, Defer | DeadLetter):
                    raise TypeError(
                        f"{middleware!r}.admit returned {answer!r}: None, a weclaw_mq.Defer "
                        "or a weclaw_mq.DeadLetter"
                    )
            except BaseException:
                self._let_go_of(run, self._admit[:i])
                raise
            if answer is not None:
                self._let_go_of(run, self._admit[:i])
                return answer
        return None

    def after_call(self, run: Run, call: CallEnd) -> Awaitable[BaseException | Defer | None]:
        """Each ``after_call``, last added first: the error as the last changed it (each
        sees the one before's in ``call.error``), or the first ``Defer``. An exception a hook
        raises is the attempt's failure: the caller catches it, and checks the answer's type."""
        if len(self._after_call) == 1:  # the hook's own coroutine: no frame of ours
            return self._after_call[0].after_call(run, call)
        return self._after_each(run, call)

    async def _after_each(self, run: Run, call: CallEnd) -> BaseException | Defer | None:
        changed: BaseException | None = None
        for middleware in self._after_call:
            try:
                answer = await middleware.after_call(run, call)
            except Exception as e:  # the attempt's failure, decided by its retry policy
                answer = e
            if isinstance(answer, Defer):
                return answer
            if answer is not None:
                if not isinstance(answer, BaseException):
                    raise TypeError(
                        f"{middleware!r}.after_call returned {answer!r}: None, an exception "
                        "or a weclaw_mq.Defer"
                    )
                changed = answer
                call = CallEnd(None, answer, call.cancelled, call.started)
        return changed

    def let_go(self, run: Run) -> None:
        """Each ``let_go``: the run admitted will not end its call here."""
        self._let_go_of(run, self._let_go)

    def _let_go_of(self, run: Run, admitted: Sequence[Middleware]) -> None:
        for middleware in admitted:
            if middleware in self._let_go:
                try:
                    middleware.let_go(run)
                except Exception as e:
                    self._failed(middleware, "let_go", e)

    async def around_run(self, run: Run, call: Callable[[], Awaitable[Any]]) -> Any:
        """The ``around_run`` hooks nested, the first added outermost, around ``call``."""
        for middleware in reversed(self._around_run):
            call = _wrapped(middleware, run, call)
        return await call()

    async def before_run(self, run: Run) -> Exception | None:
        """Each ``before_run`` in order; the first exception stops them and is returned."""
        for middleware in self._before_run:
            try:
                await middleware.before_run(run)
            except Exception as e:  # the attempt's failure, decided by its retry policy
                return e
        return None

    async def after_run(self, run: Run, end: RunEnd) -> None:
        """Each ``after_run``, last added first; an exception is logged, the rest still run."""
        for middleware in self._after_run:
            try:
                await middleware.after_run(run, end)
            except Exception as e:
                self._failed(middleware, "after_run", e)

    async def before_publish(self, publishes: Sequence[Publish]) -> None:
        """Each ``before_publish`` in order, for each task; an exception is raised."""
        for middleware in self._before_publish:
            for publish in publishes:
                await middleware.before_publish(publish)

    async def after_publish(
        self, publishes: Sequence[Publish], errors: Mapping[int, BaseException | None]
    ) -> None:
        """Each ``after_publish``, last added first, for each task (``errors`` by index)."""
        for middleware in self._after_publish:
            for i, publish in enumerate(publishes):
                try:
                    await middleware.after_publish(publish, errors.get(i))
                except Exception as e:
                    self._failed(middleware, "after_publish", e)

    def _failed(self, middleware: Middleware, hook: str, error: Exception) -> None:
        """Log a hook's failure: the first with its traceback, then one line per
        ``REPEAT_LOG_S`` saying how many failed since."""
        key = (id(middleware), hook)
        now = time.monotonic()
        seen = self._failures.get(key)
        if seen is None:
            self._failures[key] = [0, now]
            log.exception(
                "%r.%s failed (later failures of this hook: one line a minute)", middleware, hook
            )
            return
        seen[0] += 1
        if now - seen[1] < REPEAT_LOG_S:
            return
        log.error(
            "%r.%s failed %d more time(s) in %.0f s, the last with %s: %s",
            middleware,
            hook,
            seen[0],
            now - seen[1],
            type(error).__name__,
            error,
        )
        seen[0], seen[1] = 0, now

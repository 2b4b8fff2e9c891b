"""Running the handler: its context, its stream, its deadline, and the attempt's end when it
ignores its cancellation.

A plain-``def`` handler runs in the worker's threads (``sync_threads``) and is awaited the
same way: a timeout or a cancel ends the wait (the call itself is abandoned to its thread),
and the attempt ends as an async handler's would. Anything the handler raises is its
attempt's failure; ``call_handler`` answers with the result or the error (or None when the
handler was abandoned and ``take_over`` ended the attempt without it), and
``ends.after_attempt`` decides what that becomes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from weclaw_mq.context import Context
from weclaw_mq.errors import HandlerAbandoned, HandlerTimeout
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability import tracing
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.policy.failures import describe
from weclaw_mq.streaming.emitter import Emitter
from weclaw_mq.wire.connection import cancelled_by_caller
from weclaw_mq.worker import run_hooks
from weclaw_mq.worker.attempt import Attempt
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.deadlines import Deadline
from weclaw_mq.worker.ends import AckCancelled, End, after_attempt, carry_out
from weclaw_mq.worker.records import session_of
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.settle import settled_as

log = logging.getLogger("weclaw_mq.worker")

# How long a failed run's last chunks may take to reach its stream before the failure is
# handled (retry or dead-letter); past it they are dropped.
DRAIN_ON_FAILURE_S = 1.0


async def call_handler(
    a: Attempt,
    on_stuck: Callable[[asyncio.Task[Any]], None],
    usage: Callable[[int, int, str | None], None] | None = None,
) -> tuple[Any, BaseException | None] | None:
    """Run the handler under its timeout: (its result, None), (None, the error), or None when
    it ignored its cancellation and ``on_stuck`` ended the attempt without it.

    Anything the handler raises is its attempt's failure, BaseExceptions included: a
    ``SystemExit``, ``KeyboardInterrupt`` or ``CancelledError`` of its own fails that task and
    never stops the worker (a worker stops on SIGTERM/SIGINT or ``Worker.stop``). Only a
    cancel of this task from outside (the worker stopping hard) passes through.

    ``usage``: where ``ctx.usage`` reports the run's model calls (``llm.usage``). The
    model the worker chose for the run is ``a.model`` (``ctx.model``); the middleware's run
    (``a.begun``) has its ``before_run`` hooks run first, under the same deadline and cancel
    watch (an exception of theirs is the attempt's failure; the handler is not called).
    """
    spec, task, rt, watch, begun = a.spec, a.task, a.rt, a.watch, a.begun
    args: tuple[Any, ...] = (task,)
    emitter: Emitter | None = None
    if spec.takes_context:
        args, emitter = _with_context(a, usage)
    timing = a.pipeline.timing
    started = time.perf_counter()
    if emitter is not None:
        on_stuck = _silencing(emitter, on_stuck)
    deadline = Deadline(rt.deadlines, spec.timeout_s, on_stuck, rt.settings.handler_cancel_grace_s)
    result: Any = None
    error: BaseException | None = None
    try:
        with deadline:
            watch.attach(deadline)
            failed = (
                None if begun is None or not begun.hooks.befores else await run_hooks.before(begun)
            )
            if failed is not None:
                error = failed  # a before_run hook failed the attempt
            elif begun is not None and begun.hooks.wraps:  # around_run hooks around the call
                call = functools.partial(_called, spec, args, rt, deadline, watch)
                result = await begun.hooks.around_run(begun.run, call)
            elif spec.is_sync:
                result = await rt.threads.run(
                    spec.func, args, name=spec.name, deadline=deadline, watch=watch
                )
            else:
                result = await spec.func(*args)
            if emitter is not None:
                # Every chunk written before the result is stored: a stream's final event
                # must sort after its last chunk.
                await emitter.drain()
    except asyncio.CancelledError as e:
        if cancelled_by_caller():
            raise
        error = e  # raised by the handler itself, not a cancel of this task
    except GeneratorExit:
        raise  # this coroutine is being closed: nothing can be awaited any more
    except BaseException as e:
        error = e
    finally:
        timing.observe(time.perf_counter() - started)
    if emitter is not None:
        if error is not None and not deadline.abandoned:
            # A failed run's partial text still reaches readers, ahead of the next attempt's
            # marker or the dead-letter's final event.
            await emitter.wind_down(DRAIN_ON_FAILURE_S)
        emitter.close()
    if deadline.abandoned:
        _dropped(error)
        return None
    if deadline.expired and error is not None:
        return None, _timed_out(spec, error)
    return result, error


def _with_context(
    a: Attempt, usage: Callable[[int, int, str | None], None] | None
) -> tuple[tuple[Any, ...], Emitter]:
    """The handler's arguments with its ``Context``, and the emitter its stream writes to."""
    spec, delivery, rt = a.spec, a.delivery, a.rt
    session_id = session_of(delivery)
    app = rt.app
    emitter = Emitter(
        lambda: app.streams,
        task_id=delivery.task_id,
        attempt=delivery.attempt,
        session_id=session_id,
        max_chunk_bytes=rt.settings.stream_max_chunk_bytes,
        max_chunks=rt.settings.stream_max_chunks,
    )
    ctx = Context(
        task_id=delivery.task_id,
        trace_id=delivery.trace_id,
        queue=spec.queue,
        attempt=delivery.attempt,
        redelivered=delivery.redelivered,
        headers=delivery.headers,
        app=rt.app,
        session_id=session_id,
        emitter=emitter,
        cancel_requested=a.watch.event(),
        # A plain def's thread reaches the loop through it (ctx.emit_sync, publish_sync).
        loop=asyncio.get_running_loop() if spec.is_sync else None,
        usage_sink=usage,
        model=a.model,
    )
    return (a.task, ctx), emitter


def _dropped(error: BaseException | None) -> None:
    """The late outcome of a handler abandoned for ignoring its cancellation: logged, dropped."""
    log.warning(
        "a handler abandoned for ignoring its cancellation ended after all (%s); "
        "its outcome is dropped: the task was already retried or dead-lettered",
        "returned" if error is None else describe(error),
    )


def _timed_out(spec: HandlerSpec, error: BaseException) -> HandlerTimeout:
    """Whatever the handler made of our cancellation (re-raised, wrapped), it timed out."""
    timeout = HandlerTimeout(f"handler ran past its timeout of {spec.timeout_s} s")
    timeout.__cause__ = error if not isinstance(error, TimeoutError) else None
    return timeout


async def _called(
    spec: HandlerSpec, args: tuple[Any, ...], rt: Runtime, deadline: Deadline, watch: Watch
) -> Any:
    """The handler's call, as the middleware's ``around_run`` hooks run it."""
    if spec.is_sync:
        return await rt.threads.run(spec.func, args, name=spec.name, deadline=deadline, watch=watch)
    return await spec.func(*args)


def _silencing(
    emitter: Emitter, on_stuck: Callable[[asyncio.Task[Any]], None]
) -> Callable[[asyncio.Task[Any]], None]:
    """An abandoned handler may go on emitting: its chunks must not land after the retry's
    attempt marker, so its stream is closed as the attempt is ended without it."""

    def stuck(task: asyncio.Task[Any]) -> None:
        emitter.close()
        on_stuck(task)

    return stuck


def take_over(a: Attempt, stuck: asyncio.Task[Any]) -> None:
    """What the deadline ticker calls (bound to a delivery by ``functools.partial``) when the
    handler is still running ``grace`` after its cancellation: end the attempt as a failure in
    a new task, so the message is retried or dead-lettered (acked, if the task was
    cancelled), the claim released, and the worker's slot freed."""
    a.rt.take_over(a.message, a.spec, a.rt, stuck, _end_abandoned(a))


async def _end_abandoned(a: Attempt) -> None:
    """The abandoned attempt's end, carried out in a task of its own (the delivery's task
    waits on the stuck handler)."""
    spec, grace_s = a.spec, a.rt.settings.handler_cancel_grace_s
    token = tracing.enter(a.delivery)
    # This task's own list of the outcome its ending counts, for the middleware's after_run.
    seen: list[Outcome] = []
    if a.begun is not None:
        settled_as.set(seen)
    try:
        error: BaseException
        end: End
        if a.watch.requested:
            log.error(
                "handler still running %.3g s after it was cancelled on request (it ignores "
                "cancellation); ending the attempt without it",
                grace_s,
            )
            error, end = asyncio.CancelledError(), AckCancelled()
        else:
            what = a.taken_over or "handler"
            log.error(
                "%s still running %.3g s after it was cancelled at its timeout of %.3g s "
                "(it ignores cancellation); ending the attempt without it",
                what,
                grace_s,
                spec.timeout_s,
            )
            error = HandlerAbandoned(
                f"{what} ran past its timeout of {spec.timeout_s} s and ignored its "
                f"cancellation for {grace_s} s"
            )
            end = after_attempt(a.delivery, spec, None, error)
        await carry_out(end, a.message, a.delivery, spec, a.rt, a.held, a.long_run)
        if a.begun is not None:
            await run_hooks.abandoned(a.begun, seen, error)
    finally:
        tracing.leave(token)

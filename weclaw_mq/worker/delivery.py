"""One delivery, start to end: decode -> guard -> call -> store -> decide -> settle.

Nothing here acks before the handler returned and its result was stored; every path out of
``process`` either acked (after storing or moving the task) or gave the message back to the
broker. Whatever the handler does (returns anything, raises anything, ignores its
cancellation) ends the attempt as a success or a failure with a reason; only a cancel of the
delivery's own task (the worker stopping hard) escapes, and the worker then gives the message
back (``in_flight.settled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic_core
from aio_pika.abc import AbstractIncomingMessage

from .. import headers as h
from .. import tracing
from ..context import Context
from ..delays import delay_queue_set, next_hop_ms, not_before_ms
from ..errors import (
    ConfigurationError,
    HandlerAbandoned,
    HandlerTimeout,
    InvalidPayload,
    ResultNotStored,
    StateCommandError,
    TaskExpired,
    UndecodableBody,
    UnserialisableResult,
    WorkerCrashLoop,
)
from ..failures import describe, error_type, safe_text
from ..handler import HandlerSpec
from ..lifetime import as_datetime, deadline_ms, left_ms, now_ms
from ..message import Delivery, read_delivery
from ..metrics import Metrics, Outcome
from ..naming import validate_session_id
from ..publishing.connection import cancelled_by_caller
from ..retry import DeadLetterReason, GiveUp, RetryLater, decide
from ..settings import Settings
from ..state import Claim, Finish, TaskState, TaskStatus, TaskStore, new_owner
from ..streaming.emitter import Emitter
from ..streaming.events import final_entry
from ..undecodable import undecodable
from . import notify
from .cancel import Cancels, Watch
from .circuit import QueueCircuit
from .deadlines import Deadline, Deadlines
from .limiting import NO_TICKET, Held, Limiter, Ticket
from .settle import Settler

if TYPE_CHECKING:
    from ..app import App
    from ..otel import Spans

log = logging.getLogger("weclaw_mq.worker")

_T = TypeVar("_T")


# How long a delivery that is being given back (a hard stop, a bug of ours) waits to release
# its claim first.
RELEASE_ON_EXIT_S = 1.0
# How long a failed run's last chunks may take to reach its stream before the failure is
# handled (retry or dead-letter); past it they are dropped.
DRAIN_ON_FAILURE_S = 1.0


@dataclass(frozen=True)
class Runtime:
    """What a delivery needs from the worker that received it."""

    app: App
    settings: Settings
    settler: Settler
    deadlines: Deadlines
    metrics: Metrics
    # The task store, for claims; None when no handler is guarded and results are off.
    store: TaskStore | None
    # The same store when results are on (records are written), else None.
    results: TaskStore | None
    # take_over(message, spec, rt, stuck, ending) runs a delivery's ending in a new task in
    # place of ``stuck``, whose handler ignored its cancellation; the worker counts the new
    # task as in flight, not the old one, and settles the message if the ending fails.
    take_over: Callable[
        [
            AbstractIncomingMessage,
            HandlerSpec,
            Runtime,
            asyncio.Task[Any],
            Coroutine[Any, Any, None],
        ],
        None,
    ]
    # Counts the handlers' limits in Redis; None when no handler has one.
    limiter: Limiter | None = None
    # The deliveries being processed, for cancel requests (worker.cancel).
    cancels: Cancels = field(default_factory=Cancels)
    # The circuit breaker of each handler queue that has one (``worker.circuit``).
    circuits: Mapping[str, QueueCircuit] = field(default_factory=dict)
    # OpenTelemetry spans (``weclaw_mq.otel``); None when off: one check per delivery.
    spans: Spans | None = None


class _Gate(Enum):
    UNGUARDED = "unguarded"  # the store is down, and the user chose run_unguarded
    SETTLED = "settled"  # duplicate or deferred: nothing more to do


# The enum members a delivery's common paths compare with, read once: on Python 3.11 every
# ``EnumClass.MEMBER`` is a Python-level descriptor call (enum.property), per use.
_SETTLED = _Gate.SETTLED
_CLAIM_DONE = Claim.DONE
_CLAIM_BUSY = Claim.BUSY
_CLAIM_CANCELLED = Claim.CANCELLED
_RUNNING = TaskStatus.RUNNING
_SUCCEEDED = TaskStatus.SUCCEEDED
_FINISH_DONE = Finish.DONE
_FINISH_TAKEN = Finish.TAKEN
# What a delivery that holds no claim keeps alive: nothing (reentrant, shared).
_NOT_HELD = contextlib.nullcontext()


async def process(message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime) -> None:
    delivery = read_delivery(message, spec.queue)
    token = tracing.enter(delivery)  # the delivery is its own trace context
    # Watched from before the claim: a cancel request is never missed in between.
    watch = rt.cancels.watch(spec.queue, delivery.task_id)
    try:
        if rt.spans is None:
            await _process(message, delivery, spec, rt, watch)
        else:
            with rt.spans.handling(spec.queue, delivery):
                await _process(message, delivery, spec, rt, watch)
    finally:
        rt.cancels.unwatch(watch)
        tracing.leave(token)


async def _process(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    watch: Watch,
) -> None:
    if h.UNDECODABLE_PROPERTIES in delivery.headers and undecodable(delivery.headers) is not None:
        # Its properties did not decode (the worker reads them tolerantly, see Worker.run), so
        # no copy of it can be built: one reject has the broker move the original to Q.dlq,
        # where the DLQ tools show it as "undecodable_properties". (The membership test
        # first: the common delivery pays no call.)
        await rt.settler.reject(message, queue=spec.queue)
        return
    if delivery.returns > spec.delivery_limit:
        # The broker enforces the limit within one stint in Q; this catches a task that
        # keeps killing workers while hopping through the guard's delay queue.
        crash = WorkerCrashLoop(
            f"the task went back unsettled {delivery.returns} times (its worker died or "
            f"lost its connection); delivery limit {spec.delivery_limit}"
        )
        await _dead_letter(message, delivery, spec, rt, DeadLetterReason.DELIVERY_LIMIT, crash)
        return
    if len(delivery.body) > rt.settings.max_message_bytes:
        # The same bound as publish: another producer's huge body is not parsed or stored.
        too_large = InvalidPayload(
            f"the body is {len(delivery.body)} bytes, over max_message_bytes "
            f"({rt.settings.max_message_bytes})"
        )
        await _dead_letter(message, delivery, spec, rt, DeadLetterReason.INVALID_PAYLOAD, too_large)
        return
    # Asked only of a task that carries a not-before time (a delayed publish, a retry).
    if h.NOT_BEFORE in delivery.headers and await _parked_until_due(message, delivery, spec, rt):
        return
    circuit = rt.circuits.get(spec.queue)
    if circuit is not None and not circuit.admits(message):
        # Delivered as the breaker opened (or waiting for a lane slot): parked, no attempt.
        why = f"the circuit breaker of {spec.queue!r} is {circuit.state}"
        await _defer(message, delivery, spec, rt, why)
        return
    try:
        task = spec.parse(delivery.body)
    except UndecodableBody as e:
        await _dead_letter(message, delivery, spec, rt, DeadLetterReason.UNDECODABLE, e)
        return
    except InvalidPayload as e:
        await _dead_letter(message, delivery, spec, rt, DeadLetterReason.INVALID_PAYLOAD, e)
        return

    held: str | None = None  # the claim's owner token, while we hold the claim
    if rt.store is not None and spec.idempotent:
        gate = await _pass_guard(message, delivery, spec, rt.store, rt)
        if gate is _SETTLED:
            return
        held = gate if isinstance(gate, str) else None
    if h.EXPIRES_AT in delivery.headers and await _expired_on_arrival(
        message, delivery, spec, rt, held
    ):
        return
    # Only a request, or the marker of a delivery that claims nothing, can cancel it here:
    # the common path pays no call.
    if (
        watch.requested or (rt.store is not None and not spec.idempotent)
    ) and await _cancelled_before_start(message, delivery, spec, rt, held, watch):
        return
    ticket = NO_TICKET
    if spec.limits and rt.limiter is not None:
        admitted = await _within_limits(message, delivery, spec, rt, rt.limiter, task, held)
        if admitted is None:
            return
        ticket = admitted

    # Without a claim (that wrote it), the "running" record is written beside the handler:
    # a model call need not wait for it.
    running = (
        asyncio.create_task(_status(rt, delivery, spec, _RUNNING))
        if rt.results is not None and held is None
        else None
    )
    # If the handler ignores its cancellation, another task ends the attempt without it (a
    # partial, not a closure: made for every delivery, called for almost none).
    on_stuck = functools.partial(_take_over, message, delivery, spec, rt, held, watch)
    # The claim's lease is kept from the handler's start until its ending returned (a result
    # write that retries included): a lapsed lease would let a copy run the task again.
    hold = (
        rt.store.holding(spec.queue, delivery.task_id, held)
        if held is not None and rt.store is not None
        else _NOT_HELD
    )
    try:
        with hold:
            if ticket is NO_TICKET:
                # The common path: no limit's slot to free.
                outcome = await _call(spec, task, delivery, rt, on_stuck, watch)
            else:
                with ticket:  # the limits' slots are freed as the handler ends, however it ends
                    outcome = await _call(spec, task, delivery, rt, on_stuck, watch)
            if outcome is not None and circuit is not None:
                circuit.outcome(message, outcome[1])
            if running is not None:
                await running
            if outcome is None:  # abandoned, and the task that took over settled it
                return
            if watch.requested:
                # Cancelled while it ran: whatever it returned or raised no longer counts (a
                # failure is not retried).
                await _end_cancelled(message, delivery, spec, rt, held)
            else:
                await _conclude(message, delivery, spec, rt, held, *outcome)
    except BaseException:
        # Stopping hard, or a bug of ours: the worker gives the message back. Free the claim
        # so the next delivery runs at once, not after the lease (owner-checked: a no-op once
        # the task is done or another worker holds it).
        if running is not None:
            running.cancel()
        # Bounded: the message is given back only after this, and a stop promises that
        # within DRAIN_CANCEL_S even when the store hangs (the lease lapses by itself).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_release(rt, spec, delivery, held), RELEASE_ON_EXIT_S)
        raise


async def _conclude(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None,
    result: Any,
    error: BaseException | None,
) -> None:
    """Store the result and ack; or release the claim, then retry or dead-letter."""
    if error is None:
        try:
            jsonable = _as_json(result)
        except UnserialisableResult as bad:
            await _release(rt, spec, delivery, held)
            await _dead_letter(message, delivery, spec, rt, DeadLetterReason.INVALID_RESULT, bad)
            return
        await _finish(message, delivery, spec, rt, jsonable, held)
        return

    if rt.spans is not None:
        rt.spans.failed(error)
    await _release(rt, spec, delivery, held)
    decision = decide(delivery.attempt, error, spec.retry)
    left = left_ms(delivery.headers, now_ms())
    if isinstance(decision, RetryLater) and left is not None and left <= decision.delay_ms:
        # It would come back from the delay queue past its deadline (or RabbitMQ would
        # expire it there, and its copy back in Q would carry no expiration): it ends now.
        expired = TaskExpired(
            f"attempt {delivery.attempt} failed ({describe(error)}) and the task's lifetime "
            f"ends in {max(left, 0) / 1000:.3g} s, before its retry in "
            f"{decision.delay_ms / 1000:.3g} s"
        )
        expired.__cause__ = error
        await _dead_letter(message, delivery, spec, rt, DeadLetterReason.EXPIRED, expired)
    elif isinstance(decision, RetryLater):
        await _status(rt, delivery, spec, TaskStatus.RETRYING, error=describe(error))
        await rt.settler.retry(
            message,
            delivery,
            queue=spec.queue,
            delay_ms=decision.delay_ms,
            error=error,
            queues_ms=delay_queue_set(spec.retry),
        )
    elif isinstance(decision, GiveUp):
        await _dead_letter(message, delivery, spec, rt, decision.reason, error)


async def _parked_until_due(
    message: AbstractIncomingMessage, delivery: Delivery, spec: HandlerSpec, rt: Runtime
) -> bool:
    """Park a task that came back from a delay queue before its not-before time in the next
    one (weclaw_mq.delays): no claim, no record, no attempt; it did not run. Its status stays
    what it was (``queued`` for a delayed publish, ``retrying`` for a retry)."""
    due = not_before_ms(delivery.headers)
    left = None if due is None else due - now_ms()
    if left is None or left <= 0:
        return False
    hop_ms = next_hop_ms(left, delay_queue_set(spec.retry))
    await rt.settler.defer(
        message, delivery, queue=spec.queue, delay_ms=hop_ms, why=f"due in {left / 1000:.3g} s"
    )
    return True


async def _expired_on_arrival(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None,
) -> bool:
    """Dead-letter a task that arrived past its deadline (RabbitMQ expires only what reaches
    the head of Q with its expiration still set; a task back from a delay queue has none).

    Checked after the guard: a copy of a task that finished or runs elsewhere is acked or
    parked as usual, never dead-lettered beside its twin's result."""
    left = left_ms(delivery.headers, now_ms())
    near = left is not None and 0 < left <= rt.settings.redis_timeout_s * 1000
    if near and held is None and rt.results is not None:
        # Unclaimed, the "running" record is written beside the handler, and could land past
        # the deadline: status() would meanwhile read the queued record as expired for a task
        # that runs. This close to the deadline, write it first, then decide.
        await _status(rt, delivery, spec, TaskStatus.RUNNING)
        left = left_ms(delivery.headers, now_ms())
    if left is None or left > 0:
        return False
    await _release(rt, spec, delivery, held)
    late = TaskExpired(
        f"the task arrived {-left / 1000:.3g} s past the end of its lifetime "
        f"(x-weclaw-ttl-ms {delivery.headers.get(h.TTL_MS)})"
    )
    await _dead_letter(message, delivery, spec, rt, DeadLetterReason.EXPIRED, late)
    return True


async def _pass_guard(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    store: TaskStore,
    rt: Runtime,
) -> str | _Gate:
    """The claim's owner token when we hold the claim, else how the delivery went on."""
    owner = new_owner()
    # With results on, the "running" record rides on the claim (one step, one round trip).
    running = _state(delivery, spec, _RUNNING) if rt.results is not None else None
    try:
        claim = await store.claim(spec.queue, delivery.task_id, owner, running=running)
    except StateCommandError as e:  # Redis is up and said no: never run unguarded for it
        log.error("the task store refused the claim: %s", e)
        await _defer(message, delivery, spec, rt, "the task store refused the claim")
        return _Gate.SETTLED
    except Exception as e:  # the store unreachable or failing: the same answer either way
        if rt.settings.guard_on_redis_down == "run_unguarded":
            log.warning("task store unavailable (%s); running UNGUARDED as configured", e)
            return _Gate.UNGUARDED
        log.warning("task store unavailable (%s: %s)", type(e).__name__, e)
        await _defer(message, delivery, spec, rt, "the task store is down, the guard cannot tell")
        return _Gate.SETTLED
    if claim is _CLAIM_CANCELLED:
        await _end_cancelled(message, delivery, spec, rt, None)
        return _Gate.SETTLED
    if claim is _CLAIM_DONE or await _finished_before(delivery, spec, rt):
        if claim is not _CLAIM_DONE:
            await _mark_done_quietly(store, spec, delivery)
        await _ack_as_duplicate(message, delivery, spec, rt)
        return _Gate.SETTLED
    if claim is _CLAIM_BUSY:
        await _defer(message, delivery, spec, rt, "another worker is running this task")
        return _Gate.SETTLED
    return owner


async def _within_limits(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    limiter: Limiter,
    task: Any,
    held: str | None,
) -> Ticket | None:
    """The ticket of a start within the handler's limits, or None when the delivery was
    settled: deferred (over a limit, or Redis down), or dead-lettered (a key function
    failed). A deferral spends no attempt and frees the claim for the copy that returns."""
    try:
        answer = await limiter.admit(spec.queue, spec.limits, task)
    except InvalidPayload as e:
        await _release(rt, spec, delivery, held)
        await _dead_letter(message, delivery, spec, rt, DeadLetterReason.INVALID_PAYLOAD, e)
        return None
    except StateCommandError as e:  # as for the guard
        log.error("the limits' store refused the admission: %s", e)
        await _release(rt, spec, delivery, held)
        await _defer(message, delivery, spec, rt, "Redis refused the limits' command")
        return None
    except Exception as e:  # Redis unreachable or failing: as for the guard
        if rt.settings.guard_on_redis_down == "run_unguarded":
            log.warning("limits unavailable (%s); running UNLIMITED as configured", e)
            return NO_TICKET
        log.warning("limits unavailable (%s: %s)", type(e).__name__, e)
        await _release(rt, spec, delivery, held)
        await _defer(message, delivery, spec, rt, "Redis is down, the limits cannot tell")
        return None
    if not isinstance(answer, Held):
        return answer
    rt.metrics.limit_deferred(spec.queue, answer.kind).inc()
    if held is not None:
        # The claim wrote "running": it waits in a delay queue now.
        await asyncio.gather(
            _release(rt, spec, delivery, held), _status(rt, delivery, spec, TaskStatus.QUEUED)
        )
    await rt.settler.defer(
        message,
        delivery,
        queue=spec.queue,
        delay_ms=answer.delay_ms,
        why=f"over its {answer.kind} limit",
        # Routine under load (one line per deferral would drown the log): the metric counts.
        level=logging.DEBUG,
    )
    return None


async def _ack_as_duplicate(
    message: AbstractIncomingMessage, delivery: Delivery, spec: HandlerSpec, rt: Runtime
) -> None:
    """Ack a copy of a task that another attempt finished: the stored final goes to the
    inbox and the notification again (readers drop repeats), then the ack."""
    await _redeliver_to_inbox(delivery, spec, rt)
    if await notify.announce_again(message, delivery, spec, rt):
        await rt.settler.ack(message, queue=spec.queue, outcome=Outcome.DUPLICATE)


async def _finished_before(delivery: Delivery, spec: HandlerSpec, rt: Runtime) -> bool:
    """Did a worker store this task's result in this queue, then die before marking it done?

    Asked only of a copy that came back unsettled (a fresh delivery cannot be in that state),
    so the common path pays no extra round trip.
    """
    if rt.results is None or not (delivery.redelivered or delivery.returns):
        return False
    try:
        state = await rt.results.get(delivery.task_id, queue=spec.queue)
    except Exception as e:  # unknown: let the guard's answer stand
        log.warning("could not read the stored result (%s)", e)
        return False
    return state is not None and state.status is TaskStatus.SUCCEEDED


async def _redeliver_to_inbox(delivery: Delivery, spec: HandlerSpec, rt: Runtime) -> None:
    """A copy of a finished task with a session: its worker may have died between storing
    the result and writing the inbox, so the stored final goes to the inbox again (readers
    drop the duplicate). Costs a read only for such copies."""
    session_id = _session_of(delivery)
    if session_id is None or rt.results is None:
        return
    try:
        state = await rt.results.get(delivery.task_id, queue=spec.queue)
        if state is not None and state.status.terminal:
            await rt.app.streams.deliver(session_id, [final_entry(state)])
    except Exception as e:  # the first copy most likely wrote it
        log.warning("could not write the final reply to the inbox again (%s)", e)


def _session_of(delivery: Delivery) -> str | None:
    """The task's session id, if it has a valid one (a foreign publisher may send junk)."""
    value = delivery.headers.get(h.SESSION_ID)
    if value is None:
        return None
    try:
        return validate_session_id(value)
    except ConfigurationError as e:
        log.warning("ignoring the task's session id: %s", e)
        return None


async def _mark_done_quietly(store: TaskStore, spec: HandlerSpec, delivery: Delivery) -> None:
    try:
        await store.finish(spec.queue, delivery.task_id, None)
    except Exception as e:  # the stored result still answers the next copy
        log.warning("could not mark the task done (%s)", e)


def _as_json(result: Any) -> Any:
    """The result as plain JSON data, decided here once, before any store write.

    A round trip through JSON text: what comes back always encodes (no cycles, no ``bytes``
    that are not UTF-8, no lone surrogates), so a store that fails later is the store's fault,
    never the value's, and is not mistaken for an outage of a value that can never be stored.
    """
    if result is None:  # the common case, a handler returning nothing: no round trip
        return None
    try:
        return pydantic_core.from_json(pydantic_core.to_json(result))
    except Exception as e:  # whatever the serialiser (or the value's own hooks) raised
        raise UnserialisableResult(
            f"handler returned a value that is not JSON: {safe_text(e)}"
        ) from e


async def _call(
    spec: HandlerSpec,
    task: Any,
    delivery: Delivery,
    rt: Runtime,
    on_stuck: Callable[[asyncio.Task[Any]], None],
    watch: Watch,
) -> tuple[Any, BaseException | None] | None:
    """Run the handler under its timeout: (its result, None), (None, the error), or None when
    it ignored its cancellation and ``on_stuck`` ended the attempt without it.

    Anything the handler raises is its attempt's failure, BaseExceptions included: a
    ``SystemExit``, ``KeyboardInterrupt`` or ``CancelledError`` of its own fails that task and
    never stops the worker (a worker stops on SIGTERM/SIGINT or ``Worker.stop``). Only a
    cancel of this task from outside (the worker stopping hard) passes through.
    """
    args: tuple[Any, ...] = (task,)
    emitter: Emitter | None = None
    if spec.takes_context:
        session_id = _session_of(delivery)
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
            cancel_requested=watch.event(),
        )
        args = (task, ctx)
    timing = rt.metrics.handler_timing(spec.queue)
    started = time.perf_counter()
    if emitter is not None:
        on_stuck = _silencing(emitter, on_stuck)
    deadline = Deadline(rt.deadlines, spec.timeout_s, on_stuck, rt.settings.handler_cancel_grace_s)
    result: Any = None
    error: BaseException | None = None
    try:
        with deadline:
            watch.attach(deadline)
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
        log.warning(
            "a handler abandoned for ignoring its cancellation ended after all (%s); "
            "its outcome is dropped: the task was already retried or dead-lettered",
            "returned" if error is None else describe(error),
        )
        return None
    if deadline.expired and error is not None:
        # Whatever the handler made of our cancellation (re-raised, wrapped), it timed out.
        timeout = HandlerTimeout(f"handler ran past its timeout of {spec.timeout_s} s")
        timeout.__cause__ = error if not isinstance(error, TimeoutError) else None
        return None, timeout
    return result, error


def _silencing(
    emitter: Emitter, on_stuck: Callable[[asyncio.Task[Any]], None]
) -> Callable[[asyncio.Task[Any]], None]:
    """An abandoned handler may go on emitting: its chunks must not land after the retry's
    attempt marker, so its stream is closed as the attempt is ended without it."""

    def stuck(task: asyncio.Task[Any]) -> None:
        emitter.close()
        on_stuck(task)

    return stuck


def _take_over(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None,
    watch: Watch,
    stuck: asyncio.Task[Any],
) -> None:
    """What the deadline ticker calls (bound to a delivery by ``functools.partial``) when the
    handler is still running ``grace`` after its cancellation: end the attempt as a failure in
    a new task, so the message is retried or dead-lettered (acked, if the task was
    cancelled), the claim released, and the worker's slot freed."""
    ending = _end_abandoned(message, delivery, spec, rt, held, watch)
    rt.take_over(message, spec, rt, stuck, ending)


async def _end_abandoned(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None,
    watch: Watch,
) -> None:
    token = tracing.enter(delivery)
    try:
        grace_s = rt.settings.handler_cancel_grace_s
        if watch.requested:
            log.error(
                "handler still running %.3g s after it was cancelled on request (it ignores "
                "cancellation); ending the attempt without it",
                grace_s,
            )
            await _end_cancelled(message, delivery, spec, rt, held)
            return
        log.error(
            "handler still running %.3g s after it was cancelled at its timeout of %.3g s "
            "(it ignores cancellation); ending the attempt without it",
            grace_s,
            spec.timeout_s,
        )
        error = HandlerAbandoned(
            f"handler ran past its timeout of {spec.timeout_s} s and ignored its cancellation "
            f"for {grace_s} s"
        )
        await _conclude(message, delivery, spec, rt, held, None, error)
    finally:
        tracing.leave(token)


async def _finish(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    result: Any,
    owner: str | None,
) -> None:
    """Store first, then notify (``notify=``), then ack: a crash in between redelivers a task
    the guard knows is done."""
    records = rt.results
    session_id = _session_of(delivery) if h.SESSION_ID in delivery.headers else None
    state = (
        _state(delivery, spec, _SUCCEEDED, result=result)
        if records is not None or session_id is not None
        else None
    )
    try:
        if owner is not None and rt.store is not None:
            # Claimed: the result and the done marker together (one step), owner-checked.
            store = rt.store
            finish = await _patiently(
                rt, lambda: store.finish(spec.queue, delivery.task_id, state, owner=owner)
            )
            if finish is _FINISH_DONE:
                # Done before this write: another attempt (which took the claim over)
                # finished first, or an earlier try of this write landed unanswered. The
                # stored result stands; this copy is a duplicate now.
                log.warning(
                    "the task was done before its result was written: the stored one stands"
                )
                await _ack_as_duplicate(message, delivery, spec, rt)
                return
            if finish is _FINISH_TAKEN:
                log.warning(
                    "this attempt had lost its claim to another one; its result is stored "
                    "first, and the other attempt will find the task done"
                )
        elif records is not None and state is not None:
            final = state
            await _patiently(rt, lambda: records.record(final))
    except ResultNotStored as e:
        await rt.settler.give_back(message, queue=spec.queue, why=str(e), level=logging.ERROR)
        return
    if session_id is not None and state is not None:
        # After the result is stored, before the ack: a crash in between redelivers the
        # task, and the guard's "done" path writes the stored final to the inbox again.
        try:
            await _to_inbox(rt, session_id, state)
        except Exception as e:
            why = f"could not write the final reply to the inbox of {session_id!r}: {e}"
            await rt.settler.give_back(message, queue=spec.queue, why=why, level=logging.ERROR)
            return
    if state is not None and not await notify.announce(message, delivery, spec, rt, state):
        return
    await rt.settler.ack(message, queue=spec.queue)


async def _to_inbox(rt: Runtime, session_id: str, state: TaskState) -> None:
    dropped = await rt.app.streams.deliver(session_id, [final_entry(state)])
    if dropped:
        log.warning(
            "the inbox of session %r is full: dropped its %d oldest entries (inbox_max_entries=%d)",
            session_id,
            dropped,
            rt.settings.inbox_max_entries,
        )


async def _cancelled_before_start(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None,
    watch: Watch,
) -> bool:
    """End a task cancelled before its handler started: by a request that came while it was
    claimed, or, for a handler that claims nothing (``idempotent=False``), by the cancel
    marker (one read; a claim reads it in the same step)."""
    if not watch.requested and not spec.idempotent and rt.store is not None:
        try:
            if await rt.store.is_cancelled(spec.queue, delivery.task_id):
                watch.request()
        except Exception as e:  # unknown: run it; a cancel request still reaches the handler
            log.warning("could not read the cancel marker (%s)", e)
    if not watch.requested:
        return False
    await _end_cancelled(message, delivery, spec, rt, held)
    return True


async def _end_cancelled(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None,
) -> None:
    """Ack a cancelled task: record ``cancelled`` (the cancel wrote it already, unless it
    named no queue and found no record) and, when claimed, mark it done, so a copy is acked
    unrun (best effort: the cancel marker answers every later copy anyway); then, for a
    ``notify=`` handler, announce it before the ack."""
    state = _state(delivery, spec, TaskStatus.CANCELLED) if rt.results is not None else None
    try:
        if held is not None and rt.store is not None:
            await rt.store.finish(spec.queue, delivery.task_id, state, owner=held)
        elif rt.results is not None and state is not None:
            await rt.results.record(state)
    except Exception as e:
        log.warning("could not record the cancel (%s)", e)
    # Announced before the ack, like every end (worker/notify.py): a publish that fails parks
    # the task, and its copy comes back to the cancel marker (or the done mark) and tries again.
    if state is not None and not await notify.announce(message, delivery, spec, rt, state):
        return
    await rt.settler.ack(message, queue=spec.queue, outcome=Outcome.CANCELLED)


async def _patiently(rt: Runtime, write: Callable[[], Awaitable[_T]]) -> _T:
    """Retry a store write with backoff for up to ``result_store_patience_s``; its answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + rt.settings.result_store_patience_s
    delay = 0.1
    while True:
        try:
            return await write()
        except Exception as e:  # any store failure is retried the same way
            if loop.time() + delay > deadline:
                raise ResultNotStored(f"could not store the result: {type(e).__name__}: {e}") from e
            log.warning("storing the result failed (%s); retrying in %.1f s", e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _release(rt: Runtime, spec: HandlerSpec, delivery: Delivery, owner: str | None) -> None:
    if owner is None or rt.store is None:
        return
    try:
        await rt.store.release(spec.queue, delivery.task_id, owner)
    except Exception as e:  # the lease lapses by itself
        log.warning("could not release the claim (%s); it lapses with its lease", e)


async def _defer(
    message: AbstractIncomingMessage, delivery: Delivery, spec: HandlerSpec, rt: Runtime, why: str
) -> None:
    await rt.settler.defer(
        message, delivery, queue=spec.queue, delay_ms=spec.retry.delay_ms(1), why=why
    )


def _state(
    delivery: Delivery,
    spec: HandlerSpec,
    status: TaskStatus,
    *,
    result: Any = None,
    error: str | None = None,
    reason: str | None = None,
) -> TaskState:
    return TaskState(
        task_id=delivery.task_id,
        queue=spec.queue,
        status=status,
        attempt=delivery.attempt,
        result=result,
        error=error,
        reason=reason,
        expires_at=as_datetime(deadline_ms(delivery.headers)),
    )


async def _status(
    rt: Runtime,
    delivery: Delivery,
    spec: HandlerSpec,
    status: TaskStatus,
    *,
    error: str | None = None,
    reason: str | None = None,
) -> None:
    """Best effort: progress statuses help the caller, but never block the task's path."""
    await _record_quietly(rt, _state(delivery, spec, status, error=error, reason=reason))


async def _record_quietly(rt: Runtime, state: TaskState) -> None:
    if rt.results is None:
        return
    try:
        await rt.results.record(state)
    except Exception as e:
        log.warning("could not record status %s (%s)", state.status.value, e)


async def _dead_letter(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    reason: DeadLetterReason,
    error: BaseException,
) -> None:
    if rt.spans is not None:
        rt.spans.failed(error)
    final = _state(
        delivery, spec, TaskStatus.DEAD_LETTERED, error=describe(error), reason=reason.value
    )
    if not await notify.announce(message, delivery, spec, rt, final, error_type=error_type(error)):
        return
    if await rt.settler.dead_letter(
        message, delivery, queue=spec.queue, reason=reason.value, error=error
    ):
        # Only once the DLQ holds it: "dead_lettered" is final for result() waiters, and a
        # failed move returns the task to its queue, where it may yet succeed.
        status = (
            TaskStatus.EXPIRED if reason is DeadLetterReason.EXPIRED else TaskStatus.DEAD_LETTERED
        )
        final = _state(delivery, spec, status, error=describe(error), reason=reason.value)
        await _record_quietly(rt, final)
        session_id = _session_of(delivery)
        if session_id is not None:
            # Best effort, after the move (the DLQ holds the task): its record still says so.
            try:
                await _to_inbox(rt, session_id, final)
            except Exception as e:
                log.warning("could not write the dead-letter to the inbox (%s)", e)

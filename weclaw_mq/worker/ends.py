"""How a delivery ends: one value of a small closed type, and the one function that carries it
out.

Every gate of the worker's path (``admission``) and every end of a handler's run (``running``,
``after_attempt``) answers with an ``End``; ``carry_out`` alone turns it into the claim's
release, the record write, the inbox entry, the notification, the span's failure and, last,
the settle through the ``Settler`` (a publish with confirm where the task moves, then the ack
or nack, and the outcome metric and log line). No other module of the worker calls the
Settler's ends, and only the Settler touches the message's ack and nack
(``tests/unit/test_settle_point.py``), so "every delivery is settled once" holds by
construction: a path that returns an ``End`` is settled by ``carry_out``, and a path that
raises is given back by ``in_flight.settled``.

Nothing here acks before the result is stored: ``Store`` writes it (with the done marker,
owner-checked, when claimed), then the inbox, then the notification, then the ack.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import pydantic_core
from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, left_ms, now_ms
from weclaw_mq.contract.message import Delivery
from weclaw_mq.errors import ResultNotStored, TaskExpired, UnserialisableResult
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.policy.failures import describe, error_type, safe_text
from weclaw_mq.policy.retry import DeadLetterReason, GiveUp, RetryLater, decide, delay_queue_set
from weclaw_mq.state import Deferral, Finish, TaskState, TaskStatus
from weclaw_mq.worker import announce as notify
from weclaw_mq.worker.records import (
    record_quietly,
    record_status,
    release,
    session_of,
    task_state,
    to_inbox,
)
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.settle import deferrals
from weclaw_mq.workflows.hops import after_end, tagged

log = logging.getLogger("weclaw_mq.worker")

_T = TypeVar("_T")


# -- the ends ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Store:
    """The handler returned ``result`` (plain JSON data): store it, then ack."""

    result: Any


@dataclass(frozen=True, slots=True)
class AckDuplicate:
    """A copy of a task another attempt finished: ack it unrun (the stored final goes to the
    inbox and the notification again). ``mark_done``: the guard's done marker is missing."""

    mark_done: bool = False


@dataclass(frozen=True, slots=True)
class AckCancelled:
    """The task was cancelled: record ``cancelled`` (and mark it done when claimed), ack."""


@dataclass(frozen=True, slots=True)
class Reattempt:
    """The attempt failed with ``error``: park the task for ``delay_ms`` as its next attempt."""

    delay_ms: int
    error: BaseException


@dataclass(frozen=True, slots=True)
class Defer:
    """Park the task without spending an attempt (it did not run, or did not fail).

    ``delay_ms`` None: the handler's first retry delay. ``queued_again``: the claim had
    written ``running``, so ``queued`` is written back as it is released. ``not_before_ms``:
    a due time past this hop (epoch ms), written on the task: it hops until then
    (``admission.parked_until_due``). ``at_midnight``: ``not_before_ms`` is the next UTC
    midnight, reached in one hop through the vhost's midnight queue. ``by``: what deferred it
    (``limit``, ``cap``, ``fallback``, ``breaker``, ``threads``): then the ``queued`` record
    says so (``TaskState.deferred``), and the task's first deferral is logged at INFO, later
    ones at DEBUG."""

    why: str
    delay_ms: int | None = None
    level: int | None = None
    queued_again: bool = False
    not_before_ms: int | None = None
    by: str | None = None
    at_midnight: bool = False


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Move the task to ``Q.dlq`` with ``reason`` and ``error``; record its final status."""

    reason: DeadLetterReason
    error: BaseException


@dataclass(frozen=True, slots=True)
class RejectOriginal:
    """Reject without requeue: a message whose properties did not decode cannot be copied,
    so the broker dead-letters the untouched original to ``Q.dlq``."""


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Return the message to its queue now (the worker stops, a result could not be stored)."""

    why: str
    level: int | None = None


End = (
    Store | AckDuplicate | AckCancelled | Reattempt | Defer | DeadLetter | RejectOriginal | GiveBack
)


def by(end: End, gate: str) -> End:
    """A gate's deferral, saying which gate: its record and its first log line say so."""
    return replace(end, by=gate) if type(end) is Defer else end


# -- deciding an attempt's end -------------------------------------------------------------


def after_attempt(
    delivery: Delivery, spec: HandlerSpec, result: Any, error: BaseException | None
) -> End:
    """What a finished run of the handler becomes: its result stored; or, for a failure, a
    retry, or the DLQ when retries are spent or the retry would land past the deadline."""
    if error is None:
        if result is None:  # the common case, a handler returning nothing: no round trip
            return Store(None)
        try:
            return Store(as_json(result))
        except UnserialisableResult as bad:
            return DeadLetter(DeadLetterReason.INVALID_RESULT, bad)
    decision = decide(delivery.attempt, error, spec.retry)
    if isinstance(decision, GiveUp):
        return DeadLetter(decision.reason, error)
    if not isinstance(decision, RetryLater):  # decide answers an error with one of the two
        raise TypeError(f"no end for {decision!r} after an error")
    left = left_ms(delivery.headers, now_ms())
    if left is not None and left <= decision.delay_ms:
        # It would come back from the delay queue past its deadline (or RabbitMQ would
        # expire it there, and its copy back in Q would carry no expiration): it ends now.
        expired = TaskExpired(
            f"attempt {delivery.attempt} failed ({describe(error)}) and the task's lifetime "
            f"ends in {max(left, 0) / 1000:.3g} s, before its retry in "
            f"{decision.delay_ms / 1000:.3g} s"
        )
        expired.__cause__ = error
        return DeadLetter(DeadLetterReason.EXPIRED, expired)
    return Reattempt(decision.delay_ms, error)


def as_json(result: Any) -> Any:
    """The result as plain JSON data, decided here once, before any store write.

    A round trip through JSON text: what comes back always encodes (no cycles, no ``bytes``
    that are not UTF-8, no lone surrogates), so a store that fails later is the store's fault,
    never the value's, and is not mistaken for an outage of a value that can never be stored.
    """
    if result is None:
        return None
    try:
        return pydantic_core.from_json(pydantic_core.to_json(result))
    except Exception as e:  # whatever the serialiser (or the value's own hooks) raised
        raise UnserialisableResult(
            f"handler returned a value that is not JSON: {safe_text(e)}"
        ) from e


# -- carrying it out -----------------------------------------------------------------------

# Read once: on Python 3.11 every ``EnumClass.MEMBER`` is a descriptor call, per use.
_SUCCEEDED = TaskStatus.SUCCEEDED
_FINISH_DONE = Finish.DONE
_FINISH_TAKEN = Finish.TAKEN


async def carry_out(
    end: End,
    message: AbstractIncomingMessage,
    delivery: Delivery | None,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None = None,
) -> None:
    """Settle ``message`` as ``end`` says, once. ``held``: the claim's owner token, which every
    end that does not finish the task releases first. ``delivery`` may be None only for a
    ``GiveBack`` (a message given back before it was read)."""
    if type(end) is Store:  # the common end first, without a pattern match
        assert delivery is not None
        await _store(end.result, message, delivery, spec, rt, held)
        return
    if isinstance(end, GiveBack):
        await rt.settler.give_back(message, queue=spec.queue, why=end.why, level=end.level)
        return
    assert delivery is not None
    match end:
        case Reattempt(delay_ms=delay_ms, error=error):
            if rt.spans is not None:
                rt.spans.failed(error)
            await release(rt, spec, delivery, held)
            await record_status(rt, delivery, spec, TaskStatus.RETRYING, error=describe(error))
            await rt.settler.retry(
                message,
                delivery,
                queue=spec.queue,
                delay_ms=delay_ms,
                error=error,
                queues_ms=delay_queue_set(spec.retry),
            )
        case DeadLetter(reason=reason, error=error):
            await release(rt, spec, delivery, held)
            await _dead_letter(message, delivery, spec, rt, reason, error)
        case Defer(by=by):
            level = end.level
            if by is not None:
                await asyncio.gather(
                    release(rt, spec, delivery, held),
                    # "running" is ours when our claim wrote it, or this delivery did as its
                    # handler was to start (no thread took it).
                    _record_deferral(rt, delivery, spec, end, held is not None or by == "threads"),
                )
                level = logging.INFO if deferrals(delivery) == 0 else logging.DEBUG
            elif end.queued_again and held is not None:
                # The claim wrote "running": it waits in a delay queue now.
                await asyncio.gather(
                    release(rt, spec, delivery, held),
                    record_status(rt, delivery, spec, TaskStatus.QUEUED),
                )
            else:
                await release(rt, spec, delivery, held)
            await _defer(
                message,
                delivery,
                spec,
                rt,
                end.why,
                end.delay_ms,
                level,
                end.not_before_ms,
                end.at_midnight,
            )
        case AckDuplicate(mark_done=mark_done):
            if mark_done and rt.store is not None:
                try:
                    await rt.store.finish(spec.queue, delivery.task_id, None)
                except Exception as e:  # the stored result still answers the next copy
                    log.warning("could not mark the task done (%s)", e)
            await _ack_duplicate(message, delivery, spec, rt)
        case AckCancelled():
            await _ack_cancelled(message, delivery, spec, rt, held)
        case RejectOriginal():
            await rt.settler.reject(message, queue=spec.queue)


async def give_back(
    message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime, why: str, level: int
) -> None:
    """Return a message the worker will not process (it stops, or its consumer is gone)."""
    await carry_out(GiveBack(why, level), message, None, spec, rt)


async def _defer(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    why: str,
    delay_ms: int | None = None,
    level: int | None = None,
    not_before_ms: int | None = None,
    at_midnight: bool = False,
) -> None:
    await rt.settler.defer(
        message,
        delivery,
        queue=spec.queue,
        delay_ms=spec.retry.delay_ms(1) if delay_ms is None else delay_ms,
        why=why,
        level=level,
        not_before_ms=not_before_ms,
        at_midnight=at_midnight,
    )


# A deferral is written over a record of a task still on its way, never over a final one;
# over "running" only by the claim's holder (whose claim wrote it): else it may be another
# copy's run.
_WAITING = (TaskStatus.QUEUED, TaskStatus.RETRYING, TaskStatus.STORED_LOCALLY)
_WAITING_OR_OURS = (*_WAITING, TaskStatus.RUNNING)


async def _record_deferral(
    rt: Runtime, delivery: Delivery, spec: HandlerSpec, end: Defer, claimed: bool
) -> None:
    """The ``queued`` record of a deferred task, saying why and when it comes back (best
    effort, as every progress status). The last failure its copy carries stays on it."""
    if rt.results is None:
        return
    if end.not_before_ms is not None:
        due_ms = end.not_before_ms
    else:
        due_ms = now_ms() + (spec.retry.delay_ms(1) if end.delay_ms is None else end.delay_ms)
    failed = delivery.headers.get(h.ERROR_TYPE)
    state = task_state(
        delivery,
        spec,
        TaskStatus.QUEUED,
        error=None if failed is None else f"{failed}: {delivery.headers.get(h.ERROR_MESSAGE, '')}",
    )
    state.deferred = Deferral(
        by=end.by or "",
        why=end.why,
        next_try_at=as_datetime(due_ms),
        count=deferrals(delivery) + 1,
    )
    try:
        await rt.results.record(state, only_over=_WAITING_OR_OURS if claimed else _WAITING)
    except Exception as e:
        log.warning("could not record the deferral (%s)", e)


async def _announced(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    failed: str | None,
) -> bool:
    """True when the notification is out (or none is due); else the task is parked, to try
    again when it comes back (``worker.announce``), and False."""
    if failed is None:
        return True
    await _defer(message, delivery, spec, rt, failed)
    return False


async def _store(
    result: Any,
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    owner: str | None,
) -> None:
    """Store first, then notify (``notify=``), then ack: a crash in between redelivers a task
    the guard knows is done."""
    records = rt.results
    session_id = session_of(delivery) if h.SESSION_ID in delivery.headers else None
    state = (
        task_state(delivery, spec, _SUCCEEDED, result=result)
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
                await _ack_duplicate(message, delivery, spec, rt)
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
            await to_inbox(rt, session_id, state)
        except Exception as e:
            why = f"could not write the final reply to the inbox of {session_id!r}: {e}"
            await rt.settler.give_back(message, queue=spec.queue, why=why, level=logging.ERROR)
            return
    if state is None or await _heard(message, delivery, spec, rt, state):
        await rt.settler.ack(message, queue=spec.queue)


async def _heard(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    final: TaskState | None,
    *,
    told: TaskState | None = None,
    error_type: str | None = None,
) -> bool:
    """True once ``final`` is announced (``notify=``) and the task's workflow heard of its end
    (``told``, default ``final``); else the task is parked, to try again when it comes back,
    and False. Before the settle, always: a crash in between redelivers it, and it tries again."""
    if final is None:
        return True
    failed = await notify.announce(delivery, spec, rt, final, error_type=error_type)
    if failed is not None:
        await _defer(message, delivery, spec, rt, failed)
        return False
    if h.WORKFLOW not in delivery.headers:
        return True
    return await _told(message, delivery, spec, rt, final if told is None else told)


async def _told(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    final: TaskState | None,
) -> bool:
    """A workflow's task: True once its workflow heard of ``final`` (the next stage or the
    callback confirmed on the broker, ``workflows.hops``), else it is parked, to tell it
    again when it comes back; True for a task of no workflow. Before the ack, always."""
    place = tagged(delivery.headers, delivery.task_id)
    if place is None or final is None:
        return True
    return await _announced(
        message, delivery, spec, rt, await after_end(rt.app, place, final, delivery.trace_id)
    )


async def _tell_again(
    message: AbstractIncomingMessage, delivery: Delivery, spec: HandlerSpec, rt: Runtime
) -> bool:
    """A copy of a finished workflow task: its worker may have died before the hop's confirm,
    so the workflow hears of the stored end again (its step answers as before, and a hop
    published twice has the same task id, which the next handler's guard absorbs)."""
    if rt.results is None or tagged(delivery.headers, delivery.task_id) is None:
        return True
    try:
        final = await rt.results.get(delivery.task_id, queue=spec.queue)
    except Exception as e:  # unknown: not acked until the workflow is known to be told
        await _defer(message, delivery, spec, rt, f"its stored end could not be read ({e})")
        return False
    if final is None or not final.status.terminal:
        log.warning("a finished workflow task's record is gone: its workflow is not told again")
        return True
    return await _told(message, delivery, spec, rt, final)


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


async def _ack_duplicate(
    message: AbstractIncomingMessage, delivery: Delivery, spec: HandlerSpec, rt: Runtime
) -> None:
    """Ack a copy of a task that another attempt finished: the stored final goes to the
    inbox and the notification again (readers drop repeats), then the ack."""
    await _redeliver_to_inbox(delivery, spec, rt)
    if not await _announced(
        message, delivery, spec, rt, await notify.announce_again(delivery, spec, rt)
    ):
        return
    if h.WORKFLOW in delivery.headers and not await _tell_again(message, delivery, spec, rt):
        return
    await rt.settler.ack(message, queue=spec.queue, outcome=Outcome.DUPLICATE)


async def _redeliver_to_inbox(delivery: Delivery, spec: HandlerSpec, rt: Runtime) -> None:
    """A copy of a finished task with a session: its worker may have died between storing
    the result and writing the inbox, so the stored final goes to the inbox again (readers
    drop the duplicate). Costs a read only for such copies."""
    session_id = session_of(delivery)
    if session_id is None or rt.results is None:
        return
    try:
        state = await rt.results.get(delivery.task_id, queue=spec.queue)
        if state is not None and state.status.terminal:
            await to_inbox(rt, session_id, state)
    except Exception as e:  # the first copy most likely wrote it
        log.warning("could not write the final reply to the inbox again (%s)", e)


async def _ack_cancelled(
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
    state = task_state(delivery, spec, TaskStatus.CANCELLED) if rt.results is not None else None
    try:
        if held is not None and rt.store is not None:
            await rt.store.finish(spec.queue, delivery.task_id, state, owner=held)
        elif rt.results is not None and state is not None:
            await rt.results.record(state)
    except Exception as e:
        log.warning("could not record the cancel (%s)", e)
    # Announced before the ack, like every end (worker/notify.py): a publish that fails parks
    # the task, and its copy comes back to the cancel marker (or the done mark) and tries again.
    if await _heard(message, delivery, spec, rt, state):
        await rt.settler.ack(message, queue=spec.queue, outcome=Outcome.CANCELLED)


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
    announced = task_state(
        delivery, spec, TaskStatus.DEAD_LETTERED, error=describe(error), reason=reason.value
    )
    # Its record says "expired" where the notification said "dead_lettered"; else the same.
    final = (
        task_state(delivery, spec, TaskStatus.EXPIRED, error=describe(error), reason=reason.value)
        if reason is DeadLetterReason.EXPIRED
        else announced
    )
    # Its workflow hears of it before the move, as the notification does: after it, a crash
    # would leave the task in the DLQ and the workflow waiting for its deadline.
    if not await _heard(
        message, delivery, spec, rt, announced, told=final, error_type=error_type(error)
    ):
        return
    if await rt.settler.dead_letter(
        message, delivery, queue=spec.queue, reason=reason.value, error=error
    ):
        # Only once the DLQ holds it: "dead_lettered" is final for result() waiters, and a
        # failed move returns the task to its queue, where it may yet succeed.
        await record_quietly(rt, final)
        session_id = session_of(delivery)
        if session_id is not None:
            # Best effort, after the move (the DLQ holds the task): its record still says so.
            try:
                await to_inbox(rt, session_id, final)
            except Exception as e:
                log.warning("could not write the dead-letter to the inbox (%s)", e)

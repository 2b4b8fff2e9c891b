"""How a delivery ends: one value of a small closed type, and the one function that carries it
out.

Every gate of the worker's path (``admission``) and every end of a handler's run (``running``,
``after_attempt``) answers with an ``End``; ``carry_out`` alone turns it into the claim's
release, the record write, the inbox entry, the notification, the span's failure and, last,
the settle through the ``Settler`` (a publish with confirm where the task moves, then the ack
or nack, and the outcome metric and log line). It decides all of that first, as one
``Ending`` (``decided``: nothing written or sent there), then carries it out in one pass:
``records.write``, ``announce.heard``, the settle. No other module of the worker calls the
Settler's ends, and only the Settler touches the message's ack and nack
(``tests/unit/test_settle_point.py``), so "every delivery is settled once" holds by
construction: a path that returns an ``End`` is settled by ``carry_out``, and a path that
raises is given back by ``in_flight.settled``.

Nothing here acks before the result is stored: a ``Store`` end writes it (with the done
marker, owner-checked, when claimed), then the inbox, then the notification, then the ack.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import pydantic_core
from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, left_ms, now_ms
from weclaw_mq.contract.message import Delivery
from weclaw_mq.errors import TaskExpired, UnserialisableResult
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.policy.failures import describe, error_type, safe_text
from weclaw_mq.policy.retry import DeadLetterReason, GiveUp, RetryLater, decide, delay_queue_set
from weclaw_mq.state import Deferral, TaskState, TaskStatus
from weclaw_mq.worker import announce as notify
from weclaw_mq.worker.announce import AGAIN, Heard
from weclaw_mq.worker.long_runs import LongRun, ended, hand_over
from weclaw_mq.worker.records import How, Writes, Written, after_move, session_of, task_state, write
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")


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
class AckStale:
    """A long run's watch copy no longer needed (``state.watches``): its run ended, or a newer
    copy carries the task. Acked unrun, nothing written."""


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
    Store
    | AckDuplicate
    | AckStale
    | AckCancelled
    | Reattempt
    | Defer
    | DeadLetter
    | RejectOriginal
    | GiveBack
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


@dataclass(frozen=True, slots=True)
class Ending:
    """An end, decided: its writes beside the message (``records.Writes``), what it tells
    before the settle (``announce.Heard``), then the settle as ``settle`` says; ``after``: the
    record (and inbox entry) written once the move landed (a dead letter's). ``failed``: the
    error the delivery's span ends with. ``delay_ms``, ``level``: a deferral's settle,
    resolved (the handler's first retry delay, the first deferral's log level)."""

    settle: End
    writes: Writes | None = None
    heard: Heard | None = None
    after: TaskState | None = None
    failed: BaseException | None = None
    delay_ms: int | None = None
    level: int | None = None


# Read once: on Python 3.11 every ``EnumClass.MEMBER`` is a descriptor call, per use.
_STALE_TEXT = "acked without running the handler: a long run's watch copy no longer needed"
_SUCCEEDED = TaskStatus.SUCCEEDED
_RESULT = How.RESULT
_OK = Written.OK
# The common end: a result of None, nothing to write, announce or tell: the ack alone.
_ACK = Ending(Store(None))


async def carry_out(
    end: End,
    message: AbstractIncomingMessage,
    delivery: Delivery | None,
    spec: HandlerSpec,
    rt: Runtime,
    held: str | None = None,
    long_run: LongRun | None = None,
) -> None:
    """Settle ``message`` as ``end`` says, once: what the end does is decided first, as one
    ``Ending``, then carried out here, in its order: the writes (the claim's release, the
    record, the inbox), the notification and the workflow's hop, the settle. ``held``: the
    claim's owner token, which every end that does not finish the task releases first.
    ``delivery`` may be None only for a ``GiveBack`` (a message given back before it was
    read). ``long_run``: the delivery was acked as its run began (``worker.long_runs``): a
    move is published first, then the watch ended and the claim released; a give-back is a
    hand-over."""
    ending = _ACK if delivery is None else decided(end, delivery, spec, rt, held)
    release_after: str | None = None
    if long_run is not None and ending.writes is not None and ending.writes.release:
        # Its watch copy would run it again once the claim is free: freed after the move.
        release_after = ending.writes.release
        ending = replace(ending, writes=replace(ending.writes, release=None, together=False))
    settle = end
    queues_ms: tuple[int, ...] | None = None
    if delivery is not None and ending is not _ACK:
        settle = ending.settle
        if ending.failed is not None and rt.spans is not None:
            rt.spans.failed(ending.failed)
        heard = ending.heard
        if ending.writes is not None:
            written = await write(rt, spec, delivery, ending.writes)
            if type(written) is str:  # a write that must land did not: the task goes back
                settle, heard = GiveBack(written, logging.ERROR), None
            elif written is not _OK:  # done before: this copy is a duplicate now
                settle, heard = AckDuplicate(), AGAIN
        if heard is not None:
            failed = await notify.heard(delivery, spec, rt, heard)
            if failed is not None:  # not told yet: parked, to try again when it comes back
                settle = Defer(failed)
                ending = Ending(settle, delay_ms=spec.retry.delay_ms(1))
        if type(settle) is Reattempt:  # its hops through the handler's delay queues
            queues_ms = delay_queue_set(spec.retry)
    if type(settle) is Store:  # the common end first, without a pattern match
        await rt.settler.ack(message, queue=spec.queue)
        return
    if isinstance(settle, GiveBack):
        if long_run is not None and delivery is not None:
            await hand_over(rt, spec, delivery, message, long_run, held)
            return
        await rt.settler.give_back(message, queue=spec.queue, why=settle.why, level=settle.level)
        return
    assert delivery is not None
    moved = True
    match settle:
        case AckDuplicate():
            await rt.settler.ack(message, queue=spec.queue, outcome=Outcome.DUPLICATE)
        case AckStale():
            await rt.settler.ack(
                message, queue=spec.queue, outcome=Outcome.DUPLICATE, text=_STALE_TEXT
            )
        case AckCancelled():
            await rt.settler.ack(message, queue=spec.queue, outcome=Outcome.CANCELLED)
        case Reattempt(delay_ms=delay_ms, error=error):
            moved = await rt.settler.retry(
                message,
                delivery,
                queue=spec.queue,
                delay_ms=delay_ms,
                error=error,
                queues_ms=queues_ms,
            )
        case Defer():
            assert ending.delay_ms is not None  # resolved as it was decided
            moved = await rt.settler.defer(
                message,
                delivery,
                queue=spec.queue,
                delay_ms=ending.delay_ms,
                why=settle.why,
                level=ending.level,
                not_before_ms=settle.not_before_ms,
                at_midnight=settle.at_midnight,
            )
        case DeadLetter(reason=reason, error=error):
            moved = await rt.settler.dead_letter(
                message, delivery, queue=spec.queue, reason=reason.value, error=error
            )
            if moved and ending.after is not None:
                # Only once the DLQ holds it: "dead_lettered" is final for result() waiters,
                # and a failed move returns the task to its queue, where it may yet succeed.
                await after_move(rt, delivery, ending.after)
        case RejectOriginal():
            await rt.settler.reject(message, queue=spec.queue)
    if long_run is not None and release_after is not None:
        await ended(rt, spec, delivery, long_run, release_after, moved=moved)


def decided(
    end: End, delivery: Delivery, spec: HandlerSpec, rt: Runtime, held: str | None
) -> Ending:
    """What ``end`` does, as one value: nothing is written, published or settled here."""
    if type(end) is Defer:
        return _deferred(end, delivery, spec, rt, held)
    if type(end) is Store:
        session_id = session_of(delivery) if h.SESSION_ID in delivery.headers else None
        claimed = held is not None and rt.store is not None
        if rt.results is None and session_id is None:
            if not claimed:
                return _ACK
            state = None
        else:
            state = task_state(delivery, spec, _SUCCEEDED, result=end.result)
        # Store first, then the inbox, then notify (``notify=``), then ack: a crash in between
        # redelivers a task the guard knows is done.
        return Ending(
            end,
            Writes(state, _RESULT, owner=held if claimed else None, inbox=session_id),
            None if state is None else Heard(state),
        )
    match end:
        case Reattempt(error=error):
            retrying = (
                task_state(delivery, spec, TaskStatus.RETRYING, error=describe(error))
                if rt.results is not None
                else None
            )
            return Ending(end, Writes(retrying, release=held), failed=error)
        case DeadLetter(reason=reason, error=error):
            announced = task_state(
                delivery, spec, TaskStatus.DEAD_LETTERED, error=describe(error), reason=reason.value
            )
            # Its record says "expired" where the notification said "dead_lettered"; else the
            # same. Its workflow hears of it before the move, as the notification does: after
            # it, a crash would leave the task in the DLQ and the workflow waiting for its
            # deadline.
            final = (
                task_state(
                    delivery, spec, TaskStatus.EXPIRED, error=describe(error), reason=reason.value
                )
                if reason is DeadLetterReason.EXPIRED
                else announced
            )
            return Ending(
                end,
                Writes(release=held),
                Heard(announced, told=final, error_type=error_type(error)),
                after=final,
                failed=error,
            )
        case AckDuplicate(mark_done=mark_done):
            # The stored final goes to the inbox and the notification again (readers drop
            # repeats), then the ack.
            return Ending(end, Writes(mark_done=mark_done, inbox_again=True), AGAIN)
        case AckCancelled():
            # Record ``cancelled`` (the cancel wrote it already, unless it named no queue and
            # found no record) and, when claimed, mark it done, so a copy is acked unrun (best
            # effort: the cancel marker answers every later copy anyway); announced before the
            # ack, like every end: a publish that fails parks the task, and its copy comes back
            # to the cancel marker (or the done mark) and tries again.
            cancelled = (
                task_state(delivery, spec, TaskStatus.CANCELLED) if rt.results is not None else None
            )
            return Ending(
                end,
                Writes(cancelled, How.CANCEL, owner=held),
                None if cancelled is None else Heard(cancelled),
            )
    return Ending(end)  # given back or rejected: the settle alone


# A deferral is written over a record of a task still on its way, never over a final one;
# over "running" only by the claim's holder (whose claim wrote it): else it may be another
# copy's run.
_WAITING = (TaskStatus.QUEUED, TaskStatus.RETRYING, TaskStatus.STORED_LOCALLY)
_WAITING_OR_OURS = (*_WAITING, TaskStatus.RUNNING)


def _deferred(
    end: Defer, delivery: Delivery, spec: HandlerSpec, rt: Runtime, held: str | None
) -> Ending:
    """A deferral's ending: the claim released and, for a gate's (``by``), the ``queued``
    record saying why and when it comes back (best effort, as every progress status; the last
    failure its copy carries stays on it), its first deferral logged at INFO."""
    delay_ms = spec.retry.delay_ms(1) if end.delay_ms is None else end.delay_ms
    count = delivery.deferrals
    if end.by is None:
        if end.queued_again and held is not None and rt.results is not None:
            # The claim wrote "running": it waits in a delay queue now.
            queued = task_state(delivery, spec, TaskStatus.QUEUED)
            writes = Writes(queued, release=held, together=True)
        else:
            writes = Writes(release=held)
        return Ending(end, writes, delay_ms=delay_ms, level=end.level)
    level = logging.INFO if count == 0 else logging.DEBUG
    if rt.results is None:
        return Ending(end, Writes(release=held), delay_ms=delay_ms, level=level)
    due_ms = end.not_before_ms if end.not_before_ms is not None else now_ms() + delay_ms
    failed = delivery.headers.get(h.ERROR_TYPE)
    state = task_state(
        delivery,
        spec,
        TaskStatus.QUEUED,
        error=None if failed is None else f"{failed}: {delivery.headers.get(h.ERROR_MESSAGE, '')}",
    )
    state.deferred = Deferral(
        by=end.by, why=end.why, next_try_at=as_datetime(due_ms), count=count + 1
    )
    # "running" is ours when our claim wrote it, or this delivery did as its handler was to
    # start (no thread took it).
    claimed = held is not None or end.by == "threads"
    only_over = _WAITING_OR_OURS if claimed else _WAITING
    return Ending(
        end,
        Writes(state, How.DEFERRAL, release=held, together=True, only_over=only_over),
        delay_ms=delay_ms,
        level=level,
    )


async def give_back(
    message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime, why: str, level: int
) -> None:
    """Return a message the worker will not process (it stops, or its consumer is gone)."""
    await carry_out(GiveBack(why, level), message, None, spec, rt)

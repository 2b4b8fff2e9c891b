"""What a delivery writes beside its message: the task's record, its session's inbox, and the
release of its claim. Every write here is best effort or says how it failed; none settles.

``write`` carries out the writes an end decided (``Writes``), all of them, in their order: the
claim's release, the task's record (with the done marker when claimed), the session's inbox.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms
from weclaw_mq.contract.message import Delivery
from weclaw_mq.contract.naming import session_id_or_none, validate_session_id
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.state import Finish, TaskState, TaskStatus
from weclaw_mq.streaming.events import final_entry
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")


def task_state(
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
        session_id=session_id_or_none(delivery.headers.get(h.SESSION_ID)),
        model=delivery.model,
    )


async def record_status(
    rt: Runtime,
    delivery: Delivery,
    spec: HandlerSpec,
    status: TaskStatus,
    *,
    error: str | None = None,
    reason: str | None = None,
) -> None:
    """Best effort: progress statuses help the caller, but never block the task's path."""
    await record_quietly(rt, task_state(delivery, spec, status, error=error, reason=reason))


async def record_quietly(rt: Runtime, state: TaskState) -> None:
    if rt.results is None:
        return
    try:
        await rt.results.record(state)
    except Exception as e:
        log.warning("could not record status %s (%s)", state.status.value, e)


def session_of(delivery: Delivery) -> str | None:
    """The task's session id, if it has a valid one (a foreign publisher may send junk)."""
    value = delivery.headers.get(h.SESSION_ID)
    if value is None:
        return None
    try:
        return validate_session_id(value)
    except ConfigurationError as e:
        log.warning("ignoring the task's session id: %s", e)
        return None


async def to_inbox(rt: Runtime, session_id: str, state: TaskState) -> None:
    dropped = await rt.app.streams.deliver(session_id, [final_entry(state)])
    if dropped:
        log.warning(
            "the inbox of session %r is full: dropped its %d oldest entries (inbox_max_entries=%d)",
            session_id,
            dropped,
            rt.settings.inbox_max_entries,
        )


async def release(rt: Runtime, spec: HandlerSpec, delivery: Delivery, owner: str | None) -> None:
    """Free the claim ``owner`` holds, so the next copy runs at once (owner-checked)."""
    if owner is None or rt.store is None:
        return
    try:
        await rt.store.release(spec.queue, delivery.task_id, owner)
    except Exception as e:  # the lease lapses by itself
        log.warning("could not release the claim (%s); it lapses with its lease", e)


# -- an end's writes, carried out ----------------------------------------------------------


class How(enum.Enum):
    """How an end writes the task's record."""

    PROGRESS = "progress"  # best effort, as every progress status
    RESULT = "result"  # patiently, owner-checked with the done marker when claimed; must land
    CANCEL = "cancel"  # with the done marker when claimed; best effort
    DEFERRAL = "deferral"  # best effort, only over a record of a task still on its way


class Written(enum.Enum):
    """What ``write`` found, when every write that must land did."""

    OK = "ok"
    # Done before this end's result was written: the stored one stands, this copy is a
    # duplicate now (its stored final went to the inbox again).
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class Writes:
    """The writes of one end, in their order. ``release``: the claim's owner token to free
    first (an end that does not finish the task); ``together``: the release and the record at
    once. ``owner``: the claim's token a finishing record is written with (and the done
    marker). ``inbox``: the session the record goes to as its final reply (must land);
    ``inbox_again``: the stored final goes to the inbox again (a copy of a finished task).
    ``mark_done``: the guard's done marker alone (best effort)."""

    state: TaskState | None = None
    how: How = How.PROGRESS
    release: str | None = None
    together: bool = False
    owner: str | None = None
    only_over: tuple[TaskStatus, ...] | None = None
    inbox: str | None = None
    inbox_again: bool = False
    mark_done: bool = False


# Read once: on Python 3.11 every ``EnumClass.MEMBER`` is a descriptor call, per use.
_FINISH_DONE = Finish.DONE
_FINISH_TAKEN = Finish.TAKEN


async def write(rt: Runtime, spec: HandlerSpec, delivery: Delivery, w: Writes) -> Written | str:
    """Carry out ``w``: ``Written`` when every write that must land did, else why not (the
    message is given back)."""
    written = await _record(rt, spec, delivery, w)
    if isinstance(written, str):
        return written
    if w.inbox_again or written is Written.DUPLICATE or w.inbox is not None:
        return await _inbox(rt, spec, delivery, w, written)
    return written


async def after_move(rt: Runtime, delivery: Delivery, final: TaskState) -> None:
    """A dead letter's record and inbox entry, once the DLQ holds it: "dead_lettered" is final
    for result() waiters, and a failed move returns the task to its queue, where it may yet
    succeed."""
    await record_quietly(rt, final)
    session_id = session_of(delivery)
    if session_id is not None:
        # Best effort, after the move (the DLQ holds the task): its record still says so.
        try:
            await to_inbox(rt, session_id, final)
        except Exception as e:
            log.warning("could not write the dead-letter to the inbox (%s)", e)


async def _record(rt: Runtime, spec: HandlerSpec, delivery: Delivery, w: Writes) -> Written | str:
    """The claim's release, the task's record as ``w.how`` says, and the done marker alone
    (``mark_done``), each store call here: every record but the result is best effort; the
    result is retried for up to ``result_store_patience_s``, and why it could not be stored
    is answered."""
    state, store, records = w.state, rt.store, rt.results
    written = Written.OK
    failed: BaseException | None = None  # a best-effort record's failure, told below
    if w.together:  # the record beside the release, at once (best effort, both)
        freed = release(rt, spec, delivery, w.release)
        if records is None or state is None:
            await freed
        else:
            write = (
                records.record(state)
                if w.only_over is None
                else records.record(state, only_over=w.only_over)
            )
            _, done = await asyncio.gather(freed, write, return_exceptions=True)
            failed = done if isinstance(done, Exception) else None
    elif w.release is not None and store is not None:
        try:
            await store.release(spec.queue, delivery.task_id, w.release)
        except Exception as e:  # the lease lapses by itself
            log.warning("could not release the claim (%s); it lapses with its lease", e)
    if w.how is How.RESULT:  # never together: the result is not written beside a release
        loop = asyncio.get_running_loop()
        deadline = loop.time() + rt.settings.result_store_patience_s
        delay = 0.1
        while True:
            try:
                if w.owner is not None and store is not None:
                    # Claimed: the result and the done marker together (one step),
                    # owner-checked.
                    finish = await store.finish(spec.queue, delivery.task_id, state, owner=w.owner)
                    if finish is _FINISH_DONE:
                        # Done before this write: another attempt (which took the claim over)
                        # finished first, or an earlier try of this write landed unanswered.
                        log.warning(
                            "the task was done before its result was written: the stored one stands"
                        )
                        written = Written.DUPLICATE
                    elif finish is _FINISH_TAKEN:
                        log.warning(
                            "this attempt had lost its claim to another one; its result is "
                            "stored first, and the other attempt will find the task done"
                        )
                elif records is not None and state is not None:
                    await records.record(state)
                break
            except Exception as e:  # any store failure is retried the same way
                if loop.time() + delay > deadline:
                    return f"could not store the result: {type(e).__name__}: {e}"
                log.warning("storing the result failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
    elif w.how is How.CANCEL:
        try:
            if w.owner is not None and store is not None:
                await store.finish(spec.queue, delivery.task_id, state, owner=w.owner)
            elif records is not None and state is not None:
                await records.record(state)
        except Exception as e:
            log.warning("could not record the cancel (%s)", e)
    elif not w.together and state is not None and records is not None:
        try:
            if w.only_over is None:
                await records.record(state)
            else:
                await records.record(state, only_over=w.only_over)
        except Exception as e:
            failed = e
    if failed is not None and state is not None:
        if w.how is How.DEFERRAL:
            log.warning("could not record the deferral (%s)", failed)
        else:
            log.warning("could not record status %s (%s)", state.status.value, failed)
    if w.mark_done and store is not None:
        try:
            await store.finish(spec.queue, delivery.task_id, None)
        except Exception as e:  # the stored result still answers the next copy
            log.warning("could not mark the task done (%s)", e)
    return written


async def _inbox(
    rt: Runtime, spec: HandlerSpec, delivery: Delivery, w: Writes, written: Written
) -> Written | str:
    """The session's inbox: the end's final reply (must land: after the result is stored,
    before the ack, so a crash in between redelivers the task, and the guard's "done" path
    writes the stored final to the inbox again); or, for a copy of a finished task, the stored
    final again, since its worker may have died between storing the result and writing the
    inbox (best effort: readers drop the duplicate; costs a read only for such copies)."""
    again = w.inbox_again or written is Written.DUPLICATE
    session_id = session_of(delivery) if again else w.inbox
    if session_id is None or (again and rt.results is None):
        return written
    state = w.state
    try:
        if again and rt.results is not None:
            state = await rt.results.get(delivery.task_id, queue=spec.queue)
            if state is None or not state.status.terminal:
                return written
        if state is not None:
            await to_inbox(rt, session_id, state)
    except Exception as e:
        if again:  # the first copy most likely wrote it
            log.warning("could not write the final reply to the inbox again (%s)", e)
            return written
        return f"could not write the final reply to the inbox of {session_id!r}: {e}"
    return written

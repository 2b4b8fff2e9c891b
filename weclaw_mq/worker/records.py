"""What a delivery writes beside its message: the task's record, its session's inbox, and the
release of its claim. Every write here is best effort or says how it failed; none settles."""

from __future__ import annotations

import logging
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms
from weclaw_mq.contract.message import Delivery
from weclaw_mq.contract.naming import session_id_or_none, validate_session_id
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.state import TaskState, TaskStatus
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

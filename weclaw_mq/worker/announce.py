"""Result notifications, the worker's side: announce a task's final state before settling it.

For a handler with ``notify=``, the order is "store the result, publish the notification with
a confirm, ack" (a dead letter: "publish the notification, move the task to Q.dlq"; a
cancelled task: "record cancelled, publish the notification, ack", whether the cancel found
it waiting or running; each later copy meets the cancel marker and announces again). A crash
anywhere in between leaves the task's message unacked, so the broker delivers it again:

- killed before the notification's confirm: the copy finds the task done (the guard) and
  publishes the notification then, from the stored record;
- killed after it: the copy publishes it again, with the same message id: a duplicate, which
  the notification handler's guard acks unrun.

So no notification is lost, and a crash adds at most one copy of it per task it interrupts.

A notification that cannot be published (the broker nacks it, its queue is missing or full,
the connection is lost) must not let the task be acked. The task is parked in its first delay
queue instead (``ends.Defer``: a copy with confirm, then the ack; no attempt used), comes
back, and tries again: a results queue that refuses keeps its tasks cycling through the delay
queue, never in a hot loop of redeliveries that would end them in the DLQ as a crash loop.
A succeeded task is not run again (the guard finds it done); a task on its way to the DLQ is
(its claim was released when it failed), and ends the same way unless it now succeeds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.message import Delivery, build_message, publish_headers
from weclaw_mq.errors import WeclawMQError
from weclaw_mq.handlers.notifications import TaskNotification
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import NotifyOutcome
from weclaw_mq.policy.failures import describe
from weclaw_mq.state import TaskState
from weclaw_mq.workflows.hops import after_end, tagged

if TYPE_CHECKING:
    from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")


@dataclass(frozen=True, slots=True)
class Heard:
    """What an end tells before its settle: ``final`` to the ``notify=`` queue, and ``told``
    (default ``final``) to the task's workflow. ``again``: a copy of a finished task, which
    tells the stored final again instead."""

    final: TaskState | None = None
    told: TaskState | None = None
    error_type: str | None = None
    again: bool = False


# A copy of a finished task: it announces and tells its stored end again.
AGAIN = Heard(again=True)


async def heard(delivery: Delivery, spec: HandlerSpec, rt: Runtime, what: Heard) -> str | None:
    """None once the end is announced (``notify=``) and the task's workflow heard of it; else
    why not: the caller parks the task, to try again when it comes back. Before the settle,
    always: a crash in between redelivers it, and it tries again."""
    final, told = what.final, what.told
    if what.again:
        stored = await _stored(delivery, spec, rt)
        if isinstance(stored, str):
            return stored
        final = told = stored
    if final is None:
        return None
    failed = await announce(delivery, spec, rt, final, error_type=what.error_type)
    if failed is not None:
        return failed
    place = tagged(delivery.headers, delivery.task_id)
    if place is None:
        return None
    # A workflow's task: its workflow hears of its end (the next stage or the callback
    # confirmed on the broker, ``workflows.hops``).
    return await after_end(rt.app, place, final if told is None else told, delivery.trace_id)


async def _stored(delivery: Delivery, spec: HandlerSpec, rt: Runtime) -> TaskState | str | None:
    """A copy of a finished task: its stored end, announced and told again (a notification
    handler's guard absorbs the repeats; a hop published twice has the same task id, which the
    next handler's guard absorbs). The copy may be the one whose worker died between storing
    the result and the notification's or the hop's confirm; which copy it is cannot be told,
    so every copy sends it. None when nothing is to be sent again; a str: why it cannot be
    known yet (not acked until it is)."""
    notifies = spec.notify is not None
    place = tagged(delivery.headers, delivery.task_id)
    if rt.results is None or (not notifies and place is None):
        return None
    try:
        final = await rt.results.get(delivery.task_id, queue=spec.queue)
    except Exception as e:
        if not notifies:
            return f"its stored end could not be read ({e})"
        rt.metrics.notified(spec.queue, NotifyOutcome.FAILED).inc()
        log.error("could not read the stored result to notify again (%s)", describe(e))
        return "its stored result could not be read to publish its notification"
    if final is None or not final.status.terminal:
        # Its record expired (RESULT_TTL_S) before this copy came: the notification and the
        # hop were sent when the task finished, and what they said is gone.
        if notifies:
            log.warning("a finished task's record is gone: its notification is not sent again")
        if place is not None:
            log.warning("a finished workflow task's record is gone: its workflow is not told again")
        return None
    return final


async def announce(
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    final: TaskState,
    *,
    error_type: str | None = None,
) -> str | None:
    """Publish ``final`` (the task's end) to the handler's results queue with a confirm.

    None when the delivery may be settled now (confirmed, or the handler does not notify);
    else why the publish failed: the caller parks the delivery for another try.
    """
    target = spec.notify
    if target is None:
        return None
    note = TaskNotification(
        task_id=final.task_id,
        queue=final.queue,
        status=final.status,
        result=final.result,
        error=final.error,
        error_type=error_type,
        reason=final.reason,
        attempt=final.attempt,
        requeued=requeued(delivery),
        trace_id=delivery.trace_id,
        finished_at=final.updated_at,
    )
    out = build_message(
        note.model_dump_json().encode(),
        task_id=note.notification_id,
        # The notification service's handler logs under the task's own trace id.
        headers=publish_headers(
            trace_id=delivery.trace_id, attempt=1, traceparent=delivery.traceparent
        ),
    )
    try:
        await rt.settler.publisher.publish(target.queue, out)
    except Exception as e:  # any failure: the notification may not be there
        rt.metrics.notified(spec.queue, NotifyOutcome.FAILED).inc()
        why = str(e) if isinstance(e, WeclawMQError) else describe(e)
        log.error(
            "could not publish the %s notification to %s (%s); the task is not acked",
            final.status.value,
            target.queue,
            why,
        )
        return f"its notification is not published yet ({why})"
    rt.metrics.notified(spec.queue, NotifyOutcome.PUBLISHED).inc()
    return None


def requeued(delivery: Delivery) -> int:
    """How often ops requeued the task from its DLQ (part of a notification's identity)."""
    count = delivery.headers.get(h.REQUEUED)
    return count if isinstance(count, int) and count > 0 else 0

"""Result notifications: what a handler with ``notify=`` tells its results queue.

``@app.handler("Q", notify=True)`` publishes the final state of each task to ``Q.results``
(``notify="some.queue"``: to that queue) with a publisher confirm, BEFORE the task's message is
acked or moved to ``Q.dlq`` (``worker/notify.py``). The body is a ``TaskNotification`` as JSON;
a notification service is another weclaw_mq handler on that queue::

    @app.handler("Q.results")
    async def tell_the_user(note: TaskNotification) -> None: ...

Delivery is at-least-once, like any task: a worker killed after the notification's confirm and
before the task's ack sends it again. The notification's ``message_id`` is its
``notification_id``, the same for every copy of one notification, so the consumer's guard
(keyed by message id) runs its handler once per notification.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from weclaw_mq.contract.naming import results_queue_name, validate_queue_name
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.state.protocol import TaskStatus
from weclaw_mq.wire.topology import QueueSpec

if TYPE_CHECKING:
    from weclaw_mq.settings import Settings

# AMQP carries a message id of at most 255 bytes (message.SHORTSTR_MAX_BYTES).
_MAX_ID_BYTES = 255
# Ends after which the store refuses any other status: announced once per task id.
_FINAL_ENDS = frozenset({TaskStatus.SUCCEEDED.value, TaskStatus.CANCELLED.value})
# Notification ids too long for AMQP become a UUID derived from them (the same every time).
_LONG_ID_NAMESPACE = uuid.UUID("6f1e4a52-5d2c-4c53-9a53-2a0f8e0b7c11")


class TaskNotification(BaseModel):
    """The final state of one task, as its results queue receives it (JSON body).

    ``status`` is ``succeeded`` (with ``result``), ``dead_lettered`` (with ``reason``,
    ``error`` and ``error_type``; an expired task too, with reason ``expired``) or
    ``cancelled`` (``App.cancel``: nothing but the ids and ``attempt``). Later versions may add
    final statuses: they read as plain strings, so handle what you do not know.

    Attributes:
        task_id: The task's id.
        queue: The handler queue the task ran in.
        status: The final status; one this version does not know reads as its plain string
            (an older consumer must not dead-letter a newer worker's notification).
        result: The handler's return value (succeeded).
        error: ``ErrorName: message`` of the last failure (dead_lettered).
        error_type: Its stable name, as in ``x-weclaw-error-type``.
        reason: The dead-letter reason: ``retries_exhausted``, ``rejected``, ...
        attempt: The attempt that ended the task (1 = the first run).
        requeued: Times ops requeued the task from its DLQ before this end.
        trace_id: The task's trace id.
        finished_at: When the task ended (its final record's ``updated_at``).
    """

    task_id: str
    queue: str  # the handler queue the task ran in
    # A status this version does not know (a later version may add one) reads as its plain
    # string: an older consumer must not dead-letter a newer worker's notification.
    status: TaskStatus | str = Field(union_mode="left_to_right")  # a known one: the enum
    result: Any = None  # the handler's return value (succeeded)
    error: str | None = None  # "ErrorName: message" of the last failure (dead_lettered)
    error_type: str | None = None  # its stable name, as in x-weclaw-error-type
    reason: str | None = None  # the dead-letter reason: retries_exhausted, rejected, ...
    attempt: int  # the attempt that ended the task (1 = the first run)
    requeued: int = 0  # times ops requeued the task from its DLQ before this end
    trace_id: str
    finished_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @property
    def notification_id(self) -> str:
        """This notification's message id (see ``notification_id``)."""
        return notification_id(self.task_id, self.status, self.requeued)


def notification_id(task_id: str, status: TaskStatus | str, requeued: int = 0) -> str:
    """The message id of a notification: one per (task, final status, life in the queue).

    Not the bare task id: a task's end can change after it was announced. A task
    dead-lettered, fixed and requeued by ops may succeed later, and a consumer guarded by task
    id would ack that second notification unrun as a "duplicate". ``succeeded`` and
    ``cancelled`` are final (the store refuses any later status), so their id is
    ``<status>:<task id>``: every copy of a cancelled task, whatever its requeue count, repeats
    one notification. Any other end can be followed by another after a requeue, so it counts
    the requeues: ``dead_lettered:<n>:<task id>``. Every copy of ONE notification (a
    redelivery after a crash) has the same id. The fixed parts come first, so the id parses
    whatever the task id holds; an id too long for AMQP becomes a UUID derived from it (the
    same every time).
    """
    value = status.value if isinstance(status, TaskStatus) else status
    text = f"{value}:{task_id}" if value in _FINAL_ENDS else f"{value}:{requeued}:{task_id}"
    if len(text.encode("utf-8", "surrogatepass")) <= _MAX_ID_BYTES:
        return text
    return str(uuid.uuid5(_LONG_ID_NAMESPACE, text))


@dataclass(frozen=True)
class NotifyTarget:
    """Where a handler's notifications go, decided at decoration time."""

    queue: str
    # The results queue is a work queue of its own (its consumer is a handler): it is
    # declared with the arguments a handler with default options declares for it.
    delivery_limit: int

    def queue_spec(self) -> QueueSpec:
        return QueueSpec(name=self.queue, retry_delays_ms=(), delivery_limit=self.delivery_limit)


def notify_target(queue: str, notify: bool | str, settings: Settings) -> NotifyTarget | None:
    """The handler option ``notify`` checked: None (off), ``Q.results`` (True) or a name."""
    if notify is False:
        return None
    if notify is True:
        target = results_queue_name(queue)
    elif isinstance(notify, str):
        target = notify
    else:
        raise ConfigurationError(
            f"notify for {queue!r} must be True, False or a queue name, not {notify!r}"
        )
    try:
        validate_queue_name(target)
    except ConfigurationError as e:
        raise ConfigurationError(f"notify for {queue!r}: {e}") from e
    if target == queue:
        raise ConfigurationError(
            f"notify for {queue!r} names the handler's own queue: each notification would be "
            "a new task of the same handler"
        )
    if not settings.results_enabled:
        raise ConfigurationError(
            f"notify for {queue!r} needs results (WECLAW_MQ_RESULTS_ENABLED=true): a copy of "
            "a finished task re-sends its notification from the stored result"
        )
    return NotifyTarget(queue=target, delivery_limit=settings.delivery_limit)

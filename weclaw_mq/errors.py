"""The exceptions weclaw_mq raises, all under one root.

    WeclawMQError
    ├── ConfigurationError           a handler, queue name or option that cannot work
    │   ├── InvalidPriorityError     a priority or queue type weclaw_mq does not know (a
    │   │                            ValueError too)
    │   ├── StartupFailedError       a startup hook or resource of the App raised: the worker
    │   │                            did not start (``where``: the user's frames)
    │   └── ResourceUnavailableError ``use(provider)`` of a resource that is not open (not
    │                                registered, or asked outside its App's lifespan)
    ├── PayloadError                 refused before anything was sent
    │   ├── PayloadTooLargeError     body over ``max_message_bytes``
    │   ├── PayloadValidationError   body fails the handler's pydantic model
    │   ├── MessageEncodingError     AMQP cannot carry the task id, queue name or a header
    │   │                            (over 255 bytes, a header name over 128, a value type
    │   │                            with no AMQP encoding such as an object, set or bytes)
    │   └── IdempotencyConflictError the task id (an idempotency key) was published before
    │                                with another body (``state.reuse``)
    ├── TopologyConflictError        a queue exists with other arguments (PRECONDITION_FAILED)
    ├── ResultTimeoutError           ``App.result`` saw no final state in time
    ├── StateUnavailableError        Redis (task states and results) did not answer
    ├── StateCommandError            Redis answered a task-state command with an error (a
    │                                script error, an invalid argument): not an outage
    ├── OutboxError                  the local outbox (``WECLAW_MQ_OUTBOX_PATH``) cannot take a task
    │   ├── OutboxFullError          at its row or byte bound: nothing was stored
    │   └── OutboxUnusableError      the file cannot be opened or written, is corrupt, or has
    │                                a schema this version does not know
    ├── StreamLimitError             ``ctx.emit``: a chunk too large, or too many in one run
    ├── StreamWriteError             ``ctx.emit``: the task's stream could not be written
    ├── StepError                    ``ctx.step``: a result that is not JSON or is over
    │                                ``step_max_bytes``, or a step inside a step
    ├── PublishFailedError           publish did not end in a broker ack
    │   ├── BrokerUnavailableError   no broker answered (connect failed): nothing was sent
    │   ├── PublishNackedError       the broker refused it (e.g. a full queue, reject-publish)
    │   ├── UnroutableError          no queue bound for the routing key (mandatory return)
    │   ├── ConfirmTimeoutError      no confirm within ``confirm_timeout_s``: outcome unknown
    │   ├── ConnectionLostError      the connection or channel died before the confirm
    │   └── BatchPublishError        part of a ``publish_many`` batch failed: ``.failed`` says
    │                                which (index -> error); the rest are confirmed
    └── WorkerError                  why the worker itself ended an attempt: never raised to
        │                            your code, written into the retry/DLQ headers and the
        │                            task's status record
        ├── UndecodableBody          the body is not UTF-8 JSON
        ├── InvalidPayload           the body fails the handler's model
        ├── UnserialisableResult     the handler returned something that is not JSON
        ├── HandlerTimeout           the handler ran past its ``timeout_s`` and was cancelled
        ├── HandlerAbandoned         ... and ignored its cancellation for the grace period
        ├── WorkerCrashLoop          returned unsettled more often than the delivery limit
        ├── BudgetExceeded           its tenant spent the day's cap (a shedding ``Cap``)
        └── ResultNotStored          the result store did not answer within its patience

A ``PublishFailedError`` means the caller does not hold a confirmed task, for any reason:
one ``except`` covers them all. ``BrokerUnavailableError`` is one too, and is also what a
connect with no publish behind it raises (a worker, a DLQ command); its ``queue`` and
``task_id`` are None then. For ``ConfirmTimeoutError`` and ``ConnectionLostError`` the
message may still have reached the queue, so republishing with the same ``task_id`` is the
safe response (the idempotency guard absorbs the duplicate); ``STORED_NOTHING`` lists the
failures that certainly stored nothing.

Every class here has an ``error_type``: the stable name written into the
``x-weclaw-error-type`` header when such an error fails a task (``weclaw_mq.<Name>``, part of
the wire format: a rename or a moved module never changes it; ``tests/unit/test_error_types``
pins the list). A handler's own exception is written as its class ``__name__``
(``failures.error_type``).

The control-flow signals ``Reject`` and ``Retry`` (raised by handlers) live in
``weclaw_mq.policy.signals``: they are decisions, not faults.
"""

from __future__ import annotations

from typing import ClassVar


class WeclawMQError(Exception):
    """Root of every error weclaw_mq raises."""

    error_type: ClassVar[str] = "weclaw_mq.WeclawMQError"


class ConfigurationError(WeclawMQError):
    """A handler, queue name, setting or option that cannot work."""

    error_type: ClassVar[str] = "weclaw_mq.ConfigurationError"


class InvalidPriorityError(ConfigurationError, ValueError):
    """Not one of Priority.NORMAL/HIGH/URGENT or "normal"/"high"/"urgent"."""

    error_type: ClassVar[str] = "weclaw_mq.InvalidPriorityError"


class StartupFailedError(ConfigurationError):
    """A startup hook or resource of the App raised; what had started was closed again.

    ``where`` holds the lines of the user's frames (file, line, code) that raised, for the CLI
    to print under its one error line; the user's exception is the ``__cause__``.
    """

    error_type: ClassVar[str] = "weclaw_mq.StartupFailedError"

    def __init__(self, message: str, where: list[str] | None = None) -> None:
        super().__init__(message)
        self.where = where or []


class ResourceUnavailableError(ConfigurationError):
    """``use(provider)`` asked for a resource that is not open: ``provider`` is not
    registered with ``@app.resource``, or its App's lifespan is not open (no worker, no
    ``TestBroker``, no ``async with app.lifespan`` runs it)."""

    error_type: ClassVar[str] = "weclaw_mq.ResourceUnavailableError"


class PayloadError(WeclawMQError):
    """The task was refused before anything was sent."""

    error_type: ClassVar[str] = "weclaw_mq.PayloadError"


class PayloadTooLargeError(PayloadError):
    """The body is over ``max_message_bytes``."""

    error_type: ClassVar[str] = "weclaw_mq.PayloadTooLargeError"

    def __init__(self, queue: str, size: int, limit: int) -> None:
        super().__init__(
            f"payload for {queue!r} is {size} bytes, over the limit of {limit} bytes "
            "(WECLAW_MQ_MAX_MESSAGE_BYTES); store large inputs elsewhere and send a reference"
        )
        self.size = size
        self.limit = limit


class PayloadValidationError(PayloadError):
    """The body fails the handler's pydantic model."""

    error_type: ClassVar[str] = "weclaw_mq.PayloadValidationError"


class MessageEncodingError(PayloadError):
    """The task id, queue name or a header cannot be encoded as AMQP: nothing was sent."""

    error_type: ClassVar[str] = "weclaw_mq.MessageEncodingError"


class IdempotencyConflictError(PayloadError):
    """``publish(..., task_id=key)`` where ``key`` was published to that queue before with
    another body: nothing was sent. The first body keeps the key (``state.reuse``)."""

    error_type: ClassVar[str] = "weclaw_mq.IdempotencyConflictError"

    def __init__(self, queue: str, task_id: str) -> None:
        super().__init__(
            f"task id {task_id!r} was already used for {queue!r} with another body; "
            "a task id names one task: publish a new body under a new id"
        )
        self.queue = queue
        self.task_id = task_id


class TopologyConflictError(WeclawMQError):
    """A queue exists with other arguments (the broker's PRECONDITION_FAILED)."""

    error_type: ClassVar[str] = "weclaw_mq.TopologyConflictError"

    def __init__(self, queue: str, argument: str | None, detail: str) -> None:
        arg = f"argument {argument!r}" if argument else "its arguments"
        super().__init__(
            f"queue {queue!r} already exists with a different {arg} ({detail}). "
            "RabbitMQ never changes a queue's arguments in place: either keep the old value in "
            f"your handler options, or drain the queue and delete it (rabbitmqctl delete_queue "
            f"{queue}) so the next declare creates it anew"
        )
        self.queue = queue
        self.argument = argument


class PublishFailedError(WeclawMQError):
    """Not confirmed by the broker. ``queue`` and ``task_id`` name the publish that failed;
    None only for a ``BrokerUnavailableError`` raised by a connect with no publish behind it."""

    error_type: ClassVar[str] = "weclaw_mq.PublishFailedError"

    def __init__(self, message: str, *, queue: str | None, task_id: str | None) -> None:
        super().__init__(message)
        self.queue = queue
        self.task_id = task_id


class BrokerUnavailableError(PublishFailedError):
    """No broker answered: nothing was sent."""

    error_type: ClassVar[str] = "weclaw_mq.BrokerUnavailableError"

    def __init__(
        self, message: str, *, queue: str | None = None, task_id: str | None = None
    ) -> None:
        super().__init__(message, queue=queue, task_id=task_id)


class PublishNackedError(PublishFailedError):
    """The broker refused the message (e.g. a full queue with ``reject-publish``)."""

    error_type: ClassVar[str] = "weclaw_mq.PublishNackedError"


class UnroutableError(PublishFailedError):
    """No queue is bound for the routing key (the mandatory message came back)."""

    error_type: ClassVar[str] = "weclaw_mq.UnroutableError"


class ConfirmTimeoutError(PublishFailedError):
    """No confirm within ``confirm_timeout_s``: the outcome is unknown."""

    error_type: ClassVar[str] = "weclaw_mq.ConfirmTimeoutError"


class ConnectionLostError(PublishFailedError):
    """The connection or channel died before the confirm: the outcome is unknown."""

    error_type: ClassVar[str] = "weclaw_mq.ConnectionLostError"


class ResultTimeoutError(WeclawMQError):
    """``App.result`` saw no final state in time."""

    error_type: ClassVar[str] = "weclaw_mq.ResultTimeoutError"

    def __init__(self, task_id: str, timeout_s: float, last: object | None) -> None:
        status = getattr(getattr(last, "status", None), "value", None) or "unknown"
        super().__init__(
            f"task {task_id} has no final result after {timeout_s} s (last status: {status})"
        )
        self.task_id = task_id
        self.last = last


class StateUnavailableError(WeclawMQError):
    """The task-state store (Redis by default) failed or did not answer: nothing was read."""

    error_type: ClassVar[str] = "weclaw_mq.StateUnavailableError"


class StateCommandError(WeclawMQError):
    """Redis is up and refused a task-state command (a script error, an invalid argument, a
    wrong key type, a missing ACL permission): the same command fails again, so waiting for
    Redis to "come back" would never end. A bug or a setting to fix, said as such."""

    error_type: ClassVar[str] = "weclaw_mq.StateCommandError"


class OutboxError(WeclawMQError):
    """The local outbox could not take the task: it is neither on the broker nor stored."""

    error_type: ClassVar[str] = "weclaw_mq.OutboxError"


class OutboxFullError(OutboxError):
    """The outbox holds ``outbox_max_rows`` rows or ``outbox_max_bytes`` bytes already."""

    error_type: ClassVar[str] = "weclaw_mq.OutboxFullError"


class OutboxUnusableError(OutboxError):
    """The outbox file cannot be opened, read or written (a path, permissions, corruption)."""

    error_type: ClassVar[str] = "weclaw_mq.OutboxUnusableError"


class StreamLimitError(WeclawMQError):
    """Raised by ``ctx.emit`` in the handler: the chunk is over ``stream_max_chunk_bytes``
    or the run already emitted ``stream_max_chunks``. Nothing of that chunk is written."""

    error_type: ClassVar[str] = "weclaw_mq.StreamLimitError"


class StreamWriteError(WeclawMQError):
    """Raised by ``ctx.emit`` in the handler (or at the run's end) when earlier chunks could
    not be written: the attempt fails and its retry streams again under a new marker."""

    error_type: ClassVar[str] = "weclaw_mq.StreamWriteError"


class StepError(WeclawMQError):
    """Raised by ``ctx.step`` in the handler: the step returned something that is not JSON
    or whose JSON is over ``step_max_bytes`` (nothing was recorded: the step runs again on
    the next attempt), or it was called inside another step (steps do not nest)."""

    error_type: ClassVar[str] = "weclaw_mq.StepError"


class BatchPublishError(PublishFailedError):
    """Part of a ``publish_many`` batch failed: ``failed`` maps each failed index to its
    error; the rest are confirmed."""

    error_type: ClassVar[str] = "weclaw_mq.BatchPublishError"

    def __init__(self, queue: str, task_ids: list[str], failed: dict[int, Exception]) -> None:
        first = min(failed)
        super().__init__(
            f"{len(failed)} of {len(task_ids)} messages for {queue!r} were not confirmed "
            f"(first: #{first}, {failed[first]}); the other {len(task_ids) - len(failed)} are "
            "stored. Republish only the failed ones, with the same task ids",
            queue=queue,
            task_id=task_ids[first],
        )
        self.task_ids = task_ids
        self.failed = failed

    @property
    def confirmed(self) -> list[str]:
        """The task ids of the batch that did not fail, in order."""
        return [t for i, t in enumerate(self.task_ids) if i not in self.failed]


# Publish failures that certainly stored nothing (refused, never sent, or no broker to send
# to): the one place this is stated. ``ConfirmTimeoutError`` and ``ConnectionLostError`` are
# not here: the task may be in its queue.
STORED_NOTHING: tuple[type[WeclawMQError], ...] = (
    BrokerUnavailableError,
    PublishNackedError,
    UnroutableError,
    MessageEncodingError,
)


class WorkerError(WeclawMQError):
    """Why the worker itself ended an attempt. Never raised to your code: it is written into
    the retry and DLQ headers (``error_type``) and the task's status record."""

    error_type: ClassVar[str] = "weclaw_mq.WorkerError"


class UndecodableBody(WorkerError):
    """The body is not UTF-8 JSON: no retry can fix it."""

    error_type: ClassVar[str] = "weclaw_mq.UndecodableBody"


class InvalidPayload(WorkerError):
    """The body fails the handler's model, or is over ``max_message_bytes``: no retry can fix it."""

    error_type: ClassVar[str] = "weclaw_mq.InvalidPayload"


class UnserialisableResult(WorkerError):
    """The handler returned something that is not JSON: storing it can never succeed."""

    error_type: ClassVar[str] = "weclaw_mq.UnserialisableResult"


class HandlerTimeout(WorkerError):
    """The handler ran past its ``timeout_s`` and was cancelled."""

    error_type: ClassVar[str] = "weclaw_mq.HandlerTimeout"


class HandlerAbandoned(WorkerError):
    """The handler ignored its cancellation: its attempt was ended without it (it may still run)."""

    error_type: ClassVar[str] = "weclaw_mq.HandlerAbandoned"


class WorkerCrashLoop(WorkerError):
    """The task was returned unsettled more often than the handler's delivery limit."""

    error_type: ClassVar[str] = "weclaw_mq.WorkerCrashLoop"


class BudgetExceeded(WorkerError):
    """The task's tenant spent its day's cap (``Cap(action="shed")``): not run."""

    error_type: ClassVar[str] = "weclaw_mq.BudgetExceeded"


class TaskExpired(WorkerError):
    """The task outlived its lifetime (``ttl_s``) before a worker could run it to the end."""

    error_type: ClassVar[str] = "weclaw_mq.TaskExpired"


class ResultNotStored(WorkerError):
    """The result store did not answer within ``result_store_patience_s``."""

    error_type: ClassVar[str] = "weclaw_mq.ResultNotStored"

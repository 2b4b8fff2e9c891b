"""The exceptions weclaw_mq raises, all under one root.

    WeclawMQError
    ├── ConfigurationError           a handler, queue name or option that cannot work
    ├── PayloadError                 refused before anything was sent
    │   ├── PayloadTooLargeError     body over ``max_message_bytes``
    │   ├── PayloadValidationError   body fails the handler's pydantic model
    │   └── MessageEncodingError     AMQP cannot carry the task id, queue name or a header
    │                                (over 255 bytes, a header name over 128, a value type
    │                                with no AMQP encoding such as an object, set or bytes)
    ├── TopologyConflictError        a queue exists with other arguments (PRECONDITION_FAILED)
    ├── ResultTimeoutError           ``App.result`` saw no final state in time
    ├── StateUnavailableError        Redis (task states and results) did not answer
    └── PublishFailedError           publish did not end in a broker ack
        ├── BrokerUnavailableError   no broker answered (connect failed): nothing was sent
        ├── PublishNackedError       the broker refused it (e.g. a full queue, reject-publish)
        ├── UnroutableError          no queue bound for the routing key (mandatory return)
        ├── ConfirmTimeoutError      no confirm within ``confirm_timeout_s``: outcome unknown
        ├── ConnectionLostError      the connection or channel died before the confirm
        └── BatchPublishError        part of a ``publish_many`` batch failed: ``.failed`` says
                                     which (index -> error); the rest are confirmed

A ``PublishFailedError`` means the caller does not hold a confirmed task, for any reason:
one ``except`` covers them all. ``BrokerUnavailableError`` is one too, and is also what a
connect with no publish behind it raises (a worker, a DLQ command); its ``queue`` and
``task_id`` are None then. For ``ConfirmTimeoutError`` and ``ConnectionLostError`` the
message may still have reached the queue, so republishing with the same ``task_id`` is the
safe response (the idempotency guard absorbs the duplicate); ``STORED_NOTHING`` lists the
failures that certainly stored nothing.

The control-flow signals ``Reject`` and ``Retry`` (raised by handlers) live in
``weclaw_mq.signals``: they are decisions, not faults.
"""

from __future__ import annotations


class WeclawMQError(Exception):
    """Root of every error weclaw_mq raises."""


class ConfigurationError(WeclawMQError):
    pass


class PayloadError(WeclawMQError):
    pass


class PayloadTooLargeError(PayloadError):
    def __init__(self, queue: str, size: int, limit: int) -> None:
        super().__init__(
            f"payload for {queue!r} is {size} bytes, over the limit of {limit} bytes "
            "(WECLAW_MQ_MAX_MESSAGE_BYTES); store large inputs elsewhere and send a reference"
        )
        self.size = size
        self.limit = limit


class PayloadValidationError(PayloadError):
    pass


class MessageEncodingError(PayloadError):
    """The task id, queue name or a header cannot be encoded as AMQP: nothing was sent."""


class TopologyConflictError(WeclawMQError):
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

    def __init__(self, message: str, *, queue: str | None, task_id: str | None) -> None:
        super().__init__(message)
        self.queue = queue
        self.task_id = task_id


class BrokerUnavailableError(PublishFailedError):
    """No broker answered: nothing was sent."""

    def __init__(
        self, message: str, *, queue: str | None = None, task_id: str | None = None
    ) -> None:
        super().__init__(message, queue=queue, task_id=task_id)


class PublishNackedError(PublishFailedError):
    pass


class UnroutableError(PublishFailedError):
    pass


class ConfirmTimeoutError(PublishFailedError):
    pass


class ConnectionLostError(PublishFailedError):
    pass


class ResultTimeoutError(WeclawMQError):
    def __init__(self, task_id: str, timeout_s: float, last: object | None) -> None:
        status = getattr(getattr(last, "status", None), "value", None) or "unknown"
        super().__init__(
            f"task {task_id} has no final result after {timeout_s} s (last status: {status})"
        )
        self.task_id = task_id
        self.last = last


class StateUnavailableError(WeclawMQError):
    """The task-state store (Redis by default) failed or did not answer: nothing was read."""


class BatchPublishError(PublishFailedError):
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

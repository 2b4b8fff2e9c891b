"""weclaw_mq: AI tasks on RabbitMQ that survive crashes.

Publish with confirms, ack only after success, retry with backoff through delay queues,
dead-letter what cannot succeed, and guard effects with Redis so a redelivery never runs twice.
"""

from .app import App
from .breaker import Breaker, UpstreamDown
from .context import Context
from .control_flow import Reject, Retry, retry_after_s
from .errors import (
    BatchPublishError,
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    ConnectionLostError,
    IdempotencyConflictError,
    InvalidPriorityError,
    MessageEncodingError,
    PayloadError,
    PayloadTooLargeError,
    PayloadValidationError,
    PublishFailedError,
    PublishNackedError,
    ResultTimeoutError,
    StateCommandError,
    StateUnavailableError,
    StreamLimitError,
    StreamWriteError,
    TopologyConflictError,
    UnroutableError,
    WeclawMQError,
)
from .limits import Limit
from .notification import TaskNotification
from .priority import Priority
from .retry import RetryPolicy
from .settings import Settings
from .state import Cancellation, CancelOutcome, MemoryTaskStore, TaskState, TaskStatus, TaskStore
from .streaming import Inbox, MemoryStreamStore, StreamEvent, StreamStore
from .worker.consume import Worker

# The name of the store protocol before it held the guard too (claims, leases, done markers).
ResultStore = TaskStore

__all__ = [
    "App",
    "BatchPublishError",
    "Breaker",
    "BrokerUnavailableError",
    "CancelOutcome",
    "Cancellation",
    "ConfigurationError",
    "ConfirmTimeoutError",
    "ConnectionLostError",
    "Context",
    "IdempotencyConflictError",
    "Inbox",
    "InvalidPriorityError",
    "Limit",
    "MemoryStreamStore",
    "MemoryTaskStore",
    "MessageEncodingError",
    "PayloadError",
    "PayloadTooLargeError",
    "PayloadValidationError",
    "Priority",
    "PublishFailedError",
    "PublishNackedError",
    "Reject",
    "ResultStore",
    "ResultTimeoutError",
    "Retry",
    "RetryPolicy",
    "Settings",
    "StateCommandError",
    "StateUnavailableError",
    "StreamEvent",
    "StreamLimitError",
    "StreamStore",
    "StreamWriteError",
    "TaskNotification",
    "TaskState",
    "TaskStatus",
    "TaskStore",
    "TopologyConflictError",
    "UnroutableError",
    "UpstreamDown",
    "WeclawMQError",
    "Worker",
    "retry_after_s",
]

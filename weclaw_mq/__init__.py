"""weclaw_mq: AI tasks on RabbitMQ that survive crashes.

Publish with confirms, ack only after success, retry with backoff through delay queues,
dead-letter what cannot succeed, and guard effects with Redis so a redelivery never runs twice.
"""

from . import errors
from .app import App
from .breaker import Breaker, UpstreamDown
from .context import Context
from .control_flow import Reject, Retry, retry_after_s
from .errors import WeclawMQError
from .limits import Limit
from .notification import TaskNotification
from .priority import Priority
from .retry import RetryPolicy
from .settings import Settings
from .state import Cancellation, CancelOutcome, MemoryTaskStore, TaskState, TaskStatus, TaskStore
from .streaming import Inbox, MemoryStreamStore, StreamEvent, StreamStore
from .worker.consume import Worker

# The error tree lives in weclaw_mq.errors; these names stay importable from here, as before.
BatchPublishError = errors.BatchPublishError
BrokerUnavailableError = errors.BrokerUnavailableError
ConfigurationError = errors.ConfigurationError
ConfirmTimeoutError = errors.ConfirmTimeoutError
ConnectionLostError = errors.ConnectionLostError
IdempotencyConflictError = errors.IdempotencyConflictError
InvalidPriorityError = errors.InvalidPriorityError
MessageEncodingError = errors.MessageEncodingError
PayloadError = errors.PayloadError
PayloadTooLargeError = errors.PayloadTooLargeError
PayloadValidationError = errors.PayloadValidationError
PublishFailedError = errors.PublishFailedError
PublishNackedError = errors.PublishNackedError
ResultTimeoutError = errors.ResultTimeoutError
StateCommandError = errors.StateCommandError
StateUnavailableError = errors.StateUnavailableError
StreamLimitError = errors.StreamLimitError
StreamWriteError = errors.StreamWriteError
TopologyConflictError = errors.TopologyConflictError
UnroutableError = errors.UnroutableError

# The name of the store protocol before it held the guard too (claims, leases, done markers).
ResultStore = TaskStore

# The common path: what a handler, a worker and a producer need (the full error tree is
# weclaw_mq.errors).
__all__ = [
    "App",
    "Breaker",
    "CancelOutcome",
    "Cancellation",
    "Context",
    "Inbox",
    "Limit",
    "MemoryStreamStore",
    "MemoryTaskStore",
    "Priority",
    "Reject",
    "Retry",
    "RetryPolicy",
    "Settings",
    "StreamEvent",
    "StreamStore",
    "TaskNotification",
    "TaskState",
    "TaskStatus",
    "TaskStore",
    "UpstreamDown",
    "WeclawMQError",
    "Worker",
    "retry_after_s",
]

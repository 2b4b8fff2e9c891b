"""weclaw_mq: AI tasks on RabbitMQ that survive crashes.

Publish with confirms, ack only after success, retry with backoff through delay queues,
dead-letter what cannot succeed, and guard effects with Redis so a redelivery never runs twice.
"""

from weclaw_mq import errors
from weclaw_mq.app import App
from weclaw_mq.context import Context
from weclaw_mq.errors import WeclawMQError

# What a middleware's hooks are given: importable from here, beside Middleware (in __all__).
from weclaw_mq.handlers.middleware import CallEnd as CallEnd
from weclaw_mq.handlers.middleware import DeadLetter as DeadLetter
from weclaw_mq.handlers.middleware import Defer as Defer
from weclaw_mq.handlers.middleware import Middleware
from weclaw_mq.handlers.middleware import Publish as Publish
from weclaw_mq.handlers.middleware import Run as Run
from weclaw_mq.handlers.middleware import RunEnd as RunEnd
from weclaw_mq.handlers.middleware import Usage as Usage
from weclaw_mq.handlers.notifications import TaskNotification
from weclaw_mq.observability.metrics import Outcome as Outcome
from weclaw_mq.policy.breaker import Breaker, UpstreamDown
from weclaw_mq.policy.limits import Limit
from weclaw_mq.policy.priority import Priority
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.policy.signals import Reject, Retry, retry_after_s
from weclaw_mq.settings import Settings
from weclaw_mq.state import (
    Cancellation,
    CancelOutcome,
    MemoryTaskStore,
    TaskState,
    TaskStatus,
    TaskStore,
)
from weclaw_mq.state.task_index import TaskQuery as TaskQuery  # App.tasks(TaskQuery(...))
from weclaw_mq.streaming import Inbox, MemoryStreamStore, StreamEvent, StreamStore
from weclaw_mq.worker.consume import Worker

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
StepError = errors.StepError
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
    "Middleware",
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

"""Every AMQP header weclaw_mq reads or writes. No other module spells a header name."""

from __future__ import annotations

PREFIX = "x-weclaw-"

# The trace id that follows a task through its retries and follow-up tasks
# (weclaw_mq.observability.tracing).
TRACE_ID = f"{PREFIX}trace-id"
TRACEPARENT = "traceparent"  # W3C trace context, passed through where present
# The session (a user or a conversation) whose inbox receives the task's events.
SESSION_ID = f"{PREFIX}session-id"
# Our own count: never derived from x-death (3.13+ stops counting republished messages there).
ATTEMPT = f"{PREFIX}attempt"
# The handler queue a failed copy came from: a delay queue or the DLQ sends it back by it.
ORIGINAL_QUEUE = f"{PREFIX}original-queue"
# Times the task went back to its queue unsettled (its worker died or lost the connection),
# summed across hops: each hop starts the broker's x-delivery-count afresh, and a task that
# kills every worker would otherwise loop forever through the guard's delay queue.
RETURNS = f"{PREFIX}returns"
# The task's lifetime (see weclaw_mq.contract.lifetime): its deadline (epoch ms), and the lifetime
# it
# was given (ms), from which a DLQ requeue gives it a fresh deadline.
EXPIRES_AT = f"{PREFIX}expires-at"
TTL_MS = f"{PREFIX}ttl-ms"
# The task's priority ("high", "urgent"; absent: normal), kept on every hop: retries, deferrals
# and DLQ re-drives send the task back to its lane by it (weclaw_mq.policy.priority).
PRIORITY = f"{PREFIX}priority"
# The earliest time (epoch ms) the task may run: set by ``publish(delay_s=)`` and
# ``Retry(after_s=)``; a worker that receives it earlier parks it again (weclaw_mq.policy.delays).
NOT_BEFORE = f"{PREFIX}not-before"
# How often ops shovelled this task back from its DLQ (weclaw_mq.dlq.requeue), and when it
# last did (ISO-8601, UTC). Not failure headers: a copy that dies again carries both into the
# DLQ, where ``dlq show`` prints them and the next requeue counts on.
REQUEUED = f"{PREFIX}requeued"
REQUEUED_AT = f"{PREFIX}requeued-at"
# The workflow a task belongs to (weclaw_mq.workflows), as "<kind>:<workflow id>": kind
# "chain" (a stage, task id "<id>.<stage index>"), "group" (a part, "<id>.<part index>") or
# "then" (a group's callback, "<id>.then"). Its worker reports the task's end to the workflow
# before the ack.
WORKFLOW = f"{PREFIX}workflow"

# The tenant of a task of a handler with ``fair=`` (weclaw_mq.policy.fair_share), as its
# producer computed it to place the task on the tenant's lane (``publishing.fair_lanes``).
TENANT = f"{PREFIX}tenant"

# Model fallback chains (weclaw_mq.policy.fallback): the model the attempt that wrote the copy
# called, and every model this task's attempts failed on, in order (an AMQP array of str).
MODEL = f"{PREFIX}model"
MODELS_TRIED = f"{PREFIX}models-tried"

# How often the task was parked without an attempt (a limit, a cap, a fallback chain, a
# breaker, no free thread): the first deferral is logged at INFO, the later ones at DEBUG.
DEFERRALS = f"{PREFIX}deferrals"

# A long run's watch copy (worker.long_runs): the generation of the run it watches. A copy
# whose generation the task's watch key has passed is no longer needed and is dropped.
WATCH = f"{PREFIX}watch"

# The error's stable name (part of the wire format, see failures.error_type); the class's
# module path beside it is for people only and changes when code moves.
ERROR_TYPE = f"{PREFIX}error-type"
ERROR_CLASS = f"{PREFIX}error-class"
# The last failure's message and traceback, cut to the lengths below.
ERROR_MESSAGE = f"{PREFIX}error-message"
ERROR_TRACEBACK = f"{PREFIX}error-traceback"
# When the task first failed, and when it last did (ISO-8601, UTC).
FIRST_FAILURE_AT = f"{PREFIX}first-failure-at"
LAST_FAILURE_AT = f"{PREFIX}last-failure-at"
# Why the task is in the DLQ (weclaw_mq.policy.retry.DeadLetterReason).
DEAD_LETTER_REASON = f"{PREFIX}dead-letter-reason"

# Set by RabbitMQ itself.
X_DEATH = "x-death"
X_DELIVERY_COUNT = "x-delivery-count"
X_FIRST_DEATH_REASON = "x-first-death-reason"
X_FIRST_DEATH_QUEUE = "x-first-death-queue"
# Set on dead-lettering ("x-last-death-*" from 3.13 on); stale after a requeue.
BROKER_DEATH_PREFIXES = ("x-first-death-", "x-last-death-")

ERROR_MESSAGE_MAX_CHARS = 1_000
TRACEBACK_MAX_CHARS = 4_000

# Set by weclaw_mq's DLQ tools on a message whose properties the client cannot decode (e.g. a
# short string that is not UTF-8, a timestamp out of range): the raw property bytes as read,
# and why they failed. Never sent: such a message is copied back byte for byte.
UNDECODABLE_PROPERTIES = f"{PREFIX}undecodable-properties"
UNDECODABLE_ERROR = f"{PREFIX}undecodable-error"

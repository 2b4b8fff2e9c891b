"""The AMQP headers of a task and of a dead letter, as JSON Schema for the AsyncAPI document.

Each header is named by ``weclaw_mq.contract.headers`` (never spelled here) and its bounds come from
the module that checks it (``header_values``, ``naming``). ``readOnly`` marks what a foreign
producer reads but does not set: weclaw_mq or RabbitMQ writes it on a later hop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.header_values import COUNT_MAX, TRACE_ID_MAX_CHARS, TRACEPARENT_RE
from weclaw_mq.contract.naming import SESSION_ID_RE
from weclaw_mq.errors import WorkerError
from weclaw_mq.policy.breaker import UpstreamDown
from weclaw_mq.policy.priority import Priority
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.policy.signals import Reject, Retry

PRODUCER = "producer"
WECLAW_MQ = "weclaw_mq"
RABBITMQ = "rabbitmq"


@dataclass(frozen=True)
class HeaderDoc:
    name: str
    schema: dict[str, Any]
    description: str
    set_by: str  # PRODUCER (may be set by whoever publishes), WECLAW_MQ or RABBITMQ

    def as_schema(self) -> dict[str, Any]:
        out = {**self.schema, "description": self.description}
        if self.set_by != PRODUCER:
            out["readOnly"] = True
        return out


def _count(low: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": COUNT_MAX}


_EPOCH_MS = {"type": "integer", "minimum": 0}
_ISO_TIME = {"type": "string", "format": "date-time"}
_TEXT = {"type": "string"}

# What a task carries on its way to and through its queue.
TASK: tuple[HeaderDoc, ...] = (
    HeaderDoc(
        h.TRACE_ID,
        {"type": "string", "minLength": 1, "maxLength": TRACE_ID_MAX_CHARS, "pattern": r"^\S+$"},
        "The trace id every log line and every later hop of the task carries. Absent or "
        "invalid: the worker makes a new one.",
        PRODUCER,
    ),
    HeaderDoc(
        h.TRACEPARENT,
        {"type": "string", "pattern": f"^{TRACEPARENT_RE.pattern}$"},
        "W3C trace context, passed on where present.",
        PRODUCER,
    ),
    HeaderDoc(
        h.ATTEMPT,
        {**_count(1), "default": 1},
        "The attempt number (1: the first run). A new task sends 1 or nothing; weclaw_mq "
        "counts the retries.",
        PRODUCER,
    ),
    HeaderDoc(
        h.EXPIRES_AT,
        _EPOCH_MS,
        "The task's deadline (epoch ms): delivered past it, the task is dead-lettered with "
        "reason expired. Absent: no deadline but the AMQP expiration property's.",
        PRODUCER,
    ),
    HeaderDoc(
        h.TTL_MS,
        {"type": "integer", "minimum": 1},
        "The lifetime the task was given (ms): a DLQ requeue gives it a fresh deadline of "
        "this length.",
        PRODUCER,
    ),
    HeaderDoc(
        h.NOT_BEFORE,
        _EPOCH_MS,
        "The earliest time (epoch ms) the task may run: a worker that receives it earlier "
        "parks it in a delay queue until then.",
        PRODUCER,
    ),
    HeaderDoc(
        h.PRIORITY,
        {"type": "string", "enum": [p.value for p in Priority if p is not Priority.NORMAL]},
        "The task's priority (absent: normal), kept on every hop. The header alone puts no "
        "task ahead: App.publish also routes it to its lane or sets the AMQP priority "
        "property, by broker version (see the README's Priorities).",
        PRODUCER,
    ),
    HeaderDoc(
        h.WORKFLOW,
        {"type": "string", "pattern": r"^(chain|group|then):.+$"},
        "The workflow (App.chain, App.group) the task belongs to, as '<kind>:<workflow id>'; "
        "its task id is '<workflow id>.<index>' ('<workflow id>.then' for a group's "
        "callback). Its worker reports the task's end to the workflow before the ack.",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.SESSION_ID,
        {"type": "string", "pattern": f"^{SESSION_ID_RE.pattern}$"},
        "The session (a user or a conversation) whose inbox also receives the task's "
        "streamed chunks and final reply.",
        PRODUCER,
    ),
    HeaderDoc(
        h.RETURNS,
        _count(0),
        "Times the task went back to its queue unsettled (its worker died), summed across hops.",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.REQUEUED, _count(0), "How often ops shovelled the task back from its DLQ.", WECLAW_MQ
    ),
    HeaderDoc(h.REQUEUED_AT, _ISO_TIME, "When ops last did (UTC).", WECLAW_MQ),
    HeaderDoc(
        h.TENANT,
        _TEXT,
        "The tenant of a task of a handler with fair share (fair=), as its producer computed "
        "it: the producer sent the task to that tenant's lane.",
        PRODUCER,
    ),
    HeaderDoc(
        h.MODEL,
        {"type": "string"},
        "The model the attempt that wrote this copy called (a handler with a fallback chain).",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.MODELS_TRIED,
        {"type": "array", "items": {"type": "string"}},
        "Every model the task's attempts failed on, in order: its next attempt goes to the "
        "first model up that is not among them.",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.DEFERRALS,
        _count(1),
        "How often the task was parked without spending an attempt (a limit, a cap, a "
        "fallback chain, a breaker, no free thread).",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.WATCH,
        _count(1),
        "On a long run's watch copy (long_running=True): the generation of the run it "
        "watches; a copy whose generation the task's watch has passed is acked unrun.",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.X_DELIVERY_COUNT,
        _count(0),
        "RabbitMQ's count of returns to this queue (quorum queues).",
        RABBITMQ,
    ),
)

# The stable names weclaw_mq itself writes into x-weclaw-error-type; a handler's own
# exception is written as its class name (failures.error_type).
OUR_ERROR_TYPES: tuple[str, ...] = (
    *(kind.error_type for kind in WorkerError.__subclasses__()),
    Reject.error_type,
    Retry.error_type,
    UpstreamDown.error_type,
)

# What a failed attempt adds: on a retried task back in its queue, and on a dead letter.
FAILURE: tuple[HeaderDoc, ...] = (
    HeaderDoc(
        h.ERROR_TYPE,
        {**_TEXT, "examples": list(OUR_ERROR_TYPES)},
        "The last error's stable name: one of weclaw_mq's (weclaw_mq.*) or the handler's "
        "exception class name (RuntimeError).",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.ERROR_CLASS, _TEXT, "module.QualifiedName of the error's class (for people).", WECLAW_MQ
    ),
    HeaderDoc(
        h.ERROR_MESSAGE,
        {**_TEXT, "maxLength": h.ERROR_MESSAGE_MAX_CHARS},
        "The error's message.",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.ERROR_TRACEBACK,
        {**_TEXT, "maxLength": h.TRACEBACK_MAX_CHARS},
        "The end of the error's traceback.",
        WECLAW_MQ,
    ),
    HeaderDoc(h.ORIGINAL_QUEUE, _TEXT, "The handler queue the task failed in.", WECLAW_MQ),
    HeaderDoc(h.FIRST_FAILURE_AT, _ISO_TIME, "When the task first failed (UTC).", WECLAW_MQ),
    HeaderDoc(h.LAST_FAILURE_AT, _ISO_TIME, "When it last failed (UTC).", WECLAW_MQ),
)

# Only on a dead letter.
DEAD_LETTER: tuple[HeaderDoc, ...] = (
    HeaderDoc(
        h.DEAD_LETTER_REASON,
        {"type": "string", "enum": [r.value for r in DeadLetterReason]},
        "Why the worker dead-lettered the task. Absent when RabbitMQ did (a crash loop past "
        "x-delivery-limit, or the AMQP expiration in the queue): then see x-first-death-reason.",
        WECLAW_MQ,
    ),
    HeaderDoc(
        h.X_FIRST_DEATH_REASON,
        _TEXT,
        "RabbitMQ's reason when the broker dead-lettered it (expired, delivery_limit, ...).",
        RABBITMQ,
    ),
    HeaderDoc(h.X_FIRST_DEATH_QUEUE, _TEXT, "The queue RabbitMQ dead-lettered it from.", RABBITMQ),
    HeaderDoc(
        h.X_DEATH,
        {"type": "array", "items": {"type": "object"}},
        "RabbitMQ's dead-lettering history of the message.",
        RABBITMQ,
    ),
)

# Never sent: set by the DLQ tools on a copy they could not decode, for people only.
NOT_DOCUMENTED = frozenset({h.UNDECODABLE_PROPERTIES, h.UNDECODABLE_ERROR})


def headers_schema(title: str, docs: tuple[HeaderDoc, ...]) -> dict[str, Any]:
    """An object schema of ``docs`` (all optional); other headers are allowed and passed on."""
    return {
        "title": title,
        "type": "object",
        "properties": {d.name: d.as_schema() for d in docs},
        "additionalProperties": True,
    }

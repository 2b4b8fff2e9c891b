"""Every name weclaw_mq gives on the broker and in Redis, derived from the handler queue ``Q``.

Ops tools find all queues and keys of a handler from its queue name alone, so no other module
builds a name by hand.
"""

from __future__ import annotations

import re

from .errors import ConfigurationError

DLQ_SUFFIX = ".dlq"
RETRY_INFIX = ".retry."

# Redis key prefixes (the guard and the result store build keys only through these).
REDIS_PREFIX = "weclaw_mq"
GUARD_KEY_PREFIX = f"{REDIS_PREFIX}:guard"
RESULT_KEY_PREFIX = f"{REDIS_PREFIX}:result"
RESULT_CHANNEL_PREFIX = f"{REDIS_PREFIX}:done"

# Names we add beside Q must still fit AMQP's 255-byte limit.
_MAX_QUEUE_NAME = 200
_QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]*$")


def validate_queue_name(name: str) -> str:
    if not name or len(name.encode()) > _MAX_QUEUE_NAME:
        raise ConfigurationError(f"queue name {name!r} must be 1 to {_MAX_QUEUE_NAME} bytes long")
    if name.startswith("amq."):
        raise ConfigurationError(f"queue name {name!r}: names starting with 'amq.' are reserved")
    if not _QUEUE_NAME_RE.match(name):
        raise ConfigurationError(
            f"queue name {name!r} may hold only letters, digits and '_.:-', "
            "and must start with a letter or digit"
        )
    if name.endswith(DLQ_SUFFIX) or RETRY_INFIX in name:
        raise ConfigurationError(
            f"queue name {name!r} looks like one of weclaw_mq's own derived queues "
            f"('{DLQ_SUFFIX}' / '{RETRY_INFIX}'); pick another name"
        )
    return name


def dlq_name(queue: str) -> str:
    return f"{queue}{DLQ_SUFFIX}"


def delay_label(delay_ms: int) -> str:
    """``5000`` -> ``5s``, ``250`` -> ``250ms``: readable in the management UI."""
    if delay_ms % 1000 == 0:
        return f"{delay_ms // 1000}s"
    return f"{delay_ms}ms"


def retry_queue_name(queue: str, delay_ms: int) -> str:
    return f"{queue}{RETRY_INFIX}{delay_label(delay_ms)}"


def guard_key(queue: str, task_id: str) -> str:
    return f"{GUARD_KEY_PREFIX}:{queue}:{task_id}"


def result_key(task_id: str) -> str:
    return f"{RESULT_KEY_PREFIX}:{task_id}"


def result_channel(task_id: str) -> str:
    """Pub/sub channel that wakes ``result()`` waiters when the task reaches a final state."""
    return f"{RESULT_CHANNEL_PREFIX}:{task_id}"

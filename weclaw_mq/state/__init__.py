"""A task's state: the ``TaskStore`` protocol, its Redis and in-memory implementations.

The worker and ``App`` talk to ``TaskStore`` only; ``open_store`` picks the implementation
from settings (Redis, the only one a multi-process deployment can share).

The Redis implementation (and with it redis-py, about 6 MiB of a process) is imported on
first use only: a worker with the guard and results off never loads it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from weclaw_mq.config.tls import describe_refusal
from weclaw_mq.errors import StateCommandError, StateUnavailableError
from weclaw_mq.settings import Settings
from weclaw_mq.state.cancel_records import Cancellation, CancelOutcome
from weclaw_mq.state.memory import MemoryTaskStore
from weclaw_mq.state.protocol import (
    Claim,
    Finish,
    RecordsSoon,
    TaskState,
    TaskStatus,
    TaskStore,
    new_owner,
)

if TYPE_CHECKING:
    from weclaw_mq.state.redis import REDIS_FAILURES, RedisTaskStore


def open_store(settings: Settings) -> TaskStore:
    """The store an ``App`` uses unless it is given one: Redis at ``settings.redis_url``."""
    from weclaw_mq.state.redis import open_redis_store

    return open_redis_store(settings)


# Redis's error replies that mean "not now" (a failover under way, memory full, a script still
# running, a dataset loading): waiting helps. Every other error reply is deterministic.
_TRANSIENT_REPLIES = frozenset(
    {
        *("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY"),
        *("OOM", "NOREPLICAS", "MISCONF", "MOVED", "ASK"),
    }
)


def state_unavailable(e: BaseException) -> StateUnavailableError | StateCommandError:
    """The error to raise for redis-py's ``e``: ``StateCommandError`` when Redis answered the
    command with a deterministic error (waiting will not help), else ``StateUnavailableError``."""
    if is_command_error(e):
        return StateCommandError(
            f"Redis refused a task-state command ({type(e).__name__}: {e}): not an outage, "
            "the same command fails again until its cause is fixed (a bug, an invalid "
            "setting, a missing ACL permission)"
        )
    refused = describe_refusal(e, "redis")
    if refused is not None:  # not an outage: waiting will not help, the settings must change
        return StateUnavailableError(f"cannot connect to Redis for task states: {refused}")
    return StateUnavailableError(
        f"Redis did not answer for task states ({type(e).__name__}: {e}); "
        "check WECLAW_MQ_REDIS_URL and that Redis is up"
    )


def is_state_failure(e: BaseException) -> bool:
    """Redis failing or not answering, as redis-py raises it (``REDIS_FAILURES``), checked
    without importing redis-py: a redis-py error exists only once redis-py was loaded."""
    if isinstance(e, (OSError, TimeoutError)):
        return True
    exceptions = sys.modules.get("redis.exceptions")
    return exceptions is not None and isinstance(e, exceptions.RedisError)


def is_command_error(e: BaseException) -> bool:
    """Did Redis answer with an error that the same command would meet again (a script error,
    "invalid expire time", WRONGTYPE, NOPERM)? Checked without importing redis-py."""
    exceptions = sys.modules.get("redis.exceptions")
    if exceptions is None or not isinstance(e, exceptions.ResponseError):
        return False
    code = getattr(e, "status_code", None) or str(e).split(" ", 1)[0]
    return code not in _TRANSIENT_REPLIES


def _memory_store_is_a_task_store(store: MemoryTaskStore) -> TaskStore:
    """Typed as ``TaskStore``: mypy checks that the in-memory store keeps the protocol."""
    return store


def __getattr__(name: str) -> Any:
    # The Redis names, loaded (with redis-py) when first asked for.
    if name in ("REDIS_FAILURES", "RedisTaskStore"):
        from weclaw_mq.state import redis

        return getattr(redis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REDIS_FAILURES",
    "CancelOutcome",
    "Cancellation",
    "Claim",
    "Finish",
    "MemoryTaskStore",
    "RecordsSoon",
    "RedisTaskStore",
    "TaskState",
    "TaskStatus",
    "TaskStore",
    "is_command_error",
    "is_state_failure",
    "new_owner",
    "open_store",
    "state_unavailable",
]

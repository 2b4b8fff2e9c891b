"""A task's state: the ``TaskStore`` protocol, its Redis and in-memory implementations.

The worker and ``App`` talk to ``TaskStore`` only; ``open_store`` picks the implementation
from settings (Redis, the only one a multi-process deployment can share).

The Redis implementation (and with it redis-py, about 6 MiB of a process) is imported on
first use only: a worker with the guard and results off never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weclaw_mq.settings import Settings
from weclaw_mq.state.memory import MemoryTaskStore
from weclaw_mq.state.outages import is_command_error, is_state_failure, state_unavailable
from weclaw_mq.state.protocol import (
    Cancellation,
    CancelOutcome,
    Claim,
    Deferral,
    Finish,
    RecordsSoon,
    TaskState,
    TaskStatus,
    TaskStore,
    new_owner,
)
from weclaw_mq.state.task_index import (
    IndexedTask,
    TaskIndex,
    TaskPage,
    TaskQuery,
    TimelineEvent,
)

if TYPE_CHECKING:
    from weclaw_mq.state.redis import REDIS_FAILURES, RedisTaskStore


def open_store(settings: Settings) -> TaskStore:
    """The store an ``App`` uses unless it is given one: Redis at ``settings.redis_url``."""
    from weclaw_mq.state.redis import open_redis_store

    return open_redis_store(settings)


def _memory_store_is_a_task_store(store: MemoryTaskStore) -> TaskStore:
    """Typed as ``TaskStore``: mypy checks that the in-memory store keeps the protocol."""
    return store


def _memory_store_is_a_task_index(store: MemoryTaskStore) -> TaskIndex:
    """Typed as ``TaskIndex``: mypy checks that the in-memory store keeps that one too."""
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
    "Deferral",
    "Finish",
    "IndexedTask",
    "MemoryTaskStore",
    "RecordsSoon",
    "RedisTaskStore",
    "TaskIndex",
    "TaskPage",
    "TaskQuery",
    "TaskState",
    "TaskStatus",
    "TaskStore",
    "TimelineEvent",
    "is_command_error",
    "is_state_failure",
    "new_owner",
    "open_store",
    "state_unavailable",
]

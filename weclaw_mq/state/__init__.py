"""A task's state: the ``TaskStore`` protocol, its Redis and in-memory implementations.

The worker and ``App`` talk to ``TaskStore`` only; ``open_store`` picks the implementation
from settings (Redis, the only one a multi-process deployment can share).
"""

from __future__ import annotations

from ..settings import Settings
from .cancel import Cancellation, CancelOutcome
from .memory import MemoryTaskStore
from .protocol import Claim, TaskState, TaskStatus, TaskStore, new_owner
from .redis import REDIS_FAILURES, RedisTaskStore, open_redis_store, state_unavailable


def open_store(settings: Settings) -> TaskStore:
    """The store an ``App`` uses unless it is given one: Redis at ``settings.redis_url``."""
    return open_redis_store(settings)


def _memory_store_is_a_task_store(store: MemoryTaskStore) -> TaskStore:
    """Typed as ``TaskStore``: mypy checks that the in-memory store keeps the protocol."""
    return store


__all__ = [
    "REDIS_FAILURES",
    "CancelOutcome",
    "Cancellation",
    "Claim",
    "MemoryTaskStore",
    "RedisTaskStore",
    "TaskState",
    "TaskStatus",
    "TaskStore",
    "new_owner",
    "open_store",
    "state_unavailable",
]

"""Streamed partial output (``ctx.emit``, ``App.stream``) and per-session inboxes
(``App.inbox``), on a ``StreamStore`` (Redis Streams by default)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weclaw_mq.streaming.events import EventKind, StreamEvent
from weclaw_mq.streaming.memory import MemoryStreamStore
from weclaw_mq.streaming.protocol import StreamStore
from weclaw_mq.streaming.reading import Inbox

if TYPE_CHECKING:
    from weclaw_mq.streaming.redis import RedisStreamStore, open_redis_streams


def __getattr__(name: str) -> Any:
    # The Redis store (and redis-py with it) is loaded when first asked for, as in ``state``:
    # a worker with results off never loads it.
    if name in ("RedisStreamStore", "open_redis_streams"):
        from weclaw_mq.streaming import redis

        return getattr(redis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EventKind",
    "Inbox",
    "MemoryStreamStore",
    "RedisStreamStore",
    "StreamEvent",
    "StreamStore",
    "open_redis_streams",
]

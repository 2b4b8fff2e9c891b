"""Streamed partial output (``ctx.emit``, ``App.stream``) and per-session inboxes
(``App.inbox``), on a ``StreamStore`` (Redis Streams by default)."""

from __future__ import annotations

from .events import EventKind, StreamEvent
from .memory import MemoryStreamStore
from .protocol import StreamStore
from .reading import Inbox
from .redis import RedisStreamStore, open_redis_streams


def _memory_store_is_a_stream_store(store: MemoryStreamStore) -> StreamStore:
    """Typed as ``StreamStore``: mypy checks that both stores keep the protocol."""
    return store


def _redis_store_is_a_stream_store(store: RedisStreamStore) -> StreamStore:
    return store


__all__ = [
    "EventKind",
    "Inbox",
    "MemoryStreamStore",
    "RedisStreamStore",
    "StreamEvent",
    "StreamStore",
    "open_redis_streams",
]

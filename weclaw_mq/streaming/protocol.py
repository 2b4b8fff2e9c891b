"""``StreamStore``: where task streams and session inboxes live (beside the ``TaskStore``).

Two kinds of log, both append-only and ordered by event id:
- a task's stream: attempt markers and chunks written by ``ctx.emit``, then one final event;
- a session's inbox: the same events of every task published with that session id, kept
  until the client confirms them, ``inbox_ttl_s`` passes, or the inbox is full.

``streaming.redis.RedisStreamStore`` is the default (Redis Streams);
``streaming.memory.MemoryStreamStore`` keeps the same rules in one process, for tests.
A store that fails or does not answer raises ``StateUnavailableError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .events import Entry, StreamEvent

# A read returns at most this many entries (one round trip); a reader behind by more reads
# again. A live reader asks for fewer (LIVE_READ_BATCH): what it read waits in its memory
# until its consumer takes it, and that consumer may be a client that reads slowly or never.
READ_BATCH = 500
LIVE_READ_BATCH = 32


class StreamStore(Protocol):
    async def write(
        self, task_id: str, entries: Sequence[Entry], *, session_id: str | None
    ) -> None:
        """Append ``entries`` to the task's stream and, with ``session_id``, to that inbox."""
        ...

    async def end(self, task_id: str, final: Entry) -> str:
        """Append ``final`` to the task's stream unless its last entry already is that same
        final (so any number of readers may end it, each deriving the same event from the
        same state); the id of the final the stream ends with."""
        ...

    async def read(
        self, task_id: str, after: str, timeout_s: float, *, count: int = READ_BATCH
    ) -> list[StreamEvent]:
        """The task's events after ``after``, oldest first, at most ``count``; waits up to
        ``timeout_s`` for one when there is none yet (an empty list then)."""
        ...

    async def deliver(self, session_id: str, entries: Sequence[Entry]) -> int:
        """Append ``entries`` to the session's inbox only; returns how many of its oldest
        entries were dropped to stay within ``inbox_max_entries``."""
        ...

    async def read_inbox(
        self,
        session_id: str,
        after: str,
        timeout_s: float,
        *,
        expire: bool = True,
        count: int = READ_BATCH,
    ) -> list[StreamEvent]:
        """``read`` for the session's inbox. With ``expire``, entries past ``inbox_ttl_s``
        are removed first, leaving an "expired" event that names the tasks whose final reply
        went unread (it folds in any earlier "expired" event that expired in its turn)."""
        ...

    async def confirm(self, session_id: str, upto: str) -> None:
        """Remove the session's entries up to and including the id ``upto``."""
        ...

    async def dropped(self, session_id: str) -> int:
        """How many entries the session's inbox dropped because it was full."""
        ...

    async def close(self) -> None: ...

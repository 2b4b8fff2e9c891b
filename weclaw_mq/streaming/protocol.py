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

from weclaw_mq.streaming.events import Entry, StreamEvent

# A read returns at most this many entries (one round trip); a reader behind by more reads
# again. A live reader asks for fewer (LIVE_READ_BATCH): what it read waits in its memory
# until its consumer takes it, and that consumer may be a client that reads slowly or never.
READ_BATCH = 500
LIVE_READ_BATCH = 32


class StreamStore(Protocol):
    """Task streams and session inboxes: append-only logs ordered by event id."""

    async def write(
        self, task_id: str, entries: Sequence[Entry], *, session_id: str | None
    ) -> None:
        """Append ``entries`` to the task's stream and, with ``session_id``, to that inbox.

        Args:
            task_id: The task's id.
            entries: The events, encoded.
            session_id: The session whose inbox gets them too, or None.
        """
        ...

    async def end(self, task_id: str, final: Entry) -> str:
        """Append ``final`` to the task's stream unless its last entry already is that same final.

        So any number of readers may end it, each deriving the same event from the same
        state.

        Args:
            task_id: The task's id.
            final: The final event, encoded.

        Returns:
            The id of the final the stream ends with.
        """
        ...

    async def read(
        self, task_id: str, after: str, timeout_s: float, *, count: int = READ_BATCH
    ) -> list[StreamEvent]:
        """The task's events after ``after``, oldest first.

        Args:
            task_id: The task's id.
            after: An event id; only later events are read.
            timeout_s: How long to wait for one when there is none yet, in seconds.
            count: At most this many.

        Returns:
            The events; an empty list when none came within ``timeout_s``.
        """
        ...

    async def deliver(self, session_id: str, entries: Sequence[Entry]) -> int:
        """Append ``entries`` to the session's inbox only.

        Args:
            session_id: The session.
            entries: The events, encoded.

        Returns:
            How many of its oldest entries were dropped to stay within
            ``inbox_max_entries``.
        """
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
        """``read`` for the session's inbox.

        Args:
            session_id: The session.
            after: An event id; only later events are read.
            timeout_s: How long to wait for one when there is none yet, in seconds.
            expire: Remove entries past ``inbox_ttl_s`` first, leaving an "expired" event
                that names the tasks whose final reply went unread (it folds in any earlier
                "expired" event that expired in its turn).
            count: At most this many.

        Returns:
            The events; an empty list when none came within ``timeout_s``.
        """
        ...

    async def confirm(self, session_id: str, upto: str) -> None:
        """Remove the session's entries up to and including the id ``upto``.

        Args:
            session_id: The session.
            upto: An event id.
        """
        ...

    async def dropped(self, session_id: str) -> int:
        """How many entries the session's inbox dropped because it was full.

        Args:
            session_id: The session.

        Returns:
            The number of entries dropped.
        """
        ...

    async def close(self) -> None:
        """Release what the store opened."""
        ...

"""Reading a task's stream (``App.stream``) and a session's inbox (``App.inbox``).

A task's stream ends with a final event. Nothing in the worker has to write it: the reader
waits for the task's final state as ``App.result`` answers it (woken, not polling) and then
appends the final to the stream itself (``StreamStore.end``: once, however many readers
race). So every terminal status ends the stream, whoever wrote it or however it is derived
(succeeded, dead-lettered, expired by the broker with no worker involved, and any status
added later whose ``terminal`` is true), and the final's id sorts after every chunk: the
worker drains a run's chunks before it stores the result.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from weclaw_mq.errors import ResultTimeoutError
from weclaw_mq.state import TaskState
from weclaw_mq.streaming.events import (
    FINAL,
    FIRST_ID,
    StreamEvent,
    check_event_id,
    final_entry,
    id_key,
)
from weclaw_mq.streaming.protocol import LIVE_READ_BATCH, StreamStore

# How long one wait for the final state lasts before the reader waits again.
_WAIT_ROUND_S = 3600.0
# Finals an inbox reader remembers to drop their copies (RecentFinals).
FINALS_KEPT = 256


# Waits for the task's final state (``App.result`` with a timeout); raises
# ResultTimeoutError when there is none yet.
FinalState = Callable[[float], Awaitable[TaskState]]


async def _end_when_final(streams: StreamStore, task_id: str, final_state: FinalState) -> str:
    """The id of the task's final event, once it has a final state."""
    while True:
        with contextlib.suppress(ResultTimeoutError):
            state = await final_state(_WAIT_ROUND_S)
            return await streams.end(task_id, final_entry(state))


async def task_events(
    streams: StreamStore,
    task_id: str,
    after: str | None,
    *,
    final_state: FinalState,
    queue: str | None,
    block_s: float,
) -> AsyncIterator[StreamEvent]:
    """Every event after ``after`` (from the start without it), live, up to the final."""
    last = check_event_id(after) if after is not None else FIRST_ID
    loop = asyncio.get_running_loop()
    ender = loop.create_task(_end_when_final(streams, task_id, final_state))
    read: asyncio.Task[list[StreamEvent]] | None = None
    try:
        while True:
            read = loop.create_task(streams.read(task_id, last, block_s, count=LIVE_READ_BATCH))
            if not ender.done():
                await asyncio.wait({read, ender}, return_when=asyncio.FIRST_COMPLETED)
            # ender.result() raises the store's error, if it failed. A final at or before
            # ``last`` (a reader resuming after it) means nothing more is coming.
            if ender.done() and not read.done() and id_key(ender.result()) <= id_key(last):
                return
            events = await read
            for i, event in enumerate(events):
                last = event.id
                yield event
                # A final followed by more (an ops requeue from the DLQ ran the task again)
                # does not end the stream.
                if (
                    event.kind == FINAL
                    and (queue is None or event.queue == queue)
                    and i == len(events) - 1
                ):
                    return
    finally:
        for task in (ender, read):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


class Inbox:
    """A session's pending events, oldest first, then live ones.

    ``async for`` yields them (it never ends by itself); ``confirm`` removes what the client
    has received. A final reply written twice (a worker crashed between writing it and
    acking the task) is yielded once per iteration. ``App.inbox`` makes one.

    Args:
        streams: The stream store the inbox lives in.
        session_id: The session.
        after: Start after this event id; None for the oldest pending event.
        block_s: How long one read waits for a new event before the loop takes its turn,
            in seconds.

    Raises:
        ConfigurationError: An ``after`` that is not a stream event id.
    """

    def __init__(
        self, streams: StreamStore, session_id: str, *, after: str | None, block_s: float
    ) -> None:
        self.session_id = session_id
        self._streams = streams
        self._after = check_event_id(after) if after is not None else FIRST_ID
        self._block_s = block_s

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[StreamEvent]:
        last = self._after
        finals = RecentFinals()
        while True:
            batch = await self._streams.read_inbox(
                self.session_id, last, self._block_s, count=LIVE_READ_BATCH
            )
            for event in batch:
                last = event.id
                if finals.first_time(event):
                    yield event

    async def pending(self) -> list[StreamEvent]:
        """Everything pending now (after ``after``), oldest first, without waiting.

        Returns:
            The pending events; a final reply written twice is listed once.
        """
        last, out = self._after, []
        finals = RecentFinals()
        # Expired entries are removed once, before the first read: an "expired" record that
        # expired in its turn mid-way would otherwise be listed twice.
        expire = True
        while batch := await self._streams.read_inbox(self.session_id, last, 0, expire=expire):
            expire = False
            last = batch[-1].id
            out += [event for event in batch if finals.first_time(event)]
        return out

    async def confirm(self, event_id: str) -> None:
        """Remove every entry up to and including ``event_id``: the client has them.

        Args:
            event_id: The id of the last event the client received.

        Raises:
            ConfigurationError: ``event_id`` is not a stream event id.
        """
        await self._streams.confirm(self.session_id, check_event_id(event_id))

    async def dropped(self) -> int:
        """How many entries this inbox dropped, oldest first, because it was full.

        Returns:
            The number of entries dropped.
        """
        return await self._streams.dropped(self.session_id)


class RecentFinals:
    """The finals yielded lately, to drop a copy of one: the copy a worker writes again
    after a crash between storing the result and acking the task, which follows the first
    within that redelivery's time. Only the last ``FINALS_KEPT`` are kept: a session stream
    lives as long as its client, and a copy further behind is yielded again (readers
    de-duplicate by task id), where an unbounded set would grow for the stream's life."""

    def __init__(self, kept: int | None = None) -> None:
        self._kept = FINALS_KEPT if kept is None else kept
        self._seen: dict[tuple[str, int], None] = {}  # oldest first

    def first_time(self, event: StreamEvent) -> bool:
        """False for a final already yielded (same task and attempt)."""
        if event.kind != FINAL:
            return True
        key = (event.task_id, event.attempt)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._kept:
            del self._seen[next(iter(self._seen))]
        return True

    def __len__(self) -> int:
        return len(self._seen)

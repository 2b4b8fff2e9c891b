"""``StreamStore`` in this process's memory: the rules of ``RedisStreamStore``, nothing shared.

For tests and single-process setups, beside ``MemoryTaskStore``. Ids have Redis's form
(``<ms>-<seq>``, strictly increasing); ``clock`` (seconds since the epoch) lets tests make
inbox entries expire without waiting. Task streams are kept for the process's life.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import pydantic_core

from weclaw_mq.streaming.events import (
    EXPIRED,
    FINAL,
    Entry,
    StreamEvent,
    decode,
    expired_entry,
    id_key,
)
from weclaw_mq.streaming.protocol import READ_BATCH, StreamStore


class MemoryStreamStore(StreamStore):
    """A ``StreamStore`` in one process, with the Redis store's rules (for tests).

    Its methods do what ``StreamStore`` says, where their docstrings are written.

    Args:
        inbox_ttl_s: How long an inbox entry is kept unconfirmed, in seconds.
        inbox_max_entries: The most entries an inbox holds; the oldest are dropped past it.
        clock: Seconds since the epoch: event ids are made from it, and inbox entries expire
            by it.
    """

    def __init__(
        self,
        *,
        inbox_ttl_s: float = 7 * 24 * 3600,
        inbox_max_entries: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._inbox_ttl_ms = int(inbox_ttl_s * 1000)
        self._inbox_max = inbox_max_entries
        self._clock = clock
        self._logs: dict[str, list[tuple[str, Entry]]] = {}
        self._dropped: dict[str, int] = {}
        self._last = (0, 0)
        # Set and replaced on every append: readers wait on it instead of polling.
        self._appended = asyncio.Event()

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _append(self, key: str, entry: Entry) -> None:
        ms = max(self._now_ms(), self._last[0])
        self._last = (ms, self._last[1] + 1 if ms == self._last[0] else 0)
        self._logs.setdefault(key, []).append((f"{ms}-{self._last[1]}", entry))
        self._appended.set()
        self._appended = asyncio.Event()

    async def write(
        self, task_id: str, entries: Sequence[Entry], *, session_id: str | None
    ) -> None:
        for entry in entries:
            self._append("task:" + task_id, entry)
        if session_id is not None:
            await self.deliver(session_id, entries)

    async def end(self, task_id: str, final: Entry) -> str:
        key = "task:" + task_id
        log = self._logs.get(key)
        if not (log and log[-1][1] == final):
            self._append(key, final)
        return self._logs[key][-1][0]

    async def _read(self, key: str, after: str, timeout_s: float, count: int) -> list[StreamEvent]:
        woken = self._appended
        events = self._after(key, after, count)
        if not events and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout_s)
            events = self._after(key, after, count)
        return events

    def _after(self, key: str, after: str, count: int) -> list[StreamEvent]:
        start = id_key(after)
        later = [(i, e) for i, e in self._logs.get(key, []) if id_key(i) > start][:count]
        return [decode(i, e.body) for i, e in later]

    async def read(
        self, task_id: str, after: str, timeout_s: float, *, count: int = READ_BATCH
    ) -> list[StreamEvent]:
        return await self._read("task:" + task_id, after, timeout_s, count)

    def _expire(self, session_id: str) -> None:
        key = "inbox:" + session_id
        cutoff = (self._now_ms() - self._inbox_ttl_ms, 0)
        log = self._logs.get(key, [])
        old = [(i, e) for i, e in log if id_key(i) < cutoff]
        if not old:
            return
        self._logs[key] = log[len(old) :]
        tasks: list[str] = []
        lost = 0
        for _, entry in old:  # the rules of redis._EXPIRE_LUA
            fields = pydantic_core.from_json(entry.body)
            if entry.kind == EXPIRED:
                tasks += fields["data"]["tasks"]
                lost += fields["data"]["entries"]
            else:
                lost += 1
                if entry.kind == FINAL:
                    tasks.append(fields["task_id"])
        if lost:
            self._append(key, expired_entry(tasks, lost))

    async def deliver(self, session_id: str, entries: Sequence[Entry]) -> int:
        key = "inbox:" + session_id
        self._expire(session_id)
        for entry in entries:
            self._append(key, entry)
        log = self._logs[key]
        over = max(0, len(log) - self._inbox_max)
        if over:
            del log[:over]
            self._dropped[session_id] = self._dropped.get(session_id, 0) + over
        return over

    async def read_inbox(
        self,
        session_id: str,
        after: str,
        timeout_s: float,
        *,
        expire: bool = True,
        count: int = READ_BATCH,
    ) -> list[StreamEvent]:
        if expire:
            self._expire(session_id)
        return await self._read("inbox:" + session_id, after, timeout_s, count)

    async def confirm(self, session_id: str, upto: str) -> None:
        key = "inbox:" + session_id
        end = id_key(upto)
        self._logs[key] = [(i, e) for i, e in self._logs.get(key, []) if id_key(i) > end]

    async def dropped(self, session_id: str) -> int:
        return self._dropped.get(session_id, 0)

    async def close(self) -> None:
        return None  # nothing to release

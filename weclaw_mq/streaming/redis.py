"""The default ``StreamStore``: task streams and session inboxes as Redis Streams.

Keys come from ``naming`` (``stream_key``, ``inbox_key``, ``inbox_trace_key``). A task's
stream lives ``result_ttl_s`` after its last write, like its record. An inbox's entries live
``inbox_ttl_s`` each (trimmed by id, which is the time Redis added them), replaced by an
"expired" record; the key itself goes ``2 * inbox_ttl_s`` after its last write (a reply, or
such a record), so a record outlives what it reports by one TTL.

What survives a Redis restart is what Redis persisted: with ``appendonly yes`` every entry
acknowledged before the restart (up to the last fsync, one second by default); with neither
AOF nor RDB snapshots, nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ..naming import inbox_key, inbox_trace_key, stream_key
from ..settings import Settings
from ..state import state_unavailable
from ..state.redis import REDIS_FAILURES, open_client
from ..state.redis_clients import StateClient
from .events import Entry, StreamEvent, decode, next_id
from .protocol import READ_BATCH

# Lua helpers shared by the scripts. Entry fields are k (kind) and e (JSON).
_FIELDS_LUA = """
local function fields(flat)
  local out = {}
  for i = 1, #flat, 2 do out[flat[i]] = flat[i + 1] end
  return out
end
"""

# Entries older than the TTL go, and one "expired" record says how many and which tasks'
# final replies were among them. An earlier "expired" record that expires in its turn is
# folded into the new one, so the trace lasts until the client confirms it, or until the
# whole key expires: 2 * TTL after its last write, so a record outlives what it reports.
_EXPIRE_LUA = (
    _FIELDS_LUA
    + """
local function expire(inbox, ttl_ms)
  local t = redis.call('TIME')
  local cutoff = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ttl_ms)
  if cutoff <= 0 then return end
  local old = redis.call('XRANGE', inbox, '-', '(' .. cutoff .. '-0')
  if #old == 0 then return end
  local tasks, lost = {}, 0
  for _, entry in ipairs(old) do
    local f = fields(entry[2])
    if f['k'] == 'expired' then
      local data = cjson.decode(f['e'])['data']
      for _, task in ipairs(data['tasks']) do table.insert(tasks, task) end
      lost = lost + data['entries']
    else
      lost = lost + 1
      if f['k'] == 'final' then table.insert(tasks, cjson.decode(f['e'])['task_id']) end
    end
  end
  redis.call('XTRIM', inbox, 'MINID', cutoff .. '-0')
  if lost > 0 then
    local data = {tasks = tasks, entries = lost}
    local body = cjson.encode({kind = 'expired', task_id = '', data = data})
    redis.call('XADD', inbox, '*', 'k', 'expired', 'e', body)
    redis.call('PEXPIRE', inbox, 2 * tonumber(ttl_ms))
  end
end
"""
)

_DELIVER = (
    _EXPIRE_LUA
    + """
expire(KEYS[1], ARGV[2])
for i = 3, #ARGV, 2 do
  redis.call('XADD', KEYS[1], '*', 'k', ARGV[i], 'e', ARGV[i + 1])
end
local over = redis.call('XLEN', KEYS[1]) - tonumber(ARGV[1])
if over > 0 then
  redis.call('XTRIM', KEYS[1], 'MAXLEN', ARGV[1])
  redis.call('HINCRBY', KEYS[2], 'dropped', over)
else
  over = 0
end
local keep = 2 * tonumber(ARGV[2])
redis.call('PEXPIRE', KEYS[1], keep)
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], keep) end
return over
"""
)
"""Append to an inbox, oldest-first bounded. KEYS: inbox, trace. ARGV: max entries, ttl_ms,
then kind, JSON for each entry. Returns how many oldest entries were dropped."""

_EXPIRE = (
    _EXPIRE_LUA
    + """
expire(KEYS[1], ARGV[1])
return 1
"""
)

_END = (
    _FIELDS_LUA
    + """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if last then
  local f = fields(last[2])
  if f['k'] == 'final' and f['e'] == ARGV[1] then return last[1] end
end
local id = redis.call('XADD', KEYS[1], '*', 'k', 'final', 'e', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return id
"""
)
"""Append a final unless the stream already ends with the same one (readers racing to end
it derive the same JSON from the same state; a task run again after its final, by an ops
requeue, ends with a new one); either way return the id of the final it ends with.
KEYS: stream. ARGV: JSON, ttl_ms."""


# Writes (chunks, final events, inbox deliveries) on Redis at once, per store: each takes a
# pooled connection, so a worker's emitting tasks share this many whatever its concurrency.
WRITES_IN_FLIGHT = 8


class RedisStreamStore:
    """``StreamStore`` on Redis; ``owns_client``: ``close`` closes the client too."""

    def __init__(
        self,
        client: StateClient,
        *,
        ttl_s: float,
        inbox_ttl_s: float,
        inbox_max_entries: int,
        owns_client: bool = False,
    ) -> None:
        self._redis = client
        self._owns_client = owns_client
        self._ttl_ms = int(ttl_s * 1000)
        self._inbox_ttl_ms = int(inbox_ttl_s * 1000)
        self._inbox_max = inbox_max_entries
        self._deliver = client.register_script(_DELIVER)
        self._expire = client.register_script(_EXPIRE)
        self._end = client.register_script(_END)
        self._writing = asyncio.Semaphore(WRITES_IN_FLIGHT)

    def _deliver_args(self, entries: Sequence[Entry]) -> list[Any]:
        args: list[Any] = [self._inbox_max, self._inbox_ttl_ms]
        for entry in entries:
            args += [entry.kind, entry.body]
        return args

    async def write(
        self, task_id: str, entries: Sequence[Entry], *, session_id: str | None
    ) -> None:
        key = stream_key(task_id)
        try:
            # One round trip: the task's stream and the inbox are on different hash tags, so
            # a pipeline rather than one script (a cluster could not run that script).
            async with self._writing, self._redis.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.xadd(key, {"k": entry.kind, "e": entry.body})
                pipe.pexpire(key, self._ttl_ms)
                if session_id is not None:
                    await self._deliver(
                        keys=[inbox_key(session_id), inbox_trace_key(session_id)],
                        args=self._deliver_args(entries),
                        client=pipe,  # type: ignore[arg-type]  # (a cluster pipeline too)
                    )
                await pipe.execute()
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def end(self, task_id: str, final: Entry) -> str:
        try:
            async with self._writing:
                final_id = await self._end(
                    keys=[stream_key(task_id)], args=[final.body, self._ttl_ms]
                )
            return final_id.decode() if isinstance(final_id, bytes) else str(final_id)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _read(self, key: str, after: str, timeout_s: float, count: int) -> list[StreamEvent]:
        # BLOCK 0 would wait forever; a reader wants its turn back to check on the task.
        block = max(1, int(timeout_s * 1000)) if timeout_s > 0 else None
        # RESP2 (redis-py's default): [[key, [(id, {field: value}), ...]]]; typed loosely.
        answer: Any = await self._redis.xread({key: after}, count=count, block=block)
        if not answer:
            return []
        entries: list[tuple[bytes, dict[bytes, bytes]]] = answer[0][1]
        return [decode(event_id.decode(), fields[b"e"]) for event_id, fields in entries]

    async def read(
        self, task_id: str, after: str, timeout_s: float, *, count: int = READ_BATCH
    ) -> list[StreamEvent]:
        try:
            return await self._read(stream_key(task_id), after, timeout_s, count)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def deliver(self, session_id: str, entries: Sequence[Entry]) -> int:
        try:
            async with self._writing:
                dropped = await self._deliver(
                    keys=[inbox_key(session_id), inbox_trace_key(session_id)],
                    args=self._deliver_args(entries),
                )
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        return int(dropped)

    async def read_inbox(
        self,
        session_id: str,
        after: str,
        timeout_s: float,
        *,
        expire: bool = True,
        count: int = READ_BATCH,
    ) -> list[StreamEvent]:
        key = inbox_key(session_id)
        try:
            if expire:
                await self._expire(keys=[key], args=[self._inbox_ttl_ms])
            return await self._read(key, after, timeout_s, count)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def confirm(self, session_id: str, upto: str) -> None:
        try:
            await self._redis.xtrim(inbox_key(session_id), minid=next_id(upto), approximate=False)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def dropped(self, session_id: str) -> int:
        try:
            raw = await self._redis.hget(inbox_trace_key(session_id), "dropped")
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        return int(raw) if raw is not None else 0

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()


def open_redis_streams(settings: Settings) -> RedisStreamStore:
    """The default stream store, on its own connection pool: readers block on a connection
    each (``XREAD BLOCK``), which must not starve the worker's claims and results."""
    return RedisStreamStore(
        open_client(settings),
        ttl_s=settings.result_ttl_s,
        inbox_ttl_s=settings.inbox_ttl_s,
        inbox_max_entries=settings.inbox_max_entries,
        owns_client=True,
    )

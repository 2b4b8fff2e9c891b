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

from weclaw_mq.contract.naming import inbox_key, inbox_trace_key, stream_key
from weclaw_mq.settings import Settings
from weclaw_mq.state.outages import state_unavailable
from weclaw_mq.state.pipelining import AutoPipeline, Script
from weclaw_mq.state.redis import REDIS_FAILURES, open_client
from weclaw_mq.state.redis_clients import StateClient
from weclaw_mq.state.redis_wakeups import RECHECK_S, LoopWakeups
from weclaw_mq.streaming.events import Entry, StreamEvent, decode, next_id
from weclaw_mq.streaming.protocol import READ_BATCH, StreamStore

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
redis.call('PUBLISH', KEYS[1], '')
return over
"""
)
"""Append to an inbox, oldest-first bounded, and wake its readers (the inbox's key names its
channel). KEYS: inbox, trace. ARGV: max entries, ttl_ms, then kind, JSON for each entry.
Returns how many oldest entries were dropped."""

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
redis.call('PUBLISH', KEYS[1], '')
return id
"""
)
"""Append a final unless the stream already ends with the same one (readers racing to end
it derive the same JSON from the same state; a task run again after its final, by an ops
requeue, ends with a new one); either way return the id of the final it ends with.
KEYS: stream. ARGV: JSON, ttl_ms."""

# After a task's stream is written: its TTL, and a wake-up for its readers (a stream's key
# names its channel too). A script, as a cluster pipeline refuses PUBLISH. KEYS: stream.
# ARGV: ttl_ms.
_WROTE = """
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[1], '')
return 1
"""

# A read that never blocks, so it can share the store's pipelined connections (a blocking
# XREAD would hold one per reader). KEYS: stream. ARGV: after, count.
_READ = "return redis.call('XREAD', 'COUNT', ARGV[2], 'STREAMS', KEYS[1], ARGV[1])"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Chunk writes on Redis at once, per store: each takes a pooled connection, so a worker's
# emitting tasks share this many whatever its concurrency (ends, reads and lone deliveries go
# through the store's auto-pipeline instead).
WRITES_IN_FLIGHT = 8


class RedisStreamStore(StreamStore):
    """``StreamStore`` on Redis (Redis Streams).

    Its methods do what ``StreamStore`` says, where their docstrings are written. Each raises
    ``StateUnavailableError`` when Redis fails or does not answer, and ``StateCommandError``
    when Redis answered with an error (not an outage).

    Args:
        client: The redis-py client (one Redis, a Cluster or a Sentinel set).
        ttl_s: How long a task's stream is kept, in seconds.
        inbox_ttl_s: How long an inbox entry is kept unconfirmed, in seconds.
        inbox_max_entries: The most entries an inbox holds; the oldest are dropped past it.
        owns_client: ``close`` closes the client too.
    """

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
        # Readers (and their ends: every reader of a task may race to write its final) are
        # woken through one subscription and share one auto-pipeline's connections.
        self._pipe = AutoPipeline(client)
        self._expire = Script.of(_EXPIRE)
        self._end = Script.of(_END)
        self._deliver_alone = Script.of(_DELIVER)
        self._read_script = Script.of(_READ)
        self._wakeups = LoopWakeups(client)
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
                # By its text: a registered script would make redis-py's pipeline ask
                # SCRIPT EXISTS first, a round trip per write.
                pipe.execute_command("EVAL", _WROTE, 1, key, self._ttl_ms)
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
            final_id = await self._pipe.script(
                self._end, [stream_key(task_id)], [final.body, self._ttl_ms]
            )
            return final_id.decode() if isinstance(final_id, bytes) else str(final_id)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _read_now(self, key: str, after: str, count: int) -> list[StreamEvent]:
        # RESP2: [[key, [[id, [field, value, ...]], ...]]], or None; typed loosely.
        answer: Any = await self._pipe.script(self._read_script, [key], [after, count])
        if not answer:
            return []
        events = []
        for event_id, flat in answer[0][1]:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            events.append(decode(_text(event_id), fields[b"e"]))
        return events

    async def _read(self, key: str, after: str, timeout_s: float, count: int) -> list[StreamEvent]:
        if timeout_s <= 0:
            return await self._read_now(key, after, count)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Watched before the first read, which waits for the subscription: an entry written
        # in between still wakes us.
        wakeups = self._wakeups.here()
        watch = wakeups.watch(key)
        try:
            while True:
                left = deadline - loop.time()
                # A read ends with one more look at its deadline, woken or not: a writer of an
                # older version wakes nobody.
                await watch.wait(left if watch.subscribed else min(left, RECHECK_S))
                events = await self._read_now(key, after, count)
                if events or deadline - loop.time() <= 0:
                    return events
        finally:
            wakeups.unwatch(watch)

    async def read(
        self, task_id: str, after: str, timeout_s: float, *, count: int = READ_BATCH
    ) -> list[StreamEvent]:
        try:
            return await self._read(stream_key(task_id), after, timeout_s, count)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def deliver(self, session_id: str, entries: Sequence[Entry]) -> int:
        try:
            dropped = await self._pipe.script(
                self._deliver_alone,
                [inbox_key(session_id), inbox_trace_key(session_id)],
                self._deliver_args(entries),
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
                await self._pipe.script(self._expire, [key], [self._inbox_ttl_ms])
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
        # The wake-up subscription, the auto-pipeline; the client if it is ours (owns_client).
        await self._wakeups.close()
        await self._pipe.close()
        if self._owns_client:
            await self._redis.aclose()


def open_redis_streams(settings: Settings) -> RedisStreamStore:
    """The default stream store, on its own connection pool: its readers share one
    subscription and one auto-pipeline of it (``state.redis_wakeups``)."""
    return RedisStreamStore(
        open_client(settings),
        ttl_s=settings.result_ttl_s,
        inbox_ttl_s=settings.inbox_ttl_s,
        inbox_max_entries=settings.inbox_max_entries,
        owns_client=True,
    )

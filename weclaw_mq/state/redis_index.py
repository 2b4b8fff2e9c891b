"""The task index and timelines on Redis (``state.task_index`` says what they answer).

Where each write goes:
- The timeline (``naming.timeline_key``, a list in the task's slot) gets its event from the
  record's own script (``INDEX_WRITE_LUA``, called by ``write_record`` when the record is
  written): atomic with the record, no round trip of its own.
- The index (``naming.TASK_INDEX_KEY`` and its per-queue and per-status sorted sets, all in
  the ``{tasks}`` slot). On one Redis (or a Sentinel set's primary) the same script writes it
  too: an entry when the write created the task's record in that queue, and the sparse
  status's entry (at the task's index time) with a final record of that status, for a task
  still indexed. On a Redis Cluster the index's slot is not the task's, so the store sends
  ``INDEX_SCRIPT`` beside the record's script, in the same auto-pipeline batch (no extra
  round trip; one more command on the ``{tasks}`` node), for the writes of a status that may
  create a record (stored_locally, queued, running: its ``ZADD NX`` keeps the first time)
  or of a sparse one. Unlike one Redis, a cluster's companion cannot see whether the record
  was written: a task whose first record is a final one (a worker's ``expired`` for a task
  published without results) gets no entry there, and a refused write still counts.
  One slot takes every index write: one O(log n) ZADD or two per task, far below what one
  Redis node serves, so a hot slot is accepted for an index that pages in one place.
- The bounds: at a store's first index write and every ``TRIM_EVERY`` after (per store, so a
  process of a few writes trims too) ``TRIM_SCRIPT`` drops entries older than the age bound,
  then the oldest past the count bound, at most ``TRIM_MOST`` per sorted set per call, so a
  trim never blocks Redis for long, and a backlog is worked off over a few trims.
- The reads: ``RedisTaskIndex.list_tasks`` and ``timeline``, which the store's
  ``RedisIndexReads`` (inherited by ``RedisTaskStore``) calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from weclaw_mq.contract.naming import (
    LATEST_KEY_PREFIX,
    TASK_INDEX_KEY,
    TASK_INDEX_QUEUES_KEY,
    TIMELINE_KEY_PREFIX,
    index_entry,
    index_member,
    state_key,
    task_index_queue_key,
    task_index_status_key,
    timeline_key,
)
from weclaw_mq.state.outages import state_unavailable
from weclaw_mq.state.pipelining import AutoPipeline, Script
from weclaw_mq.state.protocol import TaskState, TaskStatus
from weclaw_mq.state.redis_clients import REDIS_FAILURES
from weclaw_mq.state.task_index import (
    SPARSE_STATUSES,
    TIMELINE_MAX_EVENTS,
    TaskIndex,
    TaskPage,
    TaskQuery,
    TimelineEvent,
    as_text,
    index_off,
    read_timeline,
    scan_page,
    timeline_event,
)

log = logging.getLogger("weclaw_mq.state")

# Index writes between two trims (per store): the index runs over its count bound by about
# this many entries per writer, and the trim's cost is spread thin.
TRIM_EVERY = 1000
# The most entries one trim drops from one sorted set: it runs inside Redis, which serves
# nothing else meanwhile (10,000 ZSET removals take a few milliseconds).
TRIM_MOST = 10_000

# The statuses whose writes may create a task's record in a queue (the index entry's moment).
_FIRST_STATUSES = frozenset({TaskStatus.STORED_LOCALLY, TaskStatus.QUEUED, TaskStatus.RUNNING})
# The statuses whose writes touch the index (the others only append to the timeline).
_INDEXED = _FIRST_STATUSES | SPARSE_STATUSES
_FINAL = frozenset(s for s in TaskStatus if s.terminal)

# Called by write_record (state.redis.RECORD_WRITE_LUA) once the record is written. The
# timeline's TTL is set when it starts and with a final record (one call fewer per write of
# the consume path): it lives as long as the records unless a task's life outlasts their TTL.
# ``ix``:
# {event, member}, ARGV of the record's script (``RedisTaskIndex.block``); ``latest``: the
# task's latest pointer, whose hash tag names the timeline (its key is built here, in the
# task's slot, so the record scripts carry no more KEYS than before). With a member (one
# Redis) the index's keys are built here too (undeclared, as _GET_LATEST reads a key: fine on
# one Redis; a cluster sends no member, ``INDEX_SCRIPT`` writes its index). ``current``: the
# status before the write ('' = none: this write created the record). The event's first
# field is the write's time in ms, the entry's score.
INDEX_WRITE_LUA = f"""
local sparse = {{{", ".join(f"[{s.value!r}] = true" for s in sorted(SPARSE_STATUSES))}}}
local final = {{{", ".join(f"[{s.value!r}] = true" for s in sorted(_FINAL))}}}
local function index_write(ix, latest, status, current, ttl_ms)
  local timeline = '{TIMELINE_KEY_PREFIX}:' .. string.sub(latest, {len(LATEST_KEY_PREFIX) + 2})
  local events = redis.call('RPUSH', timeline, ix[1])
  if events > {TIMELINE_MAX_EVENTS} then
    redis.call('LTRIM', timeline, -{TIMELINE_MAX_EVENTS}, -1)
  end
  if events == 1 or final[status] then redis.call('PEXPIRE', timeline, ttl_ms) end
  local member = ix[2]
  if member == '' then return end
  local index = '{TASK_INDEX_KEY}'
  if current == '' then
    local size, rest = string.match(member, '^(%d+):(.*)$')
    local queue = index .. ':q:' .. string.sub(rest, 1, tonumber(size))
    local at = string.match(ix[1], '^%[(%-?%d+)')
    redis.call('ZADD', index, 'NX', at, member)
    redis.call('ZADD', queue, 'NX', at, member)
    redis.call('SADD', '{TASK_INDEX_QUEUES_KEY}', queue)
  end
  if sparse[status] then
    local since = redis.call('ZSCORE', index, member)
    if since then redis.call('ZADD', index .. ':s:' .. status, since, member) end
  end
end

-- The {{event, member}} at ARGV[a], when the caller sent one (an event starts with '[').
local function ix_at(a)
  local event = ARGV[a]
  if event and string.byte(event, 1) == 91 then return {{event, ARGV[a + 1]}} end
  return nil
end
"""

# A refused publish's entry taken back (state.redis._FORGET_QUEUED), on one Redis: ``member``.
INDEX_FORGET_LUA = f"""
local function index_forget(member)
  local size, rest = string.match(member, '^(%d+):(.*)$')
  if not size then return end
  redis.call('ZREM', '{TASK_INDEX_KEY}', member)
  redis.call('ZREM', '{TASK_INDEX_KEY}:q:' .. string.sub(rest, 1, tonumber(size)), member)
end
"""

# The same on a cluster, in the {tasks} slot. KEYS: index, queue's index; ARGV: member.
FORGET_SCRIPT = """
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('ZREM', KEYS[2], ARGV[1])
"""

# The index write of a cluster, in the {tasks} slot. KEYS: index, queue's index, queues,
# sparse status's index (optional). ARGV: member, time ms, '1' for a status that may create
# the record (the entry, unless there is one), else '0'.
INDEX_SCRIPT = """
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1])
  redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[1])
  redis.call('SADD', KEYS[3], KEYS[2])
end
if KEYS[4] then
  local since = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if since then redis.call('ZADD', KEYS[4], since, ARGV[1]) end
end
return 1
"""

# The bounds. KEYS: index, queues, the sparse statuses' indexes. ARGV: max entries, oldest
# time kept (ms), most removed per sorted set. The overall index is cut by age and count;
# every other set is cut to the same oldest time, so a filtered list never shows a task the
# whole one dropped. A queue whose index emptied leaves the queues set. Returns the entries
# removed.
TRIM_SCRIPT = """
local most = tonumber(ARGV[3])
local removed = 0
local function cut(key, below)
  local n = math.min(redis.call('ZCOUNT', key, '-inf', '(' .. below), most)
  if n > 0 then removed = removed + redis.call('ZREMRANGEBYRANK', key, 0, n - 1) end
end
cut(KEYS[1], ARGV[2])
local over = math.min(redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1]), most)
if over > 0 then removed = removed + redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1) end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2] or '+inf'
if oldest ~= '+inf' and tonumber(oldest) < tonumber(ARGV[2]) then oldest = ARGV[2] end
for i = 3, #KEYS do cut(KEYS[i], oldest) end
for _, key in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  cut(key, oldest)
  if redis.call('EXISTS', key) == 0 then redis.call('SREM', KEYS[2], key) end
end
return removed
"""

# Index entries at or below a score, newest first, each as one string "<score> <member>": a
# script only for its reply, which redis-py parses several times faster than ZRANGE's pairs.
# KEYS: the sorted set; ARGV: the score, entries to skip, entries to answer.
ENTRIES_SCRIPT = """
local rows = redis.call('ZRANGE', KEYS[1], ARGV[1], '-inf', 'BYSCORE', 'REV',
                        'LIMIT', ARGV[2], ARGV[3], 'WITHSCORES')
local found = {}
for i = 1, #rows, 2 do found[#found + 1] = rows[i + 1] .. ' ' .. rows[i] end
return found
"""

# The records a page looks at, in one call (one Redis: the keys may be in any slot). KEYS:
# record keys; ARGV: a status, or '' for any. Returns each record's state, or nil where there
# is none or it has another status (such a record cannot match: it is neither sent nor parsed).
READ_SCRIPT = """
local found = {}
for i, key in ipairs(KEYS) do
  local row = redis.call('HMGET', key, 'status', 'state')
  local fits = row[2] and (ARGV[1] == '' or row[1] == ARGV[1])
  if fits then found[i] = row[2] else found[i] = false end
end
return found
"""

_SPARSE_KEYS = [task_index_status_key(s.value) for s in sorted(SPARSE_STATUSES)]


class RedisTaskIndex:
    """A ``RedisTaskStore``'s index and timelines: what its scripts get to write them, the
    cluster's companion writes, the trims, and the reads (``TaskIndex``).

    Args:
        client: The store's client.
        pipe: The store's auto-pipeline.
        cluster: Whether ``client`` is a Redis Cluster client.
        enabled: False: nothing is written and the reads raise ``ConfigurationError``.
        max_entries: The count bound.
        max_age_s: The age bound, in seconds.
    """

    def __init__(
        self,
        client: Any,
        pipe: AutoPipeline,
        *,
        cluster: bool,
        enabled: bool,
        max_entries: int,
        max_age_s: float,
    ) -> None:
        self._redis = client
        self._pipe = pipe
        self._cluster = cluster
        self.enabled = enabled
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._index = Script.of(INDEX_SCRIPT)
        self._trim = Script.of(TRIM_SCRIPT)
        self._read = Script.of(READ_SCRIPT)
        self._entries = Script.of(ENTRIES_SCRIPT)
        self._forget = Script.of(FORGET_SCRIPT)
        # The first index write trims: a short-lived producer never reached TRIM_EVERY, and
        # processes of a few writes each let the index grow past its bounds for good.
        self._writes = TRIM_EVERY - 1
        self._pending: set[asyncio.Future[Any]] = set()

    # -- what a record write carries ----------------------------------------------------
    def block(self, state: TaskState) -> list[str]:
        """The ARGV a record script's ``ix_at`` reads for writing ``state`` (its timeline
        event, and its index member or '' on a cluster); [] when the index is off. On a
        cluster the index write leaves beside the record's script (``INDEX_SCRIPT``)."""
        if not self.enabled:
            return []
        event = timeline_event(state)
        if state.status not in _INDEXED:
            return [event, ""]  # (a succeeded or retrying write only appends its event)
        if self._cluster:
            self._companion(state, event)
            return [event, ""]
        self._count_write()
        return [event, index_member(state.queue, state.task_id)]

    def forget_args(self, queue: str, task_id: str) -> list[str]:
        """The ARGV of ``_FORGET_QUEUED`` for (queue, task id): its member on one Redis."""
        if not self.enabled or self._cluster:
            return []
        return [index_member(queue, task_id)]

    async def forget_beside(self, queue: str, task_id: str) -> None:
        """On a cluster, take back the entry of a record ``_FORGET_QUEUED`` dropped."""
        if self.enabled and self._cluster:
            keys = [TASK_INDEX_KEY, task_index_queue_key(queue)]
            await self._pipe.script(self._forget, keys, [index_member(queue, task_id)])

    def _companion(self, state: TaskState, event: str) -> None:
        keys = [TASK_INDEX_KEY, task_index_queue_key(state.queue), TASK_INDEX_QUEUES_KEY]
        if state.status in SPARSE_STATUSES:
            keys.append(task_index_status_key(state.status.value))
        at = event[1 : event.index(",")]
        first = "1" if state.status in _FIRST_STATUSES else "0"
        member = index_member(state.queue, state.task_id)
        self._background(self._pipe.script(self._index, keys, [member, at, first]))
        self._count_write()

    def _count_write(self) -> None:
        self._writes += 1
        if self._writes >= TRIM_EVERY:
            self._writes = 0
            self._background(self.trim_soon())

    def trim_soon(self) -> asyncio.Future[Any]:
        """Apply the bounds now (with the auto-pipeline's next batch).

        Returns:
            A future answering how many entries went.
        """
        oldest_ms = int((time.time() - self.max_age_s) * 1000)
        keys = [TASK_INDEX_KEY, TASK_INDEX_QUEUES_KEY, *_SPARSE_KEYS]
        return self._pipe.script(self._trim, keys, [self.max_entries, oldest_ms, TRIM_MOST])

    def _background(self, write: asyncio.Future[Any]) -> None:
        # Best effort: a lost index write costs a task its line in the list, never its record.
        self._pending.add(write)
        write.add_done_callback(self._ended)

    async def settled(self) -> None:
        """Wait for the index writes sent so far (a cluster's companions): for a write made
        outside the auto-pipeline, whose answer does not come with theirs."""
        if self._pending:
            await asyncio.wait(set(self._pending))

    def _ended(self, write: asyncio.Future[Any]) -> None:
        self._pending.discard(write)
        if not write.cancelled() and (e := write.exception()) is not None:
            log.warning("could not write the task index (%s: %s)", type(e).__name__, e)

    # -- the reads ----------------------------------------------------------------------
    async def list_tasks(self, query: TaskQuery) -> TaskPage:
        if not self.enabled:
            raise index_off()
        if query.status in SPARSE_STATUSES:
            key = task_index_status_key(query.status.value)
        elif query.queue is not None:
            key = task_index_queue_key(query.queue)
        else:
            key = TASK_INDEX_KEY

        async def entries(score: int, skip: int, count: int) -> list[tuple[str, str, int]]:
            rows = await self._pipe.script(self._entries, [key], [score, skip, count])
            found = []
            for row in rows:
                at, _, member = as_text(row).partition(" ")
                try:
                    queue, task_id = index_entry(member)
                    found.append((queue, task_id, int(at)))
                except ValueError:
                    continue  # not ours: skipped, never fatal
            return found

        status = query.status.value if query.status is not None else ""

        async def records(tasks: list[tuple[str, str]]) -> list[str | bytes | None]:
            keys = [state_key(queue, task_id) for queue, task_id in tasks]
            if self._cluster:  # the keys are in many slots: a read each, auto-pipelined
                return list(await asyncio.gather(*(self._pipe.hget(k, "state") for k in keys)))
            # One call for up to 2,000 records, filtered by status in Redis.
            raws: list[str | bytes | None] = await self._pipe.script(self._read, keys, [status])
            return raws

        return await scan_page(query, entries, records)

    async def timeline(self, task_id: str, queue: str | None) -> list[TimelineEvent]:
        if not self.enabled:
            raise index_off()
        raw: Sequence[Any] = await self._redis.lrange(timeline_key(task_id), 0, -1)
        return read_timeline([as_text(r) for r in raw], queue)


class RedisIndexReads(TaskIndex):
    """The Redis task store's reads of its task index (``RedisTaskStore`` inherits them)."""

    index: RedisTaskIndex  # set by RedisTaskStore.__init__

    async def list_tasks(self, query: TaskQuery) -> TaskPage:
        try:
            return await self.index.list_tasks(query)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def timeline(self, task_id: str, *, queue: str | None = None) -> list[TimelineEvent]:
        try:
            return await self.index.timeline(task_id, queue)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

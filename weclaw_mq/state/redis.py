"""The default ``TaskStore``: a task's records and its idempotency claim in Redis.

Keys come from ``naming`` (guard key, record hash, latest pointer, done channel; all hash-tagged
on the task id). Every step of the hot path is one script: the claim (``CLAIM_SCRIPT``, with the
"running" record) and the finish (``FINISH_SCRIPT``: done marker and result). The scripts of
concurrent tasks share round trips (``pipelining.AutoPipeline``). Leases are renewed by one
task per store (per event loop) for every held claim, together once per period, instead of a
task and a timer per message.

A claim names its worker: each store is one worker, whose heartbeat key (``heartbeat_key``,
TTL ``guard_heartbeat_ttl_s``) the same task renews. A copy that finds a task claimed by a
worker whose heartbeat lapsed (it died) takes the claim over at once, instead of waiting out
the lease. That check is a second step, on the busy path only, not inside the claim script:
on a Redis Cluster the heartbeat key lives in another slot than the task's keys.

``RedisTaskStore`` holds its constructor, the books beside the tasks in its Redis and
``close``; its methods by topic live in the classes it inherits: ``state.redis_guard`` (the
claim, leases, heartbeat, release and finish), ``state.redis_records`` (records, their reads
and ``wait``), ``state.redis_cancel`` (cancellation) and ``state.redis_index`` (the index's
reads).

For results to survive a Redis restart, Redis must persist them (``appendonly yes``); a Redis
that keeps nothing on disk forgets every result (and every done marker) when it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import uuid
from typing import Any

from weclaw_mq.contract.naming import STATE_KEY_PREFIX, STEPS_KEY_PREFIX, heartbeat_key
from weclaw_mq.settings import Settings
from weclaw_mq.state.cost_ledger import CostLedger
from weclaw_mq.state.fair_book import RedisFairBook
from weclaw_mq.state.model_health import ModelHealth
from weclaw_mq.state.pipelining import DEFAULT_MAX_BATCH, AutoPipeline, Script
from weclaw_mq.state.redis_cancel import RedisCancelling, RedisCancels
from weclaw_mq.state.redis_clients import REDIS_FAILURES as REDIS_FAILURES  # (its former home)
from weclaw_mq.state.redis_clients import StateClient, is_cluster
from weclaw_mq.state.redis_clients import (
    open_client as open_client,  # its former home: still importable here
)
from weclaw_mq.state.redis_guard import _OF_WORKER, RedisGuard
from weclaw_mq.state.redis_index import (
    INDEX_FORGET_LUA,
    INDEX_WRITE_LUA,
    RedisIndexReads,
    RedisTaskIndex,
)
from weclaw_mq.state.redis_wakeups import RECHECK_S as _RECHECK_S  # noqa: F401 (tests read it here)
from weclaw_mq.state.redis_wakeups import LoopWakeups
from weclaw_mq.state.redis_workflows import RedisWorkflowStore
from weclaw_mq.state.schedule_book import ScheduleBook
from weclaw_mq.state.steps import RedisStepBook
from weclaw_mq.state.transitions import TRANSITIONS
from weclaw_mq.state.watches import WATCH_SET_LUA, WATCHED_CLAIM_PRELUDE
from weclaw_mq.state.worker_registry import WorkerRegistry
from weclaw_mq.state.workflow_records import HasWorkflows

# (The ``type: ignore[arg-type]`` on scripts called in a pipeline: redis-py's AsyncScript
# annotation omits the cluster pipeline, which it runs like any client.)


def _lua_transitions() -> str:
    """``state.transitions.TRANSITIONS`` as a Lua table literal ('' for no record)."""
    rows = []
    for current, allowed in TRANSITIONS.items():
        key = "" if current is None else current.value
        follow = ", ".join(f"[{s.value!r}] = true" for s in sorted(allowed))
        rows.append(f"  [{key!r}] = {{{follow}}},")
    return "local transitions = {\n" + "\n".join(rows) + "\n}\n"


# The one rule for writing a task's record, shared by every script that writes one: the
# status may follow the stored one (``state.transitions``, the table built from it here), and
# with ``only_over`` (a space-separated list of statuses; '' = only where no record exists)
# the stored one is absent or listed. A written record becomes the task's latest (same TTL
# as the record). A stored status the table does not know refuses every write. ``ix`` (from
# ``ix_at``, nil with the task index off): the write's timeline event and index entry
# (``state.redis_index``), written with the record. The task's steps in the queue
# (``state.steps``; their key is the record's, another prefix, so in its slot) get the
# record's TTL with each write: they expire with it.
RECORD_WRITE_LUA = (
    _lua_transitions()
    + INDEX_WRITE_LUA
    + f"""
local steps_prefix, state_from = '{STEPS_KEY_PREFIX}', {len(STATE_KEY_PREFIX) + 1}
"""
    + """
local function write_record(key, latest, status, state, ttl_ms, only_over, ix)
  local current = redis.call('HGET', key, 'status') or ''
  local allowed = transitions[current]
  if not allowed or not allowed[status] then return 0 end
  if only_over and current ~= ''
     and not string.find(' ' .. only_over .. ' ', ' ' .. current .. ' ', 1, true) then
    return 0
  end
  redis.call('HSET', key, 'status', status, 'state', state)
  redis.call('PEXPIRE', key, ttl_ms)
  redis.call('PEXPIRE', steps_prefix .. string.sub(key, state_from), ttl_ms)
  redis.call('SET', latest, key, 'PX', ttl_ms)
  if ix then index_write(ix, latest, status, current, ttl_ms) end
  return 1
end
"""
)

_CLAIM = """
if redis.call('SISMEMBER', KEYS[2], '*') == 1 or redis.call('SISMEMBER', KEYS[2], ARGV[4]) == 1 then
  return 'cancelled'
end
local current = redis.call('GET', KEYS[1])
if current == ARGV[3] then return 'done' end
local ix = KEYS[3] and ix_at(8)
if current and current ~= ARGV[KEYS[3] and (ix and 10 or 8) or 5] then return current end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if KEYS[3] then write_record(KEYS[3], KEYS[4], ARGV[5], ARGV[6], ARGV[7], false, ix) end
return 'acquired'
"""
CLAIM_SCRIPT = RECORD_WRITE_LUA + _CLAIM
"""The claim: the guard key set if free (lease_ms), and the "running" record in the same step.

KEYS: guard key, cancel marker[, record key, latest key]. ARGV: "running:<owner>@<worker>",
lease_ms, "done", queue[, status, state JSON, record ttl_ms[, timeline event, index member]][,
stale holder]. The event and member are ``RedisTaskIndex.block``'s (``state.redis_index``).
Returns
'cancelled' (the marker covers this queue: ``state.cancel_records``), 'acquired', 'done' (finished
before) or the value of the claim's holder (busy). With a stale holder (a value whose worker's
heartbeat lapsed) a claim still held by exactly that value is taken over.
"""

# A long run's watch copy claims through this: the claim after the watch check
# (``state.watches``), which takes its own key and argument off the ends of KEYS and ARGV.
WATCHED_CLAIM_SCRIPT = RECORD_WRITE_LUA + WATCHED_CLAIM_PRELUDE + _CLAIM

FINISH_SCRIPT = (
    RECORD_WRITE_LUA
    + """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then return 'done' end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local ix = KEYS[2] and ix_at(8)
if KEYS[2] then
  local written = write_record(KEYS[2], KEYS[3], ARGV[3], ARGV[4], ARGV[5], false, ix)
  if written == 1 then redis.call('PUBLISH', ARGV[6], ARGV[7]) end
end
local owner = ARGV[KEYS[2] and (ix and 10 or 8) or 3]
if owner and current and current ~= owner then return 'taken' end
return 'finished'
"""
)
"""The finish: the guard's done marker and the final record, in one step; the first wins.

KEYS: guard key[, record key, latest key]. ARGV: "done", done ttl_ms[, status, state JSON,
record ttl_ms, done channel, queue[, timeline event, index member]][, the holder's value].
Returns 'done' (finished before: nothing written), 'taken' (written, though another attempt
held the claim: its own finish will find it done) or 'finished'. Two separate writes would cost
a second round trip per task and leave a window where a crash stores the result but not the
marker.
"""

# Any record write, and a wake-up for result() waiters when it is final.
# KEYS: record, latest; ARGV: status, state, ttl_ms, only_over ('-' = not narrowed), channel,
# queue[, timeline event, index member].
_RECORD = (
    RECORD_WRITE_LUA
    + """
local only_over = false
if ARGV[4] ~= '-' then only_over = ARGV[4] end
local written = write_record(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], only_over, ix_at(7))
if written == 1 and (ARGV[1] == 'succeeded' or ARGV[1] == 'dead_lettered'
                     or ARGV[1] == 'expired' or ARGV[1] == 'cancelled') then
  redis.call('PUBLISH', ARGV[5], ARGV[6])
end
return written
"""
)

# Records for tasks that have none yet; never wakes waiters (no final state is written).
# KEYS: record, latest, record, latest, ...; ARGV: ttl_ms, ARGV per task (2 or 4), then per
# task status, state[, timeline event, index member].
_RECORD_NEW_MANY = (
    RECORD_WRITE_LUA
    + """
local step = tonumber(ARGV[2])
local a = 3
for i = 1, #KEYS, 2 do
  write_record(KEYS[i], KEYS[i + 1], ARGV[a], ARGV[a + 1], ARGV[1], '', ix_at(a + 2))
  a = a + step
end
return 1
"""
)

# The latest pointer goes too if it named this record: status() then answers "unknown"
# rather than a task the broker never held; and so does its task index entry (ARGV[1], its
# member, on one Redis: state.redis_index.INDEX_FORGET_LUA).
_FORGET_QUEUED = (
    INDEX_FORGET_LUA
    + """
if redis.call('HGET', KEYS[1], 'status') == 'queued' then
  if redis.call('GET', KEYS[2]) == KEYS[1] then redis.call('DEL', KEYS[2]) end
  if ARGV[1] then index_forget(ARGV[1]) end
  return redis.call('DEL', KEYS[1])
end
return 0
"""
)

# The latest record in one round trip. It reads the key the pointer names (not passed in
# KEYS): on one Redis that is fine, and under a cluster the hash tag keeps it on this node.
_GET_LATEST = """
local key = redis.call('GET', KEYS[1])
if not key then return false end
return redis.call('HGET', key, 'state')
"""

# Only the holder may renew or release its lease. A renewal that finds the task done (its
# finish landed first, in the same batch) is not a lost lease.
_EXTEND = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if current == ARGV[3] then return 1 end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A worker's heartbeat (one key per store), and the question whether another's still lives.
_BEAT = "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])"
_ALIVE = "return redis.call('EXISTS', KEYS[1])"

# The first body's fingerprint keeps the key (state.reuse): set if absent, else the kept one.
_KEEP_FINGERPRINT = """
local kept = redis.call('GET', KEYS[1])
if kept then return kept end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""


class RedisTaskStore(RedisGuard, RedisCancelling, RedisIndexReads, HasWorkflows):
    """``TaskStore`` on Redis; its failures surface as ``StateUnavailableError``.

    Its methods do what the protocols it implements say, where their docstrings are written
    (``TaskStore``, ``TaskIndex``, ``FingerprintStore``, ``RecordsSoon``, ``HasWorkflows``).
    Each raises ``StateUnavailableError`` when Redis fails or does not answer, and
    ``StateCommandError`` when Redis answered with an error (not an outage).

    Args:
        client: The redis-py client (one Redis, a Cluster or a Sentinel set).
        ttl_s: How long a record (and a cancel marker) is kept, in seconds.
        lease_s: A claim's lease, in seconds.
        done_ttl_s: How long a task stays done (copies acked unrun), in seconds.
        owns_client: ``close`` closes the client too (``open_store`` passes True).
        max_batch: The most commands one auto-pipeline sends together
            (``state.pipelining``).
        heartbeat_ttl_s: How long this worker's claims outlive it (its heartbeat key's TTL).
        task_index: Keep the task index and timelines (``state.redis_index``).
        task_index_max_entries: The index's count bound.
        task_index_max_age_s: The index's age bound, in seconds; 0: ``ttl_s``.
    """

    def __init__(
        self,
        client: StateClient,
        *,
        ttl_s: float,
        lease_s: float,
        done_ttl_s: float,
        owns_client: bool = False,
        max_batch: int = DEFAULT_MAX_BATCH,
        heartbeat_ttl_s: float = 5.0,
        task_index: bool = True,
        task_index_max_entries: int = 1_000_000,
        task_index_max_age_s: float = 0,
    ) -> None:
        self._redis = client
        self._owns_client = owns_client
        self._fair_book: RedisFairBook | None = None
        self._cluster = is_cluster(client)
        self._ttl_ms = int(ttl_s * 1000)
        self.lease_s = lease_s
        self._lease_ms = int(lease_s * 1000)
        self._done_ttl_ms = int(done_ttl_s * 1000)
        # The hot path's commands (claims, finishes, records, reads) go through one
        # auto-pipeline: those issued in the same loop iteration share a round trip.
        self._pipe = AutoPipeline(client, max_batch=max_batch)
        self.index = RedisTaskIndex(
            client,
            self._pipe,
            cluster=self._cluster,
            enabled=task_index,
            max_entries=task_index_max_entries,
            max_age_s=task_index_max_age_s or ttl_s,
        )
        self._claim = Script.of(CLAIM_SCRIPT)
        self._watched_claim = Script.of(WATCHED_CLAIM_SCRIPT)
        self._watch_set = Script.of(WATCH_SET_LUA)
        self._finish = Script.of(FINISH_SCRIPT)
        self._record = Script.of(_RECORD)
        self._forget_queued = Script.of(_FORGET_QUEUED)
        self._get_latest = Script.of(_GET_LATEST)
        self._release = Script.of(_RELEASE)
        self._extend = Script.of(_EXTEND)
        self._keep_fingerprint = Script.of(_KEEP_FINGERPRINT)
        # One script call for a whole batch of new records (publish_many).
        self._record_new_many = client.register_script(_RECORD_NEW_MANY)
        self._cancels = RedisCancels(
            client,
            ttl_ms=self._ttl_ms,
            record_write_lua=RECORD_WRITE_LUA,
            pipe=self._pipe,
            index=self.index,
        )
        self._workflows: RedisWorkflowStore | None = None  # made when first asked for
        self._steps: RedisStepBook | None = None  # made when first asked for
        self._held: dict[str, str] = {}  # guard key -> its value, while its attempt holds it
        self._renewer: asyncio.Task[None] | None = None
        # This worker: every claim's value names it, and holds while its heartbeat key lives.
        self.worker_id = uuid.uuid4().hex
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._heartbeat_ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self._heartbeat_key = heartbeat_key(self.worker_id)
        self._heartbeat_value = f"{socket.gethostname()} pid {os.getpid()}"
        self._of_worker = _OF_WORKER + self.worker_id
        self._alive_until = -math.inf  # (monotonic) our heartbeat key surely lives until then
        self._beating: asyncio.Future[Any] | None = None  # the beat the claims wait for
        self._beat = Script.of(_BEAT)
        self._alive = Script.of(_ALIVE)
        self._wakeups = LoopWakeups(client)  # this store's one subscription per event loop

    def worker_registry(self) -> WorkerRegistry:
        """The worker registry (``weclaw-mq inspect``) in this store's Redis.

        Returns:
            The registry; its writes (a worker's beats) share the store's auto-pipeline.
        """
        return WorkerRegistry(self._redis, self._pipe)

    def workflow_store(self) -> RedisWorkflowStore:
        # Its steps share the store's auto-pipeline.
        if self._workflows is None:
            self._workflows = RedisWorkflowStore(self._redis, self._pipe)
        return self._workflows

    def step_book(self) -> RedisStepBook:
        """The tasks' memoized steps (``ctx.step``, ``state.steps``) in this store's Redis.

        Returns:
            The book; its reads and writes share the store's auto-pipeline.
        """
        if self._steps is None:
            self._steps = RedisStepBook(self._pipe, ttl_ms=self._ttl_ms)
        return self._steps

    def model_health(self, app: str) -> ModelHealth:
        """Whether each model of app ``app``'s fallback chains is up, in this store's Redis.

        Args:
            app: The app's name.

        Returns:
            The models' health; it calls the client directly (a read and a write per attempt).
        """
        return ModelHealth(self._redis, app)

    def cost_ledger(self, app: str, *, usage_ttl_s: float, days_kept: int) -> CostLedger:
        """The cost ledger of app ``app`` in this store's Redis.

        Args:
            app: The app's name.
            usage_ttl_s: How long a task's calls are kept.
            days_kept: How many days a day's totals are kept.

        Returns:
            The ledger; it calls the client directly (one round trip per reported attempt).
        """
        return CostLedger(self._redis, app, usage_ttl_s=usage_ttl_s, days_kept=days_kept)

    def fair_book(self) -> RedisFairBook:
        """The fair-share book of this store's Redis (``state.fair_book``).

        Returns:
            The book, made once; it calls the client directly (one round trip per publish
            or batch, one per worker and second for the lanes' counts).
        """
        if self._fair_book is None:
            self._fair_book = RedisFairBook(self._redis)
        return self._fair_book

    def schedule_book(self, app: str) -> ScheduleBook:
        """The schedules of app ``app`` in this store's Redis (lease and records).

        Args:
            app: The app's name.

        Returns:
            The book; it calls the client directly (a few calls per tick).
        """
        return ScheduleBook(self._redis, app)

    async def close(self) -> None:
        # The renewer, the wake-up subscription, the auto-pipeline; the client if it is ours.
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer.get_loop() is asyncio.get_running_loop():
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        await self._wakeups.close()
        await self._pipe.close()
        if self._owns_client:
            await self._redis.aclose()


def open_redis_store(settings: Settings) -> RedisTaskStore:
    """The default store for ``settings``, on its own connection pool (closed with it)."""
    return RedisTaskStore(
        open_client(settings),
        ttl_s=settings.result_ttl_s,
        lease_s=settings.guard_lease_s,
        done_ttl_s=settings.done_ttl_s,
        owns_client=True,
        heartbeat_ttl_s=settings.guard_heartbeat_ttl_s,
        task_index=settings.task_index,
        task_index_max_entries=settings.task_index_max_entries,
        task_index_max_age_s=settings.task_index_max_age_s,
    )

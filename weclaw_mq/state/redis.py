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

For results to survive a Redis restart, Redis must persist them (``appendonly yes``); a Redis
that keeps nothing on disk forgets every result (and every done marker) when it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import RedisError

from weclaw_mq.contract.naming import (
    body_key,
    cancel_key,
    done_channel,
    guard_key,
    heartbeat_key,
    latest_key,
    state_key,
)
from weclaw_mq.errors import ResultTimeoutError
from weclaw_mq.settings import Settings
from weclaw_mq.state.cost_ledger import CostLedger
from weclaw_mq.state.expiry import record_ttl_s
from weclaw_mq.state.fair_book import RedisFairBook
from weclaw_mq.state.model_health import ModelHealth
from weclaw_mq.state.outages import state_unavailable
from weclaw_mq.state.pipelining import DEFAULT_MAX_BATCH, AutoPipeline, Script
from weclaw_mq.state.protocol import Cancellation, Claim, Finish, TaskState, TaskStatus
from weclaw_mq.state.redis_cancel import RedisCancels
from weclaw_mq.state.redis_clients import StateClient, is_cluster
from weclaw_mq.state.redis_clients import (
    open_client as open_client,  # its former home: still importable here
)
from weclaw_mq.state.redis_index import INDEX_FORGET_LUA, INDEX_WRITE_LUA, RedisTaskIndex
from weclaw_mq.state.redis_wakeups import RECHECK_S as _RECHECK_S  # (tests read it here)
from weclaw_mq.state.redis_wakeups import Wakeups
from weclaw_mq.state.redis_workflows import RedisWorkflowStore
from weclaw_mq.state.schedule_book import ScheduleBook
from weclaw_mq.state.task_index import TaskPage, TaskQuery, TimelineEvent
from weclaw_mq.state.transitions import TRANSITIONS, narrowing
from weclaw_mq.state.worker_registry import WorkerRegistry

log = logging.getLogger("weclaw_mq.state")

# The guard key's value: "done", or "running:<owner>@<worker id>" while an attempt holds it
# (a value without "@<worker id>", of an older worker, holds until its lease lapses).
DONE = "done"
_RUNNING = "running:"
_OF_WORKER = "@"

# (The ``type: ignore[arg-type]`` on scripts called in a pipeline: redis-py's AsyncScript
# annotation omits the cluster pipeline, which it runs like any client.)

# Redis failing or not answering, as redis-py raises it (its errors, and socket errors that
# escape it): the store turns each into StateUnavailableError (``state.is_state_failure``
# answers the same without importing redis-py).
REDIS_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)


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
# (``state.redis_index``), written with the record.
RECORD_WRITE_LUA = (
    _lua_transitions()
    + INDEX_WRITE_LUA
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
  redis.call('SET', latest, key, 'PX', ttl_ms)
  if ix then index_write(ix, latest, status, current, ttl_ms) end
  return 1
end
"""
)

CLAIM_SCRIPT = (
    RECORD_WRITE_LUA
    + """
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
)
"""The claim: the guard key set if free (lease_ms), and the "running" record in the same step.

KEYS: guard key, cancel marker[, record key, latest key]. ARGV: "running:<owner>@<worker>",
lease_ms, "done", queue[, status, state JSON, record ttl_ms[, timeline event, index member]][,
stale holder]. The event and member are ``RedisTaskIndex.block``'s (``state.redis_index``).
Returns
'cancelled' (the marker covers this queue: ``state.cancel_records``), 'acquired', 'done' (finished
before) or the value of the claim's holder (busy). With a stale holder (a value whose worker's
heartbeat lapsed) a claim still held by exactly that value is taken over.
"""

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


# Every answer the claim script gives, as str and as bytes (decode_responses or not).
_CLAIMS: dict[str | bytes, Claim] = {
    **{c.value: c for c in Claim},
    **{c.value.encode(): c for c in Claim},
}
_FINISHES: dict[str | bytes, Finish] = {
    **{f.value: f for f in Finish},
    **{f.value.encode(): f for f in Finish},
}


def _only_over_arg(only_over: Collection[TaskStatus] | None) -> str:
    """``only_over`` as the record script's argument ('-': not narrowed)."""
    return "-" if only_over is None else " ".join(sorted(s.value for s in only_over))


class RedisTaskStore:
    """``TaskStore`` on Redis; its failures surface as ``StateUnavailableError``.

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
        self._wakeups: Wakeups | None = None

    # -- the guard ----------------------------------------------------------------------
    async def claim(
        self, queue: str, task_id: str, owner: str, *, running: TaskState | None = None
    ) -> Claim:
        """Claim (queue, task id) for ``owner``: ``TaskStore.claim``.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            owner: The attempt's token.
            running: A record to write when the claim is granted.

        Returns:
            The answer, as ``TaskStore.claim`` gives it.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        keys = [guard_key(queue, task_id), cancel_key(task_id)]
        args: list[str | int] = [_RUNNING + owner + self._of_worker, self._lease_ms, DONE, queue]
        if running is not None:
            keys += self._record_keys(running)
            args += [running.status.value, running.model_dump_json(), self._ttl_ms]
            args += self.index.block(running)
        self._renewing()
        try:
            # The claim names our heartbeat: on the first claims (or after the renewer could
            # not beat for a while) it is written just before, in the same batch.
            beat = self._beat_for_claims()
            answer = await self._pipe.script(self._claim, keys, args)
            if beat is not None:
                await beat
            # A dict lookup, not Claim(value): an enum call by value costs several Python
            # calls on every guarded delivery (Python 3.11).
            claim = _CLAIMS.get(answer)
            return claim if claim is not None else await self._claim_from(answer, keys, args)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _claim_from(self, holder: Any, keys: list[str], args: list[str | int]) -> Claim:
        """Busy: take the claim over if its holder's worker is gone (no heartbeat), else
        ``Claim.BUSY``. Only a copy of a task someone holds pays these round trips."""
        text = holder.decode() if isinstance(holder, bytes) else str(holder)
        if not text.startswith(_RUNNING):
            return Claim(text)  # an answer this code does not know: ValueError
        worker = text.rpartition(_OF_WORKER)[2] if _OF_WORKER in text else self.worker_id
        if worker == self.worker_id:  # ours (alive), or of an older worker: its lease rules
            return Claim.BUSY
        if await self._pipe.script(self._alive, [heartbeat_key(worker)], []):
            return Claim.BUSY
        again = _CLAIMS.get(await self._pipe.script(self._claim, keys, [*args, holder]))
        if again is None:  # another copy took it over first
            return Claim.BUSY
        if again is Claim.ACQUIRED:
            log.info("took over the claim on %s from worker %s, which is gone", keys[0], worker)
        return again

    def _beat_for_claims(self) -> asyncio.Future[Any] | None:
        """None while our heartbeat surely lives on; else the beat to send (one, shared by
        the claims issued meanwhile)."""
        if time.monotonic() <= self._alive_until - self.heartbeat_ttl_s / 2:
            return None
        beating = self._beating
        if (
            beating is None
            or beating.done()
            or beating.get_loop() is not asyncio.get_running_loop()
        ):
            beating = self._beating = self._send_beat()
        return beating

    def _send_beat(self) -> asyncio.Future[Any]:
        sent = time.monotonic()
        beat = self._pipe.script(
            self._beat, [self._heartbeat_key], [self._heartbeat_value, self._heartbeat_ttl_ms]
        )
        beat.add_done_callback(functools.partial(self._beaten, sent))
        return beat

    def _beaten(self, sent: float, beat: asyncio.Future[Any]) -> None:
        if not beat.cancelled() and beat.exception() is None:
            self._alive_until = max(self._alive_until, sent + self.heartbeat_ttl_s)

    def _renewing(self) -> None:
        """The renewer runs on this loop: started on first use, and again on a new loop (a
        store reused under another ``asyncio.run``: the old loop's task is dead with it)."""
        loop = asyncio.get_running_loop()
        renewer = self._renewer
        if renewer is None or renewer.get_loop() is not loop or renewer.done():
            self._renewer = loop.create_task(self._renew())

    @contextlib.contextmanager
    def holding(self, queue: str, task_id: str, owner: str) -> Iterator[None]:
        """Keep ``owner``'s claim alive while the body runs: ``TaskStore.holding``.

        The store's renewer extends every held lease in one batch, every third of the lease.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            owner: The claim's holder.

        Returns:
            A context manager around the body.
        """
        key, value = guard_key(queue, task_id), _RUNNING + owner + self._of_worker
        self._held[key] = value
        self._renewing()
        try:
            yield
        finally:
            if self._held.get(key) == value:
                del self._held[key]

    async def _renew(self) -> None:
        """Until the store closes (or its loop ends): our heartbeat every third of its TTL,
        and every held lease every third of the lease, together in one batch."""
        tick_s = min(self.heartbeat_ttl_s, self.lease_s) / 3
        beat_due = leases_due = time.monotonic() + tick_s
        failing = 0
        while True:
            await asyncio.sleep(max(0.0, min(beat_due, leases_due) - time.monotonic()))
            now = time.monotonic()
            beat = now >= beat_due
            held = list(self._held.items()) if now >= leases_due else []
            if beat:
                beat_due = now + self.heartbeat_ttl_s / 3
            if now >= leases_due:
                leases_due = now + self.lease_s / 3
            try:
                # Issued together: one pipeline (or several of at most max_batch), and no
                # SCRIPT EXISTS round trip first, as redis-py's own pipeline of scripts makes.
                renewed = await asyncio.gather(
                    *([self._send_beat()] if beat else []),
                    *(
                        self._pipe.script(self._extend, [k], [v, self._lease_ms, DONE])
                        for k, v in held
                    ),
                )
            except Exception as e:  # a Redis blip must not kill the handlers
                if not failing:  # once per outage, not every tick
                    log.warning(
                        "could not renew this worker's heartbeat and %d lease(s) (%s: %s); "
                        "others take its claims over if this lasts %.3g s",
                        len(held),
                        type(e).__name__,
                        e,
                        max(0.0, self._alive_until - time.monotonic()),
                    )
                failing += 1
                continue
            if failing:
                log.info("renewed the heartbeat and leases again after %d failed tries", failing)
                failing = 0
            for (key, value), ok in zip(held, renewed[len(renewed) - len(held) :], strict=True):
                if not ok and self._held.get(key) == value:
                    log.warning(
                        "lost the lease on %s (it lapsed or was taken); another worker may "
                        "run the task too",
                        key,
                    )

    async def release(self, queue: str, task_id: str, owner: str) -> None:
        """Drop the claim if ``owner`` still holds it: ``TaskStore.release``.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            owner: The claim's holder.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        key, value = guard_key(queue, task_id), _RUNNING + owner + self._of_worker
        if self._held.get(key) == value:
            del self._held[key]  # given up: no renewal may find it gone and cry "lost"
        try:
            await self._pipe.script(self._release, [key], [value])
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def finish(
        self, queue: str, task_id: str, result: TaskState | None, *, owner: str | None = None
    ) -> Finish:
        """Mark (queue, task id) done and write ``result``: ``TaskStore.finish``.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            result: The final record, if any.
            owner: The claim's holder, checked; None marks done whoever holds it.

        Returns:
            The answer, as ``TaskStore.finish`` gives it.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        key = guard_key(queue, task_id)
        keys = [key]
        args: list[str | int] = [DONE, self._done_ttl_ms]
        if result is not None:
            keys += self._record_keys(result)
            args += [
                result.status.value,
                result.model_dump_json(),
                self._ttl_ms,
                done_channel(result.task_id),
                result.queue,
                *self.index.block(result),
            ]
        value = None if owner is None else _RUNNING + owner + self._of_worker
        if value is not None:
            args.append(value)
        try:
            answer = await self._pipe.script(self._finish, keys, args)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        # Held (renewed) until the finish returned: a result write that retries keeps it.
        if value is not None and self._held.get(key) == value:
            del self._held[key]
        finish = _FINISHES.get(answer)
        return finish if finish is not None else Finish(answer)

    # -- the records --------------------------------------------------------------------
    @staticmethod
    def _record_keys(state: TaskState) -> list[str]:
        return [state_key(state.queue, state.task_id), latest_key(state.task_id)]

    def _record_ttl_ms(self, state: TaskState) -> int:
        return int(record_ttl_s(state, self._ttl_ms / 1000, datetime.now(UTC)) * 1000)

    def _record_call(self, state: TaskState, only_over: str) -> tuple[list[str], list[Any]]:
        """The record script's KEYS and ARGV for writing ``state``."""
        return self._record_keys(state), [
            state.status.value,
            state.model_dump_json(),
            self._record_ttl_ms(state),
            only_over,
            done_channel(state.task_id),
            state.queue,
            *self.index.block(state),
        ]

    async def record(
        self,
        state: TaskState,
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> bool:
        """Write ``state`` if its status may follow the stored one: ``TaskStore.record``.

        Args:
            state: The record to write.
            only_if_new: Only where no record exists.
            only_over: Only where none exists or it reads one of those statuses.

        Returns:
            True when written, False when refused.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        over = _only_over_arg(narrowing(only_if_new, only_over))
        keys, args = self._record_call(state, over)
        try:
            return bool(await self._pipe.script(self._record, keys, args))
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    def record_soon(self, state: TaskState, *, only_if_new: bool = False) -> asyncio.Future[Any]:
        """``record`` started now, sent with the auto-pipeline's next batch (``RecordsSoon``).

        Args:
            state: The record to write.
            only_if_new: Only where no record exists.

        Returns:
            A future that answers whether it was written, or fails with redis-py's error
            (unwrapped: the caller only logs it).
        """
        over = _only_over_arg(narrowing(only_if_new, None))
        return self._pipe.script(self._record, *self._record_call(state, over))

    async def record_many(
        self,
        states: Sequence[TaskState],
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> None:
        """``record`` for each of ``states``: ``TaskStore.record_many``.

        Args:
            states: The records to write.
            only_if_new: As in ``record``.
            only_over: As in ``record``.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        if not states:
            return
        try:
            await self._record_many(states, only_if_new, narrowing(only_if_new, only_over))
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _record_many(
        self,
        states: Sequence[TaskState],
        only_if_new: bool,
        only_over: Collection[TaskStatus] | None,
    ) -> None:
        if only_if_new and not any(st.status.terminal for st in states) and not self._cluster:
            # The publish_many case: one script call for the whole batch, not one per task
            # (not on a cluster: the tasks' keys are in different slots).
            keys: list[str] = []
            # One TTL for the batch: the longest any of its records needs.
            args: list[Any] = [max(self._record_ttl_ms(st) for st in states)]
            args.append(4 if self.index.enabled else 2)  # ARGV per task
            for st in states:
                keys += self._record_keys(st)
                args += [st.status.value, st.model_dump_json(), *self.index.block(st)]
            await self._record_new_many(keys=keys, args=args)
            return
        # Queued together in this loop iteration: one pipeline (up to the batch bound).
        over = _only_over_arg(only_over)
        await asyncio.gather(
            *(self._pipe.script(self._record, *self._record_call(st, over)) for st in states)
        )

    async def forget_queued(self, queue: str, task_id: str) -> None:
        """Drop the task's record if it reads ``queued``: ``TaskStore.forget_queued``.

        Args:
            queue: The handler queue.
            task_id: The task's id.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        keys = [state_key(queue, task_id), latest_key(task_id)]
        try:
            forgot = await self._pipe.script(
                self._forget_queued, keys, self.index.forget_args(queue, task_id)
            )
            if forgot:
                await self.index.forget_beside(queue, task_id)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def keep_fingerprint(
        self, queue: str, task_id: str, fingerprint: str, ttl_s: float
    ) -> str:
        """Keep ``fingerprint`` unless one is kept already (``state.reuse.FingerprintStore``).

        Args:
            queue: The handler queue.
            task_id: The task's id.
            fingerprint: The body's fingerprint.
            ttl_s: How long to keep it, in seconds.

        Returns:
            The fingerprint kept now (``fingerprint`` when none was).

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        args = [fingerprint, max(1, int(ttl_s * 1000))]
        try:
            kept = await self._pipe.script(self._keep_fingerprint, [body_key(queue, task_id)], args)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        return kept.decode() if isinstance(kept, bytes) else str(kept)

    async def get(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        """The task's record in ``queue``: ``TaskStore.get``.

        Args:
            task_id: The task's id.
            queue: The queue; without it, the task's latest record.

        Returns:
            The record, or None when none is kept.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        try:
            if queue is None:
                raw = await self._pipe.script(self._get_latest, [latest_key(task_id)], [])
            else:
                raw = await self._pipe.hget(state_key(queue, task_id), "state")
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        return TaskState.model_validate_json(raw) if raw is not None else None

    async def wait(self, task_id: str, timeout_s: float, *, queue: str | None = None) -> TaskState:
        """The record once terminal: ``TaskStore.wait``.

        Args:
            task_id: The task's id.
            timeout_s: How long to wait, in seconds.
            queue: As in ``get``.

        Returns:
            The terminal record.

        Raises:
            ResultTimeoutError: None within ``timeout_s``.
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        try:
            return await self._wait(task_id, timeout_s, queue)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    def wakeups(self) -> Wakeups:
        """This store's one subscription on the running loop (``state.redis_wakeups``).

        Returns:
            The subscription, shared by every waiter; made again on a new loop (the old one
            died with its loop).
        """
        loop = asyncio.get_running_loop()
        wakeups = self._wakeups
        if wakeups is None or wakeups.loop is not loop:
            wakeups = self._wakeups = Wakeups(self._redis)
        return wakeups

    async def _wait(self, task_id: str, timeout_s: float, queue: str | None) -> TaskState:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Watched before the first read, which waits for the subscription: a result stored
        # in between still wakes us. The channel is per task id; a wake-up for another
        # queue's record costs one re-read.
        wakeups = self.wakeups()
        watch = wakeups.watch(done_channel(task_id))
        try:
            while True:
                left = deadline - loop.time()
                # Unsubscribed (not yet, or the connection was lost): re-read on a beat.
                await watch.wait(left if watch.subscribed else min(left, _RECHECK_S))
                state = await self.get(task_id, queue=queue)
                if state is not None and state.status.terminal:
                    return state
                if deadline - loop.time() <= 0:
                    raise ResultTimeoutError(task_id, timeout_s, state)
        finally:
            wakeups.unwatch(watch)

    # -- cancellation (state.cancel_records, state.redis_cancel) ----------------------------------
    async def cancel(self, task_id: str, *, queue: str | None = None) -> Cancellation:
        """Cancel the task unless its record is final: ``TaskStore.cancel``.

        Args:
            task_id: The task's id.
            queue: The queue; without it, the latest record and every queue.

        Returns:
            What happened.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        try:
            return await self._cancels.cancel(task_id, queue)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def is_cancelled(self, queue: str, task_id: str) -> bool:
        """Does a cancel marker cover (queue, task id)? ``TaskStore.is_cancelled``.

        Args:
            queue: The handler queue.
            task_id: The task's id.

        Returns:
            True when a cancel covers it.

        Raises:
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        try:
            return await self._cancels.is_cancelled(queue, task_id)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def watch_cancels(
        self,
        on_cancel: Callable[[str, str | None], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        """Until cancelled, pass on each cancel to ``on_cancel``: ``TaskStore.watch_cancels``.

        A failed subscription is logged (once per outage) and made again, with backoff.

        Args:
            on_cancel: Called as ``on_cancel(task_id, queue or None for all)``.
            on_subscribed: Awaited after each (re)subscription.
        """
        failures = 0

        async def subscribed() -> None:
            nonlocal failures
            if failures:
                log.info("cancel requests heard again after %d failed subscription(s)", failures)
            failures = 0
            await on_subscribed()

        while True:
            try:
                await self._cancels.listen(on_cancel, subscribed)
            except Exception as e:  # Redis failing, or on_subscribed's reads: listen again
                failures += 1
                delay_s = min(0.1 * 2**failures, _RECHECK_S)
                # Once per outage: a retry every 2 s would fill the log with one fact.
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "cancel requests unheard (%s: %s); subscribing again every %.1f s or less",
                    type(e).__name__,
                    e,
                    _RECHECK_S,
                )
                await asyncio.sleep(delay_s)

    # -- the task index (state.task_index, state.redis_index) ------------------------------
    async def list_tasks(self, query: TaskQuery) -> TaskPage:
        """One page of indexed tasks, newest first: ``TaskIndex.list_tasks``.

        Args:
            query: The filters, page size and cursor.

        Returns:
            The page.

        Raises:
            ConfigurationError: The index is off.
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        try:
            return await self.index.list_tasks(query)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def timeline(self, task_id: str, *, queue: str | None = None) -> list[TimelineEvent]:
        """The task's record writes, oldest first: ``TaskIndex.timeline``.

        Args:
            task_id: The task's id.
            queue: Only the events of this queue.

        Returns:
            The events ([] when none are kept).

        Raises:
            ConfigurationError: The index is off.
            StateUnavailableError: Redis fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        try:
            return await self.index.timeline(task_id, queue)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    def worker_registry(self) -> WorkerRegistry:
        """The worker registry (``weclaw-mq inspect``) in this store's Redis.

        Returns:
            The registry; its writes (a worker's beats) share the store's auto-pipeline.
        """
        return WorkerRegistry(self._redis, self._pipe)

    def workflow_store(self) -> RedisWorkflowStore:
        """The workflows (``state.workflow_records``) in this store's Redis.

        Returns:
            The workflow store; its steps share the store's auto-pipeline.
        """
        if self._workflows is None:
            self._workflows = RedisWorkflowStore(self._redis, self._pipe)
        return self._workflows

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
        """Stop renewing leases, close the wake-up subscription and the auto-pipeline.

        The client is closed too when the store owns it (``owns_client``).
        """
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer.get_loop() is asyncio.get_running_loop():
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        wakeups, self._wakeups = self._wakeups, None
        if wakeups is not None and wakeups.loop is asyncio.get_running_loop():
            await wakeups.close()
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

"""Task status and results per (queue, task id): the "202 now, poll later" half of the API.

A ``ResultStore`` is a small protocol; ``RedisResultStore`` is the default. A task has one
record per queue it went through, overwritten as it moves queued -> running -> (retrying ->)*
succeeded | dead_lettered. A succeeded record is final: a late or duplicate writer can never
turn it back. Two pipeline stages that share a task id (``ctx.publish(..., task_id=
ctx.task_id)``) therefore keep two records, and neither can hide the other.

Reading without a queue answers the task's most recently written record (a "latest" pointer
that every record write moves in the same script, so it costs no extra round trip).

For results to survive a Redis restart, Redis must persist them (``appendonly yes``); a Redis
that keeps nothing on disk forgets every result (and every done marker) when it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import redis.asyncio as aioredis
from pydantic import BaseModel, Field
from redis.exceptions import RedisError

from .errors import ResultTimeoutError, StateUnavailableError
from .naming import done_channel, latest_key, state_key


@dataclass(frozen=True)
class DoneMarker:
    """The guard's "done" key for a task, handed to ``RedisResultStore.put_final``."""

    key: str
    value: str
    ttl_ms: int


class TaskStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD_LETTERED = "dead_lettered"

    @property
    def terminal(self) -> bool:
        return self in (TaskStatus.SUCCEEDED, TaskStatus.DEAD_LETTERED)


class TaskState(BaseModel):
    task_id: str
    queue: str
    status: TaskStatus
    attempt: int = 0
    result: Any = None
    error: str | None = None
    reason: str | None = None
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


class ResultStore(Protocol):
    """A task's records, one per (queue, task id). ``put`` writes the record of
    ``state.queue``; reads take the queue, or None for the most recently written record."""

    async def put(self, state: TaskState, *, only_if_new: bool = False) -> bool:
        """Write ``state``; False when refused (final record, or one exists and only_if_new)."""
        ...

    async def put_many(self, states: Sequence[TaskState], *, only_if_new: bool = False) -> None:
        """``put`` for a batch, in as few round trips as the store allows."""
        ...

    async def forget_queued(self, queue: str, task_id: str) -> None:
        """Drop a ``queued`` record whose publish the broker refused: that task never existed."""
        ...

    async def get(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        """The record of ``task_id`` in ``queue``; without a queue, its latest record."""
        ...

    async def wait(self, task_id: str, timeout_s: float, *, queue: str | None = None) -> TaskState:
        """That record once terminal; ``ResultTimeoutError`` after ``timeout_s``."""
        ...

    async def close(self) -> None: ...


# Redis failing or not answering, as redis-py raises it (its errors, and socket errors that
# escape it): the store turns each into StateUnavailableError.
REDIS_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)


def state_unavailable(e: BaseException) -> StateUnavailableError:
    return StateUnavailableError(
        f"Redis did not answer for task states ({type(e).__name__}: {e}); "
        "check WECLAW_MQ_REDIS_URL and that Redis is up"
    )


# The one rule for writing a task's record, shared by every script that writes one (the
# guard's claim embeds it too): a succeeded record is final; only_if_new writes only where
# no record exists. A written record becomes the task's latest (same TTL as the record).
RECORD_WRITE_LUA = """
local function write_record(key, latest, status, state, ttl_ms, only_if_new)
  local current = redis.call('HGET', key, 'status')
  if current == 'succeeded' or (only_if_new and current) then return 0 end
  redis.call('HSET', key, 'status', status, 'state', state)
  redis.call('PEXPIRE', key, ttl_ms)
  redis.call('SET', latest, key, 'PX', ttl_ms)
  return 1
end
"""

# One round trip: (the guard's done marker,) the record, and a wake-up for result() waiters.
# KEYS: record, latest[, done marker]; ARGV: status, state, ttl_ms, only_if_new, channel,
# queue[, done value, done ttl_ms].
_PUT = (
    RECORD_WRITE_LUA
    + """
if KEYS[3] then
  -- the guard's done marker, written in the same step as the result it vouches for
  redis.call('SET', KEYS[3], ARGV[7], 'PX', ARGV[8])
end
local written = write_record(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1')
if written == 1 and (ARGV[1] == 'succeeded' or ARGV[1] == 'dead_lettered') then
  redis.call('PUBLISH', ARGV[5], ARGV[6])
end
return written
"""
)


@dataclass(frozen=True)
class RecordWrite:
    """A record write that another script (the guard's claim) performs in its own step."""

    key: str
    latest: str
    status: str
    state: str
    ttl_ms: int


# Records for tasks that have none yet; never wakes waiters (no final state is written).
# KEYS: record, latest, record, latest, ...; ARGV: ttl_ms, status, state, status, state, ...
_PUT_NEW_MANY = """
for i = 1, #KEYS, 2 do
  local key = KEYS[i]
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'status', ARGV[i + 1], 'state', ARGV[i + 2])
    redis.call('PEXPIRE', key, ARGV[1])
    redis.call('SET', KEYS[i + 1], key, 'PX', ARGV[1])
  end
end
return 1
"""

# The latest pointer goes too if it named this record: status() then answers "unknown"
# rather than a task the broker never held.
_FORGET_QUEUED = """
if redis.call('HGET', KEYS[1], 'status') == 'queued' then
  if redis.call('GET', KEYS[2]) == KEYS[1] then redis.call('DEL', KEYS[2]) end
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# The latest record in one round trip. It reads the key the pointer names (not passed in
# KEYS): on one Redis that is fine, and under a cluster the hash tag keeps it on this node.
_GET_LATEST = """
local key = redis.call('GET', KEYS[1])
if not key then return false end
return redis.call('HGET', key, 'state')
"""

# Waiters re-read the record this often even without a notification, so a notification
# missed across a reconnect costs at most this much delay.
_RECHECK_S = 2.0


class RedisResultStore:
    """Redis failures surface as ``StateUnavailableError``."""

    def __init__(self, client: aioredis.Redis, *, ttl_s: float) -> None:
        self._redis = client
        self._ttl_ms = int(ttl_s * 1000)
        self._put = client.register_script(_PUT)
        self._forget_queued = client.register_script(_FORGET_QUEUED)
        self._put_new_many = client.register_script(_PUT_NEW_MANY)
        self._get_latest = client.register_script(_GET_LATEST)

    @staticmethod
    def _keys(state: TaskState) -> list[str]:
        return [state_key(state.queue, state.task_id), latest_key(state.task_id)]

    def _args(self, state: TaskState, only_if_new: bool) -> list[Any]:
        return [
            state.status.value,
            state.model_dump_json(),
            self._ttl_ms,
            int(only_if_new),
            done_channel(state.task_id),
            state.queue,
        ]

    async def put(self, state: TaskState, *, only_if_new: bool = False) -> bool:
        keys, args = self._keys(state), self._args(state, only_if_new)
        try:
            return bool(await self._put(keys=keys, args=args))
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    def record_write(self, state: TaskState) -> RecordWrite:
        return RecordWrite(
            state_key(state.queue, state.task_id),
            latest_key(state.task_id),
            state.status.value,
            state.model_dump_json(),
            self._ttl_ms,
        )

    async def put_final(self, state: TaskState, done: DoneMarker) -> bool:
        """``put`` a final state and set the guard's done marker, atomically, in one round trip.

        Two separate writes would cost a second round trip per task and leave a window where
        a crash stores the result but not the marker.
        """
        keys = [*self._keys(state), done.key]
        args = [*self._args(state, False), done.value, done.ttl_ms]
        try:
            return bool(await self._put(keys=keys, args=args))
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def put_many(self, states: Sequence[TaskState], *, only_if_new: bool = False) -> None:
        if not states:
            return
        try:
            await self._put_many(states, only_if_new)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _put_many(self, states: Sequence[TaskState], only_if_new: bool) -> None:
        if only_if_new and not any(st.status.terminal for st in states):
            # The publish_many case: one script call for the whole batch, not one per task.
            keys: list[str] = []
            args: list[Any] = [self._ttl_ms]
            for st in states:
                keys += self._keys(st)
                args += [st.status.value, st.model_dump_json()]
            await self._put_new_many(keys=keys, args=args)
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for state in states:
                await self._put(
                    keys=self._keys(state), args=self._args(state, only_if_new), client=pipe
                )
            await pipe.execute()

    async def forget_queued(self, queue: str, task_id: str) -> None:
        try:
            await self._forget_queued(keys=[state_key(queue, task_id), latest_key(task_id)])
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def get(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        try:
            if queue is None:
                raw = await self._get_latest(keys=[latest_key(task_id)])
            else:
                raw = await self._redis.hget(state_key(queue, task_id), "state")
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        return TaskState.model_validate_json(raw) if raw is not None else None

    async def wait(self, task_id: str, timeout_s: float, *, queue: str | None = None) -> TaskState:
        try:
            return await self._wait(task_id, timeout_s, queue)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _wait(self, task_id: str, timeout_s: float, queue: str | None) -> TaskState:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pubsub = self._redis.pubsub()
        # Subscribe before the first read: a result stored in between still wakes us. The
        # channel is per task id; a wake-up for another queue's record costs one re-read.
        try:
            await pubsub.subscribe(done_channel(task_id))
            while True:
                state = await self.get(task_id, queue=queue)
                if state is not None and state.status.terminal:
                    return state
                left = deadline - loop.time()
                if left <= 0:
                    raise ResultTimeoutError(task_id, timeout_s, state)
                await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=min(left, _RECHECK_S)
                )
        finally:
            with contextlib.suppress(Exception):
                await pubsub.unsubscribe()
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        # The client is shared with the guard and owned by the App.
        return None

"""Task status and results by task id: the "202 now, poll later" half of the API.

A ``ResultStore`` is a small protocol; ``RedisResultStore`` is the default. Each task has one
record, overwritten as it moves queued -> running -> (retrying ->)* succeeded | dead_lettered.
A succeeded record is final: a late or duplicate writer can never turn it back.

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

from .errors import ResultTimeoutError
from .naming import result_channel, result_key


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
    async def put(self, state: TaskState, *, only_if_new: bool = False) -> bool:
        """Write ``state``; False when refused (final record, or one exists and only_if_new)."""
        ...

    async def put_many(self, states: Sequence[TaskState], *, only_if_new: bool = False) -> None:
        """``put`` for a batch, in as few round trips as the store allows."""
        ...

    async def forget_queued(self, task_id: str) -> None:
        """Drop a ``queued`` record whose publish the broker refused: that task never existed."""
        ...

    async def get(self, task_id: str) -> TaskState | None: ...

    async def wait(self, task_id: str, timeout_s: float) -> TaskState:
        """The task's state once terminal; ``ResultTimeoutError`` after ``timeout_s``."""
        ...

    async def close(self) -> None: ...


# The one rule for writing a task's record, shared by every script that writes one (the
# guard's claim embeds it too): a succeeded record is final; only_if_new writes only where
# no record exists.
RECORD_WRITE_LUA = """
local function write_record(key, status, state, ttl_ms, only_if_new)
  local current = redis.call('HGET', key, 'status')
  if current == 'succeeded' or (only_if_new and current) then return 0 end
  redis.call('HSET', key, 'status', status, 'state', state)
  redis.call('PEXPIRE', key, ttl_ms)
  return 1
end
"""

# One round trip: (the guard's done marker,) the record, and a wake-up for result() waiters.
_PUT = (
    RECORD_WRITE_LUA
    + """
if KEYS[3] then
  -- the guard's done marker, written in the same step as the result it vouches for
  redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[6])
end
local written = write_record(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1')
if written == 1 and (ARGV[1] == 'succeeded' or ARGV[1] == 'dead_lettered') then
  redis.call('PUBLISH', KEYS[2], ARGV[1])
end
return written
"""
)


@dataclass(frozen=True)
class RecordWrite:
    """A record write that another script (the guard's claim) performs in its own step."""

    key: str
    status: str
    state: str
    ttl_ms: int


# Records for tasks that have none yet; never wakes waiters (no final state is written).
_PUT_NEW_MANY = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'status', ARGV[2 * i], 'state', ARGV[2 * i + 1])
    redis.call('PEXPIRE', key, ARGV[1])
  end
end
return 1
"""

_FORGET_QUEUED = """
if redis.call('HGET', KEYS[1], 'status') == 'queued' then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Waiters re-read the record this often even without a notification, so a notification
# missed across a reconnect costs at most this much delay.
_RECHECK_S = 2.0


class RedisResultStore:
    def __init__(self, client: aioredis.Redis, *, ttl_s: float) -> None:
        self._redis = client
        self._ttl_ms = int(ttl_s * 1000)
        self._put = client.register_script(_PUT)
        self._forget_queued = client.register_script(_FORGET_QUEUED)
        self._put_new_many = client.register_script(_PUT_NEW_MANY)

    @staticmethod
    def _keys(state: TaskState) -> list[str]:
        return [result_key(state.task_id), result_channel(state.task_id)]

    def _args(self, state: TaskState, only_if_new: bool) -> list[Any]:
        return [state.status.value, state.model_dump_json(), self._ttl_ms, int(only_if_new)]

    async def put(self, state: TaskState, *, only_if_new: bool = False) -> bool:
        return bool(await self._put(keys=self._keys(state), args=self._args(state, only_if_new)))

    def record_write(self, state: TaskState) -> RecordWrite:
        return RecordWrite(
            result_key(state.task_id), state.status.value, state.model_dump_json(), self._ttl_ms
        )

    async def put_final(self, state: TaskState, done: DoneMarker) -> bool:
        """``put`` a final state and set the guard's done marker, atomically, in one round trip.

        Two separate writes would cost a second round trip per task and leave a window where
        a crash stores the result but not the marker.
        """
        return bool(
            await self._put(
                keys=[*self._keys(state), done.key],
                args=[*self._args(state, False), done.value, done.ttl_ms],
            )
        )

    async def put_many(self, states: Sequence[TaskState], *, only_if_new: bool = False) -> None:
        if not states:
            return
        if only_if_new and not any(st.status.terminal for st in states):
            # The publish_many case: one script call for the whole batch, not one per task.
            args: list[Any] = [self._ttl_ms]
            for st in states:
                args += [st.status.value, st.model_dump_json()]
            await self._put_new_many(keys=[result_key(st.task_id) for st in states], args=args)
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for state in states:
                await self._put(
                    keys=self._keys(state), args=self._args(state, only_if_new), client=pipe
                )
            await pipe.execute()

    async def forget_queued(self, task_id: str) -> None:
        await self._forget_queued(keys=[result_key(task_id)])

    async def get(self, task_id: str) -> TaskState | None:
        raw = await self._redis.hget(result_key(task_id), "state")
        return TaskState.model_validate_json(raw) if raw is not None else None

    async def wait(self, task_id: str, timeout_s: float) -> TaskState:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pubsub = self._redis.pubsub()
        # Subscribe before the first read: a result stored in between still wakes us.
        await pubsub.subscribe(result_channel(task_id))
        try:
            while True:
                state = await self.get(task_id)
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

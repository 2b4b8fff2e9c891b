"""Where schedules keep their state in Redis: the scheduler lease and each schedule's record.

The lease names the one scheduler replica that fires an app's ticks (``lead``: take it when
free, renew it when held; ``resign`` at a graceful stop, so another takes over at once). Each
schedule's record (a hash) holds the last tick handled, fired or skipped (epoch ms), the task
id of the last tick fired, how many were fired and skipped, and whether it is paused. A tick
is marked in the same script that checks the lease (``mark``): a replica that lost its lease
marks nothing, and a tick already marked is never marked again. Keys share the hash tag
``{schedules}`` (``contract.naming``), so all of it works on a Redis Cluster; Redis's own
clock stamps the records.

redis-py is not imported here: an app without schedules never loads it (``book_of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weclaw_mq.contract.naming import schedule_key, scheduler_lease_key
from weclaw_mq.state.outages import answered, redis_store

if TYPE_CHECKING:
    from collections.abc import Sequence

    from weclaw_mq.state.redis_clients import StateClient

# KEYS: the lease; ARGV: owner token, lease (ms). 1 when held by this owner afterwards.
_LEAD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
  return 1
end
return 0
"""
# KEYS: the lease; ARGV: owner token.
_RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# KEYS: the lease, the schedule's record; ARGV: owner, tick (ms), task id ('' when the tick
# was skipped, not fired), ticks skipped. 1 when marked; 0 when the lease is another's or the
# tick was marked before (by this or an earlier leader).
_MARK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local last = tonumber(redis.call('HGET', KEYS[2], 'last_tick') or '-1')
local tick = tonumber(ARGV[2])
if tick <= last then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[2], 'last_tick', ARGV[2], 'marked_at', string.format('%d', now))
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], 'last_task_id', ARGV[3], 'last_fired_tick', ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'fired', 1)
end
redis.call('HINCRBY', KEYS[2], 'skipped', tonumber(ARGV[4]))
return 1
"""


@dataclass(frozen=True)
class ScheduleRecord:
    """What Redis holds of one schedule (all None/0 before a scheduler first saw it)."""

    last_tick_ms: int | None = None  # the last tick handled, fired or skipped
    last_fired_tick_ms: int | None = None
    last_task_id: str | None = None
    fired: int = 0
    skipped: int = 0
    paused: bool = False


class ScheduleBook:
    """The schedules of one app in one Redis (or Cluster).

    Args:
        client: The redis-py client.
        app: The app's name: its lease and records are its own.
    """

    def __init__(self, client: StateClient, app: str) -> None:
        self._client = client
        self.app = app
        self._lease = scheduler_lease_key(app)
        self._lead = client.register_script(_LEAD)
        self._resign = client.register_script(_RESIGN)
        self._mark = client.register_script(_MARK)

    async def lead(self, owner: str, lease_s: float) -> bool:
        """Take the lease for ``owner`` if it is free, renew it if ``owner`` holds it.

        Returns:
            Whether ``owner`` holds it now, for ``lease_s``.
        """
        held = await answered(
            self._lead(keys=[self._lease], args=[owner, max(1, int(lease_s * 1000))])
        )
        return bool(held)

    async def resign(self, owner: str) -> None:
        """Give the lease up if ``owner`` holds it (a graceful stop: another takes over now)."""
        await answered(self._resign(keys=[self._lease], args=[owner]))

    async def leader(self) -> str | None:
        """The token of the replica that holds the lease, or None."""
        value = await answered(self._client.get(self._lease))
        return None if value is None else _text(value)

    async def mark(self, owner: str, name: str, tick_ms: int, task_id: str, skipped: int) -> bool:
        """Record ``tick_ms`` as handled (fired as ``task_id``, or skipped when it is ''),
        with ``skipped`` ticks passed over, if ``owner`` holds the lease and the tick is newer
        than the one recorded.

        Returns:
            Whether it was recorded.
        """
        keys = [self._lease, schedule_key(self.app, name)]
        marked = await answered(self._mark(keys=keys, args=[owner, tick_ms, task_id, skipped]))
        return bool(marked)

    async def pause(self, name: str, paused: bool) -> None:
        """Pause (``True``) or resume the schedule: a paused schedule's ticks are skipped."""
        await answered(self._client.hset(schedule_key(self.app, name), "paused", int(paused)))

    async def read(self, names: Sequence[str]) -> dict[str, ScheduleRecord]:
        """The records of ``names``, by name."""
        if not names:
            return {}
        # One slot ({schedules}): one pipeline, one node, whatever the deployment.
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(schedule_key(self.app, name))
        raw = await answered(pipe.execute())
        return {name: _record(fields) for name, fields in zip(names, raw, strict=True)}


def _record(fields: dict[Any, Any]) -> ScheduleRecord:
    values = {_text(k): _text(v) for k, v in fields.items()}

    def number(key: str) -> int | None:
        text = values.get(key)
        return int(text) if text is not None else None

    return ScheduleRecord(
        last_tick_ms=number("last_tick"),
        last_fired_tick_ms=number("last_fired_tick"),
        last_task_id=values.get("last_task_id"),
        fired=number("fired") or 0,
        skipped=number("skipped") or 0,
        paused=values.get("paused") == "1",
    )


def book_of(store: object, app: str) -> ScheduleBook:
    """The schedule book in ``store``'s Redis.

    Raises:
        ConfigurationError: ``store`` is not the Redis task store (schedules need Redis:
            its lease is what lets only one replica fire a tick).
    """
    found = redis_store(store, "schedules keep their lease (one replica fires each tick)")
    book: ScheduleBook = found.schedule_book(app)
    return book


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

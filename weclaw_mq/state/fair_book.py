"""Which fair-share lane each tenant's tasks go to, for every producer of a handler at once
(``policy.fair_share`` says why; ``publishing.fair_lanes`` and ``worker.fair_counts`` use it).

Per handler queue, in its own slot (``contract.naming.fair_key``), three facts per lane, each
written by one side only, so that no write can undo another's:

- the broker's count, written by the workers: ``r`` the ready tasks a worker counted, and
  ``c`` how many tasks had landed (``l``) when it read ``l``, before asking the broker. A
  write whose ``c`` is older than the one kept is ignored (a slow worker's stale read).
- ``l``, the tasks producers saw land (confirmed) there, only ever added to.
- the batches on their way (``flying``): assigned, not yet confirmed, each with a deadline.

A lane's load is ``r + (l - c) + flying``: what the broker held at the count, what landed
since, what is on its way. A task waiting on the broker is always in one of the three (it
landed before the count's read of ``l``, so the broker count has it, or after, so ``l - c``
has it, or its confirm is not yet written, so it flies): the load never shows a lane emptier
than it is. Tasks taken since the count are still in ``r`` until the next one (a second).

A tenant's hash names its lane, its batch on its way (``m``) and its latest task's place
there (``p``: the lane's ``l`` when that task's landing was written, plus every task still on
its way there, which may have landed first). Its tasks still wait while its batch flies, or
while fewer than ``p`` tasks of the lane have gone (``c - r`` at the latest count) and the
lane's load is not 0. A tenant keeps its lane while its tasks wait (they stay in order), else
takes the least loaded lane: its old lane full of another tenant's backlog does not hold it.
redis-py is not imported here: an app without fair share never loads it.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from weclaw_mq.contract.naming import fair_flying_key, fair_key, fair_tenant_key
from weclaw_mq.policy.fair_share import least_loaded
from weclaw_mq.state.outages import answered

if TYPE_CHECKING:
    from weclaw_mq.state.redis_clients import StateClient

# A tenant keeps its lane this long after its latest publish while its tasks wait: a day, so
# a backlog that waits long keeps its one lane (the keys are a few bytes).
TENANT_KEEP_MS = 86_400_000
# A batch assigned counts as on its way this long at most: past a publish's confirm wait (10 s
# by default) and the producer's write of its landing; a producer that died meanwhile leaves
# a lane looking busier for this long, not for a day.
FLYING_MS = 60_000

# Each lane's load (``LOAD``), tasks gone (``GONE``) and tasks on their way (``FLYING``) from
# KEYS[1] (the counts) and KEYS[2] (the flying batches), for lanes 0 .. LANES - 1, after
# dropping the batches past their deadline.
_LOADS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local LOAD, GONE, FLYING, LANDED = {}, {}, {}, {}
for j = 0, LANES - 1 do
  local f = redis.call('HMGET', KEYS[1], 'r:' .. j, 'c:' .. j, 'l:' .. j)
  local r, c, l = tonumber(f[1] or '0'), tonumber(f[2] or '0'), tonumber(f[3] or '0')
  LOAD[j], GONE[j], FLYING[j], LANDED[j] = r + l - c, c - r, 0, l
end
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local lane, n = string.match(m, '^(%d+):(%d+):')
  lane = tonumber(lane)
  if LOAD[lane] ~= nil then
    LOAD[lane] = LOAD[lane] + tonumber(n)
    FLYING[lane] = FLYING[lane] + tonumber(n)
  end
end
"""
# KEYS: the counts, the flying batches, then one key per tenant. ARGV: lanes, the keys' TTL
# (ms), how long a batch flies (ms), this batch's id, then each tenant's task count, in KEYS'
# order. Each tenant's {lane, its flying batch}.
_ASSIGN = (
    "local LANES = tonumber(ARGV[1])\n"
    + _LOADS
    + """
local ttl, flying, batch = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local out = {}
for i = 3, #KEYS do
  local n = tonumber(ARGV[i + 2])
  local f = redis.call('HMGET', KEYS[i], 'lane', 'f', 'fu', 'p')
  local lane = tonumber(f[1] or '-1')
  -- Its batches on their way: none once the latest one's deadline passed.
  local on_way = math.max(0, tonumber(f[2] or '0'))
  if tonumber(f[3] or '0') <= now then on_way = 0 end
  local waits = false
  if lane >= 0 and lane < LANES and LOAD[lane] > 0 then
    waits = on_way > 0 or (f[4] and GONE[lane] < tonumber(f[4]))
  end
  if not waits then
    lane = 0
    for j = 1, LANES - 1 do
      if LOAD[j] < LOAD[lane] then lane = j end
    end
    redis.call('HDEL', KEYS[i], 'p')
  end
  local member = lane .. ':' .. n .. ':' .. batch .. ':' .. (i - 3)
  redis.call('ZADD', KEYS[2], now + flying, member)
  redis.call('HSET', KEYS[i], 'lane', lane, 'f', on_way + 1, 'fu', now + flying)
  redis.call('PEXPIRE', KEYS[i], ttl)
  LOAD[lane] = LOAD[lane] + n
  out[#out + 1] = {lane, member}
end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return out
"""
)
# KEYS: the counts, the flying batches, then one key per landing's tenant. ARGV: lanes, the
# keys' TTL (ms), then per landing: its lane, the tasks that landed, its batch ('' for none).
_SETTLED = (
    "local LANES = tonumber(ARGV[1])\n"
    + """
local ttl = tonumber(ARGV[2])
for i = 3, #KEYS do
  local member = ARGV[(i - 3) * 3 + 5]
  if member ~= '' and redis.call('ZREM', KEYS[2], member) == 1 then
    redis.call('HINCRBY', KEYS[i], 'f', -1)
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
end
for i = 3, #KEYS do
  local n = tonumber(ARGV[(i - 3) * 3 + 4])
  if n > 0 then redis.call('HINCRBY', KEYS[1], 'l:' .. ARGV[(i - 3) * 3 + 3], n) end
end
"""
    + _LOADS
    + """
for i = 3, #KEYS do
  local lane, n = ARGV[(i - 3) * 3 + 3], tonumber(ARGV[(i - 3) * 3 + 4])
  local j = tonumber(lane)
  if n > 0 and j < LANES and redis.call('HGET', KEYS[i], 'lane') == lane then
    -- Behind every task landed there, and every one still on its way: it may land first.
    local place = LANDED[j] + FLYING[j]
    if place > tonumber(redis.call('HGET', KEYS[i], 'p') or '0') then
      redis.call('HSET', KEYS[i], 'p', place)
    end
    redis.call('PEXPIRE', KEYS[i], ttl)
  end
end
redis.call('PEXPIRE', KEYS[1], ttl)
return 0
"""
)
# KEYS: the counts. ARGV: the hash's TTL (ms), then per lane, lane 0 first: its ready tasks,
# the landed tasks (``l``) read before them.
_COUNTED = """
for j = 0, (#ARGV - 1) / 2 - 1 do
  local covered = tonumber(ARGV[3 + 2 * j])
  if covered >= tonumber(redis.call('HGET', KEYS[1], 'c:' .. j) or '-1') then
    redis.call('HSET', KEYS[1], 'r:' .. j, ARGV[2 + 2 * j], 'c:' .. j, covered)
  end
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
"""
# KEYS: the counts, the flying batches. ARGV: lanes. Each lane's load.
_LOADED = (
    "local LANES = tonumber(ARGV[1])\n"
    + _LOADS
    + """
local out = {}
for j = 0, LANES - 1 do out[#out + 1] = LOAD[j] end
return out
"""
)


@dataclass(frozen=True)
class Landing:
    """Tasks of one tenant a producer published to one lane, told to the book after the
    broker's answer: ``tasks`` confirmed (0 when all were refused), ``batch`` the flying batch
    the book gave them ('' for tasks sent to a lane the producer already knew)."""

    tenant: str
    lane: int
    tasks: int
    batch: str = ""


class FairBook(Protocol):
    """Where a handler's tenants are queued (``RedisFairBook``, ``MemoryFairBook``)."""

    async def assign(
        self, queue: str, lanes: int, tenants: Sequence[str], ttl_ms: int
    ) -> list[tuple[int, str]]:
        """The (lane, flying batch) of each of ``tenants`` (one per task about to be
        published, in order), counted as on its way there until ``settled`` or ``FLYING_MS``
        passed; ``ttl_ms``: how long the keys live."""
        ...

    async def settled(
        self, queue: str, lanes: int, landings: Sequence[Landing], ttl_ms: int
    ) -> None:
        """The broker answered for ``landings``: their batches no longer fly, and the tasks
        confirmed are added to their lanes' ``l``."""
        ...

    async def landed(self, queue: str, lanes: int) -> list[int]:
        """Each lane's ``l`` now (a worker reads it before it asks the broker)."""
        ...

    async def counted(
        self, queue: str, waiting: Sequence[int], covered: Sequence[int], ttl_ms: int
    ) -> None:
        """The ready tasks of each lane (lane 0 first) as the broker counted them, after
        ``landed`` gave ``covered``: ignored for a lane whose kept count covers more."""
        ...

    async def loads(self, queue: str, lanes: int) -> list[int]:
        """The tasks each lane holds as far as the book knows (never fewer than it holds)."""
        ...


def new_batch() -> str:
    """An id for one assignment's flying batches (unique across producers)."""
    return uuid.uuid4().hex[:16]


class RedisFairBook:
    """The fair book in one Redis (or Cluster: each handler queue's keys share a slot).

    Args:
        client: The redis-py client.
    """

    def __init__(self, client: StateClient) -> None:
        self._client = client
        self._assign = client.register_script(_ASSIGN)
        self._settled = client.register_script(_SETTLED)
        self._counted = client.register_script(_COUNTED)
        self._loaded = client.register_script(_LOADED)

    async def assign(
        self, queue: str, lanes: int, tenants: Sequence[str], ttl_ms: int
    ) -> list[tuple[int, str]]:
        counts = Counter(tenants)
        keys = [
            fair_key(queue),
            fair_flying_key(queue),
            *(fair_tenant_key(queue, t) for t in counts),
        ]
        args: list[int | str] = [lanes, max(1, ttl_ms), FLYING_MS, new_batch(), *counts.values()]
        raw = await answered(self._assign(keys=keys, args=args))
        placed = {
            tenant: (int(lane), _text(member))
            for tenant, (lane, member) in zip(counts, raw, strict=True)
        }
        return [placed[t] for t in tenants]

    async def settled(
        self, queue: str, lanes: int, landings: Sequence[Landing], ttl_ms: int
    ) -> None:
        if not landings:
            return
        keys = [fair_key(queue), fair_flying_key(queue)]
        args: list[int | str] = [lanes, max(1, ttl_ms)]
        for landing in landings:
            keys.append(fair_tenant_key(queue, landing.tenant))
            args += [landing.lane, landing.tasks, landing.batch]
        await answered(self._settled(keys=keys, args=args))

    async def landed(self, queue: str, lanes: int) -> list[int]:
        fields = [f"l:{i}" for i in range(lanes)]
        raw = await answered(self._client.hmget(fair_key(queue), fields))
        return [int(v or 0) for v in raw]

    async def counted(
        self, queue: str, waiting: Sequence[int], covered: Sequence[int], ttl_ms: int
    ) -> None:
        args = [max(1, ttl_ms)]
        for ready, landed in zip(waiting, covered, strict=True):
            args += [ready, landed]
        await answered(self._counted(keys=[fair_key(queue)], args=args))

    async def loads(self, queue: str, lanes: int) -> list[int]:
        keys = [fair_key(queue), fair_flying_key(queue)]
        return [int(n) for n in await answered(self._loaded(keys=keys, args=[lanes]))]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class _Lane:
    ready: int = 0  # r: the ready tasks of the latest count kept
    covered: int = 0  # c: the landed tasks that count covers
    landed: int = 0  # l: every task a producer saw land here


@dataclass
class _Tenant:
    lane: int
    on_way: int = 0  # f: its batches on their way...
    until: float = 0.0  # fu: ...until the latest one's deadline
    place: int | None = None  # p


class MemoryFairBook:
    """The fair book in one process, with the Redis scripts' rules (for ``TestBroker``, the
    memory task store and the model test; keys do not expire, flying batches do).

    Args:
        clock_ms: The time in milliseconds (flying batches' deadlines).
    """

    def __init__(self, clock_ms: Callable[[], float] | None = None) -> None:
        self._clock_ms = clock_ms or (lambda: time.monotonic() * 1000)
        self._lanes: dict[str, dict[int, _Lane]] = {}
        self._flying: dict[str, dict[str, tuple[int, int, float]]] = {}  # batch: lane, n, until
        self._tenants: dict[tuple[str, str], _Tenant] = {}

    def _loads(self, queue: str, lanes: int) -> tuple[list[int], list[int], list[int]]:
        """Each lane's load, tasks gone and tasks on their way (``_LOADS``)."""
        now = self._clock_ms()
        flying = self._flying.setdefault(queue, {})
        for member in [m for m, (_, _, until) in flying.items() if until <= now]:
            del flying[member]
        counts = self._lanes.setdefault(queue, {})
        on_way = [0] * lanes
        for lane_index, n, _ in flying.values():
            if lane_index < lanes:
                on_way[lane_index] += n
        loads, gone = [], []
        for j in range(lanes):
            lane = counts.get(j, _Lane())
            loads.append(lane.ready + lane.landed - lane.covered + on_way[j])
            gone.append(lane.covered - lane.ready)
        return loads, gone, on_way

    async def assign(
        self, queue: str, lanes: int, tenants: Sequence[str], ttl_ms: int
    ) -> list[tuple[int, str]]:
        loads, gone, _ = self._loads(queue, lanes)
        flying = self._flying[queue]
        now = self._clock_ms()
        batch = new_batch()
        placed: dict[str, tuple[int, str]] = {}
        for i, (tenant, n) in enumerate(Counter(tenants).items()):
            state = self._tenants.get((queue, tenant))
            waits = False
            if state is not None:
                if state.until <= now:
                    state.on_way = 0
                state.on_way = max(0, state.on_way)
                if 0 <= state.lane < lanes and loads[state.lane] > 0:
                    waits = state.on_way > 0 or (
                        state.place is not None and gone[state.lane] < state.place
                    )
            if state is None or not waits:
                state = self._tenants[(queue, tenant)] = _Tenant(least_loaded(loads))
            member = f"{state.lane}:{n}:{batch}:{i}"
            flying[member] = (state.lane, n, now + FLYING_MS)
            state.on_way += 1
            state.until = now + FLYING_MS
            loads[state.lane] += n
            placed[tenant] = (state.lane, member)
        return [placed[t] for t in tenants]

    async def settled(
        self, queue: str, lanes: int, landings: Sequence[Landing], ttl_ms: int
    ) -> None:
        flying = self._flying.setdefault(queue, {})
        counts = self._lanes.setdefault(queue, {})
        for landing in landings:
            state = self._tenants.get((queue, landing.tenant))
            if flying.pop(landing.batch, None) is not None and state is not None:
                state.on_way -= 1
        for landing in landings:
            if landing.tasks > 0:
                counts.setdefault(landing.lane, _Lane()).landed += landing.tasks
        _, _, on_way = self._loads(queue, lanes)
        for landing in landings:
            state = self._tenants.get((queue, landing.tenant))
            if landing.tasks <= 0 or state is None or state.lane != landing.lane:
                continue
            if landing.lane >= lanes:
                continue
            place = counts[landing.lane].landed + on_way[landing.lane]
            if state.place is None or place > state.place:
                state.place = place

    async def landed(self, queue: str, lanes: int) -> list[int]:
        counts = self._lanes.setdefault(queue, {})
        return [counts.get(j, _Lane()).landed for j in range(lanes)]

    async def counted(
        self, queue: str, waiting: Sequence[int], covered: Sequence[int], ttl_ms: int
    ) -> None:
        counts = self._lanes.setdefault(queue, {})
        for j, (ready, landed) in enumerate(zip(waiting, covered, strict=True)):
            lane = counts.setdefault(j, _Lane())
            if landed >= lane.covered:
                lane.ready, lane.covered = ready, landed

    async def loads(self, queue: str, lanes: int) -> list[int]:
        return self._loads(queue, lanes)[0]


def fair_book_of(store: object) -> FairBook | None:
    """The fair book beside ``store`` (its ``fair_book()``: in its Redis for the Redis task
    store, in its process for the memory one); None without a store (a producer then hashes
    tenants to lanes)."""
    book = getattr(store, "fair_book", None)
    return book() if callable(book) else None

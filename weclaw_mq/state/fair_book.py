"""Which fair-share lane each tenant's tasks go to, for every producer of a handler at once
(``policy.fair_share`` says why; ``publishing.fair_lanes`` and ``worker.fair_counts`` use it).

Per handler queue, in its own slot (``contract.naming.fair_key``): a hash of how many tasks
wait in each lane (``n:<i>``), and a key per tenant naming its lane. A producer's ``assign``
(one script for a whole batch) keeps a tenant on its lane while that lane has tasks waiting
(its tasks stay in order), else gives it the least loaded lane, and adds its tasks to that
lane's count. The counts are then set to the broker's truth by every worker consuming the
handler, once per ``FAIR_COUNT_EVERY_S`` (``counted``: each lane's ready messages), so
nothing is written per task on the consume path and no count drifts for longer than that.
A tenant's key lives ``TENANT_KEEP_MS`` past its latest publish.

redis-py is not imported here: an app without fair share never loads it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from weclaw_mq.contract.naming import fair_key, fair_tenant_key
from weclaw_mq.policy.fair_share import least_loaded
from weclaw_mq.state.outages import answered

if TYPE_CHECKING:
    from weclaw_mq.state.redis_clients import StateClient

# A tenant keeps its lane this long after its latest publish while the lane has tasks
# waiting: a day, so a backlog that waits long keeps its one lane (the keys are a few bytes).
TENANT_KEEP_MS = 86_400_000

# KEYS: the counts hash, then one key per tenant. ARGV: lanes, the keys' TTL (ms), then each
# tenant's task count, in KEYS' order. Each tenant's lane, in order.
_ASSIGN = """
local lanes, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i = 2, #KEYS do
  local n = tonumber(ARGV[i + 1])
  local lane = tonumber(redis.call('GET', KEYS[i]) or '-1')
  local waiting = 0
  if lane >= 0 and lane < lanes then
    waiting = tonumber(redis.call('HGET', KEYS[1], 'n:' .. lane) or '0')
  end
  if waiting <= 0 then
    lane = 0
    local fewest = nil
    for j = 0, lanes - 1 do
      local load = tonumber(redis.call('HGET', KEYS[1], 'n:' .. j) or '0')
      if fewest == nil or load < fewest then lane, fewest = j, load end
    end
  end
  redis.call('SET', KEYS[i], lane, 'PX', ttl)
  redis.call('HINCRBY', KEYS[1], 'n:' .. lane, n)
  out[#out + 1] = lane
end
redis.call('PEXPIRE', KEYS[1], ttl)
return out
"""
# KEYS: the counts hash. ARGV: the hash's TTL (ms), then (lane, tasks) pairs to add.
_ADDED = """
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], 'n:' .. ARGV[i], tonumber(ARGV[i + 1]))
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
"""
# KEYS: the counts hash. ARGV: the hash's TTL (ms), then each lane's count, lane 0 first.
_COUNTED = """
for i = 2, #ARGV do
  redis.call('HSET', KEYS[1], 'n:' .. (i - 2), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
"""


class FairBook(Protocol):
    """Where a handler's tenants are queued (``RedisFairBook``, ``MemoryFairBook``)."""

    async def assign(
        self, queue: str, lanes: int, tenants: Sequence[str], ttl_ms: int
    ) -> list[int]:
        """The lane of each of ``tenants`` (one per task about to be published, in order),
        counted as waiting there; ``ttl_ms``: how long the tenants' keys live."""
        ...

    async def added(self, queue: str, tasks: Mapping[int, int], ttl_ms: int) -> None:
        """``tasks`` (lane -> how many) were published to lanes a producer already knew."""
        ...

    async def counted(self, queue: str, waiting: Sequence[int], ttl_ms: int) -> None:
        """The tasks waiting in each lane (lane 0 first), as the broker counts them now."""
        ...


class RedisFairBook:
    """The fair book in one Redis (or Cluster: each handler queue's keys share a slot).

    Args:
        client: The redis-py client.
    """

    def __init__(self, client: StateClient) -> None:
        self._assign = client.register_script(_ASSIGN)
        self._added = client.register_script(_ADDED)
        self._counted = client.register_script(_COUNTED)

    async def assign(
        self, queue: str, lanes: int, tenants: Sequence[str], ttl_ms: int
    ) -> list[int]:
        counts = Counter(tenants)
        keys = [fair_key(queue), *(fair_tenant_key(queue, t) for t in counts)]
        args: list[int] = [lanes, max(1, ttl_ms), *counts.values()]
        raw = await answered(self._assign(keys=keys, args=args))
        lane_of = {tenant: int(lane) for tenant, lane in zip(counts, raw, strict=True)}
        return [lane_of[t] for t in tenants]

    async def added(self, queue: str, tasks: Mapping[int, int], ttl_ms: int) -> None:
        args = [max(1, ttl_ms)]
        for lane, n in tasks.items():
            args += [lane, n]
        await answered(self._added(keys=[fair_key(queue)], args=args))

    async def counted(self, queue: str, waiting: Sequence[int], ttl_ms: int) -> None:
        args = [max(1, ttl_ms), *waiting]
        await answered(self._counted(keys=[fair_key(queue)], args=args))


class MemoryFairBook:
    """The fair book in one process, with the Redis scripts' rules (for ``TestBroker`` and
    the memory task store; keys do not expire)."""

    def __init__(self) -> None:
        self._lane: dict[tuple[str, str], int] = {}  # (queue, tenant) -> lane
        self._loads: dict[str, Counter[int]] = {}  # queue -> lane -> waiting

    async def assign(
        self, queue: str, lanes: int, tenants: Sequence[str], ttl_ms: int
    ) -> list[int]:
        loads = self._loads.setdefault(queue, Counter())
        lane_of: dict[str, int] = {}
        for tenant, n in Counter(tenants).items():
            lane = self._lane.get((queue, tenant), -1)
            if not (0 <= lane < lanes and loads[lane] > 0):
                lane = least_loaded([loads[i] for i in range(lanes)])
            self._lane[(queue, tenant)] = lane_of[tenant] = lane
            loads[lane] += n
        return [lane_of[t] for t in tenants]

    async def added(self, queue: str, tasks: Mapping[int, int], ttl_ms: int) -> None:
        self._loads.setdefault(queue, Counter()).update(tasks)

    async def counted(self, queue: str, waiting: Sequence[int], ttl_ms: int) -> None:
        self._loads[queue] = Counter(dict(enumerate(waiting)))


def fair_book_of(store: object) -> FairBook | None:
    """The fair book beside ``store`` (its ``fair_book()``: in its Redis for the Redis task
    store, in its process for the memory one); None without a store (a producer then hashes
    tenants to lanes)."""
    book = getattr(store, "fair_book", None)
    return book() if callable(book) else None

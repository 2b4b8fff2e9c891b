"""Whether each model of an app's fallback chains is up, in Redis, for every worker at once
(``policy.fallback`` says what it means; ``worker.fallbacks`` uses it).

One hash per app (``contract.naming.models_key``): ``<model>:until``, the Redis time (epoch
ms) the model is down until, and ``<model>:fails``, the attempts that failed on it in a row.
Scripts read and write it on Redis's clock, so the workers' clocks need not agree.

redis-py is not imported here: an app without fallbacks never loads it (``health_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from weclaw_mq.contract.naming import models_key
from weclaw_mq.state.outages import answered, redis_store

if TYPE_CHECKING:
    from weclaw_mq.state.redis_clients import StateClient

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS: the hash; ARGV: the models. Redis's time, then each model's "until" (0: up).
_READ = (
    _NOW
    + """
local out = {string.format('%d', now)}
for i, model in ipairs(ARGV) do
  out[i + 1] = redis.call('HGET', KEYS[1], model .. ':until') or '0'
end
return out
"""
)
# KEYS: the hash; ARGV: model, what happened ('ok', 'block', 'fail'), ms (block: how long;
# fail: the cool-down), failures in a row that take it down, the hash's TTL (ms).
_OUTCOME = (
    _NOW
    + """
local model, what = ARGV[1], ARGV[2]
local ms, threshold = tonumber(ARGV[3]), tonumber(ARGV[4])
local result = 0
if what == 'ok' then
  redis.call('HSET', KEYS[1], model .. ':fails', 0)
elseif what == 'block' then
  local down = tonumber(redis.call('HGET', KEYS[1], model .. ':until') or '0')
  if now + ms > down then
    redis.call('HSET', KEYS[1], model .. ':until', string.format('%d', now + ms))
  end
  result = 1
else
  local fails = redis.call('HINCRBY', KEYS[1], model .. ':fails', 1)
  if fails >= threshold then
    redis.call('HSET', KEYS[1], model .. ':until', string.format('%d', now + ms))
    redis.call('HSET', KEYS[1], model .. ':fails', 0)
    result = 1
  end
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return result
"""
)
# The hash outlives any cool-down or Retry-After by this much, then goes with the app's idle.
_KEEP_MS = 86_400_000


class ModelHealth:
    """The models of one app in one Redis (or Cluster).

    Args:
        client: The redis-py client.
        app: The app's name: its models' health is its own.
    """

    def __init__(self, client: StateClient, app: str) -> None:
        self._key = models_key(app)
        self._read = client.register_script(_READ)
        self._outcome = client.register_script(_OUTCOME)

    async def down_until(self, models: Sequence[str]) -> tuple[int, dict[str, int]]:
        """Redis's time (epoch ms), and until when each model that is down stays down."""
        raw = await answered(self._read(keys=[self._key], args=list(models)))
        now, *untils = (int(v) for v in raw)
        return now, {m: u for m, u in zip(models, untils, strict=True) if u > now}

    async def succeeded(self, model: str) -> None:
        """An attempt on ``model`` succeeded: its failures count from zero again."""
        await self._record(model, "ok", 0, 1)

    async def block(self, model: str, ms: int) -> None:
        """``model`` answered 429 with a Retry-After of ``ms``: down that long for everyone."""
        await self._record(model, "block", ms, 1)

    async def failed(self, model: str, failures: int, cool_down_ms: int) -> bool:
        """An attempt failed on ``model``; True when that took it down for ``cool_down_ms``."""
        return bool(await self._record(model, "fail", cool_down_ms, failures))

    async def _record(self, model: str, what: str, ms: int, threshold: int) -> int:
        keep = max(ms, 0) + _KEEP_MS
        result: int = await self._outcome(keys=[self._key], args=[model, what, ms, threshold, keep])
        return result


def health_of(store: object, app: str) -> ModelHealth:
    """The models' health in ``store``'s Redis.

    Raises:
        ConfigurationError: ``store`` is not the Redis task store.
    """
    found = redis_store(store, "fallback= keeps its models' health")
    health: ModelHealth = found.model_health(app)
    return health

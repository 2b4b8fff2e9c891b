"""Whether each model of an app's fallback chains is up, in Redis, for every worker at once
(``policy.fallback`` says what it means; ``llm.fallbacks`` uses it).

One hash per app (``contract.naming.models_key``): ``<model>:until``, the Redis time (epoch
ms) the model is down until (kept past it until a success: half-open), ``<model>:fails``, the
attempts that failed on it in a row, and ``<model>:lease`` / ``<model>:prober``, the one probe
of a half-open model and when it lapses.
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
# KEYS: the hash; ARGV: how long a probing model reads as down (ms), then the models.
# Redis's time, then per model its "until" (0: up; -1: half-open, no probe yet).
_READ = (
    _NOW
    + """
local recheck = tonumber(ARGV[1])
local out = {string.format('%d', now)}
for i = 2, #ARGV do
  local model = ARGV[i]
  local up = tonumber(redis.call('HGET', KEYS[1], model .. ':until') or '0')
  if up > now then
    out[i] = string.format('%d', up)
  elseif up == 0 then
    out[i] = '0'
  else
    local lease = tonumber(redis.call('HGET', KEYS[1], model .. ':lease') or '0')
    if lease > now then
      out[i] = string.format('%d', math.min(lease, now + recheck))
    else
      out[i] = '-1'
    end
  end
end
return out
"""
)
# KEYS: the hash; ARGV: model, the probe's owner, its lease (ms). 1: this owner probes the
# model (half-open, no live probe); 0: it does not.
_PROBE = (
    _NOW
    + """
local model = ARGV[1]
local up = tonumber(redis.call('HGET', KEYS[1], model .. ':until') or '0')
if up == 0 or up > now then
  return 0
end
local lease = tonumber(redis.call('HGET', KEYS[1], model .. ':lease') or '0')
if lease > now then
  return 0
end
redis.call('HSET', KEYS[1], model .. ':lease', string.format('%d', now + tonumber(ARGV[3])),
  model .. ':prober', ARGV[2])
return 1
"""
)
# KEYS: the hash; ARGV: model, what happened ('ok', 'block', 'fail', 'none': no word on the
# model), ms (block: how long; fail: the cool-down), failures in a row that take it down, the
# hash's TTL (ms), the attempt's owner (its probe, if it holds one).
# Returns 0: nothing changed; 1: the model went down; 2: the owner's probe failed (down again).
_OUTCOME = (
    _NOW
    + """
local model, what = ARGV[1], ARGV[2]
local ms, threshold = tonumber(ARGV[3]), tonumber(ARGV[4])
local up = tonumber(redis.call('HGET', KEYS[1], model .. ':until') or '0')
local probing = redis.call('HGET', KEYS[1], model .. ':prober') == ARGV[6]
  and tonumber(redis.call('HGET', KEYS[1], model .. ':lease') or '0') > now
local result = 0
if what == 'ok' then
  redis.call('HSET', KEYS[1], model .. ':fails', 0)
  if up ~= 0 and up <= now then
    redis.call('HDEL', KEYS[1], model .. ':until', model .. ':lease', model .. ':prober')
  end
elseif what == 'block' then
  if now + ms > up then
    redis.call('HSET', KEYS[1], model .. ':until', string.format('%d', now + ms))
  end
  redis.call('HDEL', KEYS[1], model .. ':lease', model .. ':prober')
  result = 1
elseif what == 'fail' then
  local fails = redis.call('HINCRBY', KEYS[1], model .. ':fails', 1)
  -- Half-open (its cool-down over, no success since): one failure takes it down again.
  if fails >= threshold or (up ~= 0 and up <= now) then
    if now + ms > up then
      redis.call('HSET', KEYS[1], model .. ':until', string.format('%d', now + ms))
    end
    redis.call('HSET', KEYS[1], model .. ':fails', 0)
    redis.call('HDEL', KEYS[1], model .. ':lease', model .. ':prober')
    result = 1
    if probing then
      result = 2
    end
  end
elseif probing then
  redis.call('HDEL', KEYS[1], model .. ':lease', model .. ':prober')
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return result
"""
)
# The hash outlives any cool-down or Retry-After by this much, then goes with the app's idle.
_KEEP_MS = 86_400_000
# How long a model whose probe runs reads as down: the parked tasks look again this often,
# so they follow a successful probe within about this long.
PROBE_RECHECK_MS = 1000
# The read script's mark of a half-open model that no task probes yet.
_HALF_OPEN = -1


class ModelHealth:
    """The models of one app in one Redis (or Cluster).

    A model taken down is *half-open* once its cool-down (or Retry-After) ends: exactly one
    attempt, of every worker's, probes it (``probe``); the rest read it as down while that
    probe runs. The probe's success brings it up; its failure takes it down again.

    Args:
        client: The redis-py client.
        app: The app's name: its models' health is its own.
    """

    def __init__(self, client: StateClient, app: str) -> None:
        self._key = models_key(app)
        self._read = client.register_script(_READ)
        self._probe = client.register_script(_PROBE)
        self._outcome = client.register_script(_OUTCOME)

    async def down_until(self, models: Sequence[str]) -> tuple[int, dict[str, int]]:
        """Redis's time (epoch ms), and until when each model that is down stays down (a
        half-open model is up here: its cool-down is over)."""
        now, down, _ = await self.read(models)
        return now, down

    async def read(self, models: Sequence[str]) -> tuple[int, dict[str, int], set[str]]:
        """Redis's time (epoch ms), until when each model that is down stays down, and the
        half-open models that no attempt probes yet (``probe``)."""
        raw = await answered(self._read(keys=[self._key], args=[PROBE_RECHECK_MS, *models]))
        now, *untils = (int(v) for v in raw)
        pairs = list(zip(models, untils, strict=True))
        return now, {m: u for m, u in pairs if u > now}, {m for m, u in pairs if u == _HALF_OPEN}

    async def probe(self, model: str, owner: str, lease_ms: int) -> bool:
        """Take the one probe of half-open ``model`` for ``owner`` (for ``lease_ms`` at most:
        a prober that dies frees it then); False when the model is not half-open or another
        attempt probes it."""
        taken = await answered(self._probe(keys=[self._key], args=[model, owner, lease_ms]))
        return bool(taken)

    async def succeeded(self, model: str, owner: str = "") -> None:
        """An attempt on ``model`` succeeded: its failures count from zero again, and a
        half-open model is up."""
        await self._record(model, "ok", 0, 1, owner)

    async def block(self, model: str, ms: int, owner: str = "") -> None:
        """``model`` answered 429 with a Retry-After of ``ms``: down that long for everyone."""
        await self._record(model, "block", ms, 1, owner)

    async def failed(self, model: str, failures: int, cool_down_ms: int, owner: str = "") -> int:
        """An attempt failed on ``model``: 0, nothing changed; 1, that took it down for
        ``cool_down_ms`` (``failures`` in a row, or one while it is half-open); 2, it was
        ``owner``'s probe, and the model is down again."""
        return await self._record(model, "fail", cool_down_ms, failures, owner)

    async def released(self, model: str, owner: str) -> None:
        """An attempt that says nothing of ``model`` ended: its probe, if any, is free."""
        await self._record(model, "none", 0, 1, owner)

    async def _record(self, model: str, what: str, ms: int, threshold: int, owner: str) -> int:
        keep = max(ms, 0) + _KEEP_MS
        result: int = await self._outcome(
            keys=[self._key], args=[model, what, ms, threshold, keep, owner]
        )
        return result


def health_of(store: object, app: str) -> ModelHealth:
    """The models' health in ``store``'s Redis.

    Raises:
        ConfigurationError: ``store`` is not the Redis task store.
    """
    found = redis_store(store, "fallback= keeps its models' health")
    health: ModelHealth = found.model_health(app)
    return health

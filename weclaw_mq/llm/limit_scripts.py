"""The Lua scripts of a handler's limits (``llm.limiting``), run in Redis with Redis's clock.

Each script's docstring, under it, says its keys, its arguments and its answer.
"""

from __future__ import annotations

ADMIT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, conc, rate = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local period, budget, need = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if budget > 0 then
  local blocked = redis.call('PTTL', KEYS[5])
  if blocked > 0 then return {'blocked', blocked} end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= conc then return {'concurrency', 0} end
end
if rate > 0 or budget > 0 then
  if budget > 0 then
    local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - period)
    local freed = 0
    for _, holder in ipairs(gone) do
      freed = freed + tonumber(redis.call('HGET', KEYS[3], holder) or '0')
      redis.call('HDEL', KEYS[3], holder)
    end
    if freed > 0 then redis.call('DECRBY', KEYS[4], freed) end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - period)
  local started = redis.call('ZCARD', KEYS[2])
  if rate > 0 and started >= rate then
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    return {'rate', tonumber(oldest[2]) + period - now}
  end
  if budget > 0 and started > 0 then
    local left = tonumber(redis.call('GET', KEYS[4]) or '0')
    if left + need > budget then
      local entries = redis.call('ZRANGE', KEYS[2], 0, 999, 'WITHSCORES')
      local wait = period
      for i = 1, #entries, 2 do
        left = left - tonumber(redis.call('HGET', KEYS[3], entries[i]) or '0')
        if left + need <= budget then
          wait = tonumber(entries[i + 1]) + period - now
          break
        end
      end
      -- The window's entries are due later than the keys expire when the margin grew since.
      for k = 2, 4 do
        if redis.call('PTTL', KEYS[k]) < 2 * period then
          redis.call('PEXPIRE', KEYS[k], 2 * period)
        end
      end
      return {'tokens', wait}
    end
  end
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('PEXPIRE', KEYS[2], 2 * period)
  if budget > 0 then
    redis.call('HSET', KEYS[3], ARGV[1], need)
    redis.call('INCRBY', KEYS[4], need)
    redis.call('PEXPIRE', KEYS[3], 2 * period)
    redis.call('PEXPIRE', KEYS[4], 2 * period)
  end
end
if conc > 0 then
  redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], lease)
end
return {'ok', 0}
"""
"""Admit one start under one limit, or say which part refused it.

KEYS: slots, starts, tokens, total, blocked. ARGV: holder, lease_ms, concurrency (0: none),
rate (0: none), period_ms, token budget (0: none), the start's estimated tokens.
Returns {'ok', 0}, {'concurrency', 0}, {'rate' or 'tokens', ms until enough of the window's
starts leave it} or {'blocked', ms the 429's Retry-After still runs}. Every entry of ``slots``
ends by now + lease, so the key's own TTL (lease) outlives them all and an idle key disappears
by itself; likewise ``starts`` and a token limit's keys after two periods: twice, because a
token limit's period grows with its learned margin after the keys' TTL was set, and a key
expiring with its entries still due would empty the window at once. A start estimated
over the whole budget is admitted into an empty window (it could never fit otherwise).
"""

SETTLE_SCRIPT = """
local before = redis.call('HGET', KEYS[1], ARGV[1])
if not before then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCRBY', KEYS[2], tonumber(ARGV[2]) - tonumber(before))
return 1
"""
"""Replace a start's estimated tokens by those it used. KEYS: tokens, total. ARGV: holder,
tokens used. 0: the start has left the window already (nothing to correct there)."""

BLOCK_SCRIPT = """
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
end
return 1
"""
"""Admit nothing under a token limit's key for ARGV[1] ms (a 429's Retry-After), unless a
longer block runs already. KEYS: blocked."""

RENEW_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
"""Extend a held slot's lease. KEYS: slots. ARGV: holder, lease_ms. 0: the slot was lost."""

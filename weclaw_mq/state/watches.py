"""A long run's watch (``worker.long_runs``): which of its copies on the broker still count.

A long run's delivery is acked as the run begins; what keeps the task on the broker from then
on is its *watch copy*, parked in a delay queue and coming back once per watch period. Each
copy carries a generation (header ``x-weclaw-watch``); the task's watch key (``naming.watch_key``,
in its guard key's slot) holds the generation of the copy that counts now:

- ``g > 0``: copies of generation ``g`` or later count; older ones are stale.
- ``-g``: the run ended at generation ``g`` (its next copy, a retry's or the DLQ's, was
  published first): every watch copy up to ``g`` is stale; a new run starts at ``g + 1``.
- no key: nothing is known (never watched, or Redis lost it): a copy counts, and the guard
  decides as for any copy (at least once).

Every step raises the generation, never lowers it: a run that starts (or resumes) takes the
next one and publishes its copy with it, so the copy that resumed it, and any other copy left
from before (a hand-over that crashed half way), is stale from then on. Pure rules here, and
the scripts that keep them on Redis; ``state.memory`` keeps the same rules in one process.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "WATCHED_CLAIM_PRELUDE",
    "WATCH_SET_LUA",
    "WatchStep",
    "is_stale",
    "next_value",
]


class WatchStep(StrEnum):
    """How ``TaskStore.watch`` moves a task's watch generation."""

    START = "start"  # a run begins (or resumes): the next generation after both
    RAISE = "raise"  # a hand-over's copy was published: at least its generation
    END = "end"  # the run ended and its next copy is out: every watch copy is stale


def is_stale(current: int | None, generation: int) -> bool:
    """Whether a watch copy of ``generation`` is no longer needed, the key holding
    ``current`` (None: no key)."""
    if current is None:
        return False
    return generation < current if current > 0 else generation <= -current


def next_value(current: int | None, generation: int, step: WatchStep) -> int:
    """The key's value after ``step`` with ``generation`` (the copy's, or the run's own)."""
    now = 0 if current is None else abs(current)
    if step is WatchStep.START:
        return max(now, generation) + 1
    if step is WatchStep.RAISE:
        return max(now, generation)
    return -max(now, generation)


# The same rules on Redis. KEYS: the watch key; ARGV: generation, step, ttl_ms. Returns the
# value written.
WATCH_SET_LUA = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local now, gen = math.abs(current), tonumber(ARGV[1])
local value
if ARGV[2] == 'start' then value = math.max(now, gen) + 1
elseif ARGV[2] == 'raise' then value = math.max(now, gen)
else value = -math.max(now, gen) end
redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
return value
"""

# Put before the claim script (``state.redis.CLAIM_SCRIPT``) for a watch copy: the watch key is
# the claim's last key and the copy's generation its last argument, taken off before the claim
# reads its own. A stale copy claims nothing and writes no record.
WATCHED_CLAIM_PRELUDE = """
local watch_key, watch_gen = table.remove(KEYS), tonumber(table.remove(ARGV))
local watched = tonumber(redis.call('GET', watch_key) or '0')
if (watched > 0 and watch_gen < watched) or (watched < 0 and watch_gen <= -watched) then
  return 'stale'
end
"""

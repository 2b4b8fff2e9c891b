"""A task's lifetime (TTL) on the wire: its deadline, how it is read back and renewed.
Pure: no broker or Redis I/O.

A task published with a lifetime of ``ttl_s`` carries it twice:

- the AMQP ``expiration`` property (milliseconds): RabbitMQ dead-letters the message to
  ``Q.dlq`` (x-death reason ``expired``) when it reaches the head of ``Q`` past it. No queue
  argument is involved, so existing queues are declared unchanged;
- the headers ``EXPIRES_AT`` (absolute deadline, epoch ms) and ``TTL_MS`` (the lifetime it was
  given). RabbitMQ removes ``expiration`` from every message it dead-letters, so a task coming
  back from a delay queue has no per-message TTL any more: from then on the worker enforces
  the deadline on delivery, from the header.

Who records what: a worker that receives a task past its deadline (or would park it in a
delay queue past it) dead-letters it with reason ``expired`` and records ``expired``. The
broker expiring a task in ``Q`` records nothing; ``state.expiry.as_seen_at`` makes its
queued/retrying record read as ``expired`` once the deadline (kept in the record) has passed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.errors import ConfigurationError

# The default lifetime of a task: a reply nobody collected within 7 days leaves the queue.
DEFAULT_TTL_S = 7 * 24 * 3600.0


# The wall clock (seconds since the epoch) of every deadline and not-before time the worker
# and ``App.publish`` write and check. Only ``weclaw_mq.testing`` swaps it: its TestBroker
# moves time forward so a test need not wait out a real retry delay.
_wall_clock: Callable[[], float] = time.time


def now_ms() -> int:
    return int(_wall_clock() * 1000)


def use_wall_clock(clock: Callable[[], float]) -> Callable[[], float]:
    """Make ``now_ms`` read ``clock`` from now on; returns the clock it read before (for the
    caller to put back)."""
    global _wall_clock
    previous, _wall_clock = _wall_clock, clock
    return previous


def check_ttl(ttl_s: float, what: str) -> float:
    """``ttl_s`` if it is a usable lifetime, else ``ConfigurationError``."""
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, (int, float))
        or not math.isfinite(ttl_s)
        or ttl_s <= 0
    ):
        raise ConfigurationError(f"{what} must be a number of seconds > 0, got {ttl_s!r}")
    if ttl_s * 1000 < 1:
        raise ConfigurationError(f"{what} must be at least 0.001 (1 ms), got {ttl_s!r}")
    return float(ttl_s)


def stamp(headers: dict[str, Any], ttl_ms: int, at_ms: int) -> None:
    """Write a lifetime of ``ttl_ms`` starting at ``at_ms`` into ``headers``."""
    headers[h.TTL_MS] = ttl_ms
    headers[h.EXPIRES_AT] = at_ms + ttl_ms


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def deadline_ms(headers: Mapping[str, Any]) -> int | None:
    """The task's deadline (epoch ms), or None when it has none (published without a TTL,
    or by a producer that does not know ours)."""
    return _int(headers.get(h.EXPIRES_AT))


def left_ms(headers: Mapping[str, Any], at_ms: int) -> int | None:
    """Milliseconds the task has left at ``at_ms`` (<= 0: expired); None without a deadline."""
    deadline = deadline_ms(headers)
    return None if deadline is None else deadline - at_ms


def renewed(headers: Mapping[str, Any], at_ms: int) -> tuple[dict[str, Any], int | None]:
    """The headers of a copy sent back to work (a DLQ requeue) with a fresh lifetime of the
    length it was first given, and that lifetime in ms (None: it had none). A copy that kept
    its old deadline would only expire again on its first delivery."""
    out = dict(headers)
    ttl_ms = _int(headers.get(h.TTL_MS))
    if ttl_ms is None or ttl_ms <= 0:
        out.pop(h.EXPIRES_AT, None)
        return out, None
    stamp(out, ttl_ms, at_ms)
    return out, ttl_ms


def as_datetime(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)

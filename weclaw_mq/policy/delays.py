"""Arbitrary delays served by a bounded set of delay queues. Pure: no broker I/O.

RabbitMQ expires messages only at the head of a queue, so each delay needs a queue of its own
(``Q.retry.lanes.<delay>``, x-message-ttl, dead-lettering back to the lane named by the
task's routing key; shared by Q's lanes, see ``topology``). A delay asked for at run time
(``Retry(after_s=)``, ``publish(delay_s=)``) cannot get a queue of its own without the number
of queues growing with every new value. Instead each handler has a fixed set: the
step queues ``STEP_DELAYS_MS`` (powers of 4 seconds, 1 s to 1024 s) plus its retry policy's
own delays. A task delayed by ``d`` carries its not-before time (header ``NOT_BEFORE``) and
hops: it is parked in the longest queue of the set not longer than what is left, comes back to
its lane, and a worker that receives it before its time parks it again (no attempt spent,
nothing run, no claim taken), until it is due.

Precision: a task never runs before its not-before time (on the clock of the worker that
receives it). It runs at most ``MIN_STEP_MS`` (1 s) after it, plus, per hop, the time its lane
takes to hand it to a worker (milliseconds on a lane with free workers; behind a backlog,
that backlog). Hops: at most 3 per power of 4 below the delay, plus one per 1024 s above it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.errors import ConfigurationError

# Powers of 4 keep the set small (each is a quorum queue per handler) at the cost of at most
# 3 hops per step size; 1024 s bounds a long delay's hop count at one per ~17 minutes.
STEP_DELAYS_MS: tuple[int, ...] = tuple(1000 * 4**k for k in range(6))
MIN_STEP_MS = STEP_DELAYS_MS[0]


def next_hop_ms(remaining_ms: int, queues_ms: tuple[int, ...]) -> int:
    """The delay queue a task with ``remaining_ms`` still to wait goes to: the longest not
    longer than that; under 1 s left, the shortest not shorter (one last hop, < 1 s late,
    rather than many through a policy's sub-second queue)."""
    if remaining_ms < MIN_STEP_MS:
        return min(q for q in queues_ms if q >= remaining_ms)
    return max(q for q in queues_ms if q <= remaining_ms)


def hops_ms(delay_ms: int, queues_ms: tuple[int, ...]) -> list[int]:
    """The queues a delay of ``delay_ms`` passes through when each hop takes exactly its TTL:
    what the precision statement above is made of (tests and docs)."""
    hops: list[int] = []
    left = delay_ms
    while left > 0:
        hop = next_hop_ms(left, queues_ms)
        hops.append(hop)
        left -= hop
    return hops


def check_delay(delay_s: float, what: str) -> int:
    """``delay_s`` (seconds, >= 0, finite) in ms, else ``ConfigurationError``."""
    if (
        isinstance(delay_s, bool)
        or not isinstance(delay_s, (int, float))
        or not math.isfinite(delay_s)
        or delay_s < 0
    ):
        raise ConfigurationError(f"{what} must be a number of seconds >= 0, got {delay_s!r}")
    return math.ceil(delay_s * 1000)


def not_before_ms(headers: Mapping[str, Any]) -> int | None:
    """The task's not-before time (epoch ms), or None when it has none."""
    value = headers.get(h.NOT_BEFORE)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def schedule(headers: dict[str, Any], delay_ms: int, hop_ms: int, at_ms: int) -> None:
    """Write (or clear) the not-before time of a task parked at ``at_ms`` in the ``hop_ms``
    queue for a delay of ``delay_ms``: only a hop shorter than the delay needs one, so a
    policy retry (whose delay is a queue of its own) travels exactly as it always did."""
    if hop_ms < delay_ms:
        headers[h.NOT_BEFORE] = at_ms + delay_ms
    else:
        headers.pop(h.NOT_BEFORE, None)

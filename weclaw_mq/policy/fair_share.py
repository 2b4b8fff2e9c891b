"""Fair share across tenants: which lane a tenant's task goes to, and which lane a worker
starts from next. Pure.

    @app.handler("answers", tenant=lambda task: task.tenant, fair=Fair(lanes=4))
    async def answer(task: Question) -> str: ...

A handler with ``fair=`` has ``lanes`` queues at its NORMAL level: Q itself and
``Q.lane.f1`` ... (``contract.naming.fair_lane_name``). Its producer sends each task to its
tenant's lane, and a worker starts tasks from those lanes in turn (``next_in_turn``), so a
tenant with a backlog of thousands holds one lane and another tenant's task starts at the next
free slot (its lane runs nothing, so it comes first), not after the backlog.

Which lane a tenant gets (``state.fair_book``, one Redis script for every producer): the lane
it already has while any of its tasks waits (its tasks stay in order), else the lane with the
fewest waiting tasks (``least_loaded``; Q on a tie, so a quiet system looks like one queue).
So up to ``lanes - 1`` tenants with a backlog each hold a lane of their own and any other
tenant finds an empty one; past that, a new tenant shares the least loaded lane. Without its
book (no Redis, or Redis not answering in time) a producer hashes the tenant
(``hashed_lane``): fair between lanes, but two tenants may share one.

Why lanes and not a queue per tenant: a quorum queue costs the broker about 3 file handles and
each worker a consumer, so tenants by the thousand cannot each have one; a fixed number of
lanes costs the same whatever the number of tenants. Why not admission by share (defer a
tenant over its share): a backlog's tasks would circle through the delay queues again and
again, costing the broker a publish per pass, while the other tenant's task still waits
behind them in the one queue.

Priorities come first: the HIGH and URGENT lanes (``priorities=True``) are served before any
fair lane, as before, and the fair lanes are the NORMAL level.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.limits import KeyFunc

# How often every worker writes the broker's lane counts to the fair book
# (``worker.fair_counts``), and so how long a producer may reuse a tenant's lane without
# asking (``publishing.fair_lanes``): K passive declares per handler per worker per period
# cost the broker next to nothing.
FAIR_COUNT_EVERY_S = 1.0
# More lanes cost file handles on the broker (about 3 per quorum queue) and a consumer per
# lane in every worker: 64 is far past any use and still bounded.
MAX_FAIR_LANES = 64


@dataclass(frozen=True)
class Fair:
    """Share a handler's workers fairly between its tenants.

    Args:
        lanes: The queues of its NORMAL level, Q included (2 to 64): up to ``lanes - 1``
            tenants with a backlog each hold one, and another tenant's task still finds an
            empty one.
        key: A function of the task naming its tenant (a ``str`` or ``int``); None uses the
            handler's ``tenant=``.

    Raises:
        ConfigurationError: ``lanes`` is not an int from 2 to 64, or ``key`` is not callable.
    """

    lanes: int = 4
    key: KeyFunc | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.lanes, bool)
            or not isinstance(self.lanes, int)
            or not 2 <= self.lanes <= MAX_FAIR_LANES
        ):
            raise ConfigurationError(
                f"Fair lanes must be an int from 2 to {MAX_FAIR_LANES}, got {self.lanes!r}"
            )
        if self.key is not None and not callable(self.key):
            raise ConfigurationError("Fair key must be a function of the task")


def tenant_text(value: object) -> str:
    """A tenant as the fair book keys it: a ``str`` as is, an ``int`` in decimal.

    Raises:
        ConfigurationError: Anything else (a key function returning None, a float, a dict).
    """
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ConfigurationError(
        f"a fair-share tenant must be a non-empty str or an int, the key function gave {value!r}"
    )


def least_loaded(loads: Sequence[int]) -> int:
    """The lane with the fewest waiting tasks; the lowest index on a tie (Q first)."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def hashed_lane(tenant: str, lanes: int) -> int:
    """A tenant's lane when the fair book cannot be asked: the same on every producer and
    every run (crc32, not ``hash``, which Python salts per process)."""
    return zlib.crc32(tenant.encode()) % lanes


def next_in_turn(
    candidates: Sequence[str],
    served: Mapping[str, int],
    running: Mapping[str, int] | None = None,
) -> str:
    """Of ``candidates`` (lanes of one level, each with a task waiting), the one with the
    fewest tasks running (``running``), then the one served least recently (``served``: lane
    -> the serial of its latest start; never served counts 0), then the first.

    Fewest running first shares the worker's slots evenly between the lanes with work (a
    lane that has none running starts next), and a slot a lane's task frees goes back to
    that lane while the shares are even: its consumer stays, nothing is cancelled or opened.
    """
    busy = running or {}
    return min(candidates, key=lambda lane: (busy.get(lane, 0), served.get(lane, 0)))

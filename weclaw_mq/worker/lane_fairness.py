"""A handler's fair lanes (``policy.fair_share``: lanes of one level) as a worker serves them
(``FairLanes``): each lane's peers, when each lane was last served, and which idle consumer
may be withdrawn to make room for a peer.

Fair lanes are taken in turn (``lane_priority.pick``: the one with the fewest tasks running,
then the one served least recently); a lane of the same level never holds another back when
pending. They take room from each other without giving any task back: the next release
cancels its own consumer before the ack, or a consumer idle for ``EMPTY_LANE_S`` is withdrawn
(``withdrawable``): cancelled, and still counted until its cancel-ok, so a task the broker
sent it meanwhile waits and runs there (an armed consumer of a backlog is about to be sent
one; a give-back would bring that task one closer to the DLQ). No bulk mode: the lowest level
is several tenants' lanes.

Plain data in, a choice out: the lane scheduler (``worker.lanes``) and its consumers' books
(``lane_consumers``) own the consumers and the clock, and tell this what happened.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

# A fair lane's consumer armed this long without a delivery is on an empty lane: only such a
# consumer is cancelled to make room for another fair lane (``withdrawable``). A queue with
# messages sends one within a round trip; a loaded broker may take tens of milliseconds.
EMPTY_LANE_S = 0.25


class FairLanes:
    """The fair-share lanes among a handler's lanes (``rank_of``: lane -> level; lanes of one
    level are peers), with the serial of each one's latest start and when each idle consumer
    was armed (forgotten past ``memory`` tags)."""

    def __init__(self, rank_of: Mapping[str, int], *, memory: int) -> None:
        # The other lanes of each lane's level (its fair-share peers; none without levels).
        self.peers = {
            lane: frozenset(o for o, r in rank_of.items() if r == rank and o != lane)
            for lane, rank in rank_of.items()
        }
        # The serial of each lane's latest start (``pick``'s served); None: no fair lanes.
        self.served: dict[str, int] | None = None
        if len(set(rank_of.values())) < len(rank_of):
            self.served = {}
        self._serial = 0
        self._armed_at: dict[str, float] = {}
        self._memory = memory

    def started(self, lane: str) -> None:
        """A task of ``lane`` started: it is the lane served most recently."""
        if self.served is not None:
            self._serial += 1
            self.served[lane] = self._serial

    def armed(self, tag: str, now: float, idle: Mapping[str, Collection[str]]) -> None:
        """Consumer ``tag`` is idle from loop time ``now`` (``idle``: each lane's idle tags,
        to forget the others once more than ``memory`` are remembered)."""
        self._armed_at[tag] = now
        if len(self._armed_at) > self._memory:  # forget the tags no longer idle
            idle_now = set().union(*idle.values())
            self._armed_at = {t: at for t, at in self._armed_at.items() if t in idle_now}

    def withdrawable(self, idle: Collection[str], now: float) -> str | None:
        """Of a lane's ``idle`` consumers, the first (by tag) armed at least ``EMPTY_LANE_S``
        before ``now`` (its lane is empty: nothing was sent to it), or None if none is that
        old yet."""
        aged = sorted(t for t in idle if now - self._armed_at.get(t, now) >= EMPTY_LANE_S)
        return aged[0] if aged else None

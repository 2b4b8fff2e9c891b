"""Which waiting task of a handler's priority lanes starts next (``pick``, ``LanePriorities``):
the highest lane's, unless a lower lane was passed over ``starvation_limit`` times in a row;
then its task starts next. Fair lanes (lanes of one level) are taken in turn among themselves
(``policy.fair_share.next_in_turn``).

A lane whose look-ahead was just started (its next task may be one round trip away) is
pending: lower lanes wait for it up to ``grace``, ``LOOKAHEAD_GRACE_S``, or twice the median
of the latest such waits that ended in a delivery (a loaded broker's round trip), at most
``LOOKAHEAD_GRACE_MAX_S``.

Plain data in, a choice out: the lane scheduler (``worker.lanes``, with ``lane_consumers``
and ``lane_serving``) owns the consumers, the timers and the clock, and tells this what
happened.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence, Sized

from weclaw_mq.policy.fair_share import next_in_turn

# After a lane's spare was opened (from its consume-ok) or re-armed (from the ack that frees
# it), how long lower lanes wait for that lane's next task: a queue with messages delivers one
# within a round trip, an empty one never does, and we cannot tell them apart sooner. A slot
# stays free that long only when a higher lane turns out to be empty: at the end of its burst.
LOOKAHEAD_GRACE_S = 0.02
# ... or twice the median of the latest LATENCY_SAMPLES such waits that ended in a delivery
# (also after the grace), up to LOOKAHEAD_GRACE_MAX_S: under load a round trip takes longer
# than 20 ms, and a lower lane would start before the higher one's next task came (a loaded
# suite run: 8 NORMAL tasks overtook the last HIGH one where 6 may). The median, not the
# max: a task published just after a lane emptied is no round trip.
LOOKAHEAD_GRACE_MAX_S = 0.25
LATENCY_SAMPLES = 16


def pick(
    lanes: Sequence[str],
    waiting: Sequence[str],
    skipped: dict[str, int],
    limit: int,
    pending: Collection[str] = (),
    levels: Mapping[str, int] | None = None,
    served: Mapping[str, int] | None = None,
    running: Mapping[str, int] | None = None,
) -> str | None:
    """The lane whose waiting task starts next, updating ``skipped`` (pure: unit-tested).

    ``lanes`` is highest first; ``waiting`` the lanes with a task waiting. The highest
    waiting lane wins, unless a lower one was passed over ``limit`` times in a row: then the
    highest such starved lane wins. Each lower waiting lane passed over counts one skip.
    None (wait) when a lane above the winner is ``pending``: its spare consumer was just
    opened and its next task may be on the way (a starved lane does not wait).

    ``levels`` (lane -> rank, 0 highest; default: each lane its own level, in order): lanes
    of one level are fair-share lanes, taken in turn: of the winner's level, the lane with the
    fewest tasks ``running``, then the one ``served`` least recently, wins
    (``policy.fair_share.next_in_turn``); a lane of its own level neither holds it back when
    pending nor counts a skip.
    """
    candidates = [lane for lane in lanes if lane in waiting]
    if not candidates:
        return None
    rank_of = levels if levels is not None else {lane: i for i, lane in enumerate(lanes)}
    starved = [lane for lane in candidates if skipped.get(lane, 0) >= limit]
    choice = starved[0] if starved else candidates[0]
    rank = rank_of[choice]
    if not starved and served is not None:
        peers = [lane for lane in candidates if rank_of[lane] == rank]
        if len(peers) > 1:
            choice = next_in_turn(peers, served, running)
    if not starved and any(rank_of[lane] < rank for lane in pending):
        return None
    for lane in candidates:
        if rank_of[lane] > rank:
            skipped[lane] = skipped.get(lane, 0) + 1
    skipped[choice] = 0
    return choice


class LanePriorities:
    """The choice of the next lane to start from, with what it remembers between choices:
    each lane's skips, the pending lanes and the grace lower lanes wait for them."""

    def __init__(
        self, lanes: Sequence[str], rank_of: Mapping[str, int], *, starvation_limit: int
    ) -> None:
        self.lanes = list(lanes)  # highest first
        self.lowest = self.lanes[-1]
        self.upper = tuple(self.lanes[:-1])
        self.rank_of = dict(rank_of)
        self.starvation_limit = starvation_limit
        # The lanes of a level above the lowest lane's: only those hold it back when pending.
        lowest_rank = self.rank_of[self.lowest]
        self.above_lowest = frozenset(
            lane for lane in self.lanes if self.rank_of[lane] < lowest_rank
        )
        self.skipped: dict[str, int] = dict.fromkeys(self.lanes, 0)
        # Lanes whose next task may be on its way (see ``pick``'s pending), each with the
        # mark of its latest expectation (an older timer must not end a newer one).
        self.pending: dict[str, int] = {}
        self._marks = 0
        # When each timed expectation began, and how long the latest ones that ended in a
        # delivery took (the grace follows them).
        self.expected_at: dict[str, float] = {}
        self._waits: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.grace = LOOKAHEAD_GRACE_S

    def choose(
        self,
        waiting: Mapping[str, Sized],
        served: Mapping[str, int] | None = None,
        running: Callable[[], Mapping[str, int]] | None = None,
    ) -> str | None:
        """``pick`` over the lanes with a task ``waiting`` (lane -> its waiting tasks), fair
        lanes by ``served`` and the ``running`` counts (asked only when needed). The steady
        state of a handler whose tasks are all NORMAL (only the lowest lane has tasks) is
        decided here without building the lists ``pick`` takes: the same answer, fewer calls
        per delivery."""
        for lane in self.upper:
            if waiting[lane]:
                candidates = [lane for lane in self.lanes if waiting[lane]]
                return pick(
                    self.lanes,
                    candidates,
                    self.skipped,
                    self.starvation_limit,
                    self.pending,
                    self.rank_of,
                    served,
                    running() if served is not None and running is not None else None,
                )
        if not waiting[self.lowest]:
            return None
        # As pick: the only candidate wins, unless a lane of a higher level is pending and it
        # is not starved (only upper lanes are ever pending, see expect).
        if (
            self.pending
            and self.skipped[self.lowest] < self.starvation_limit
            and not self.above_lowest.isdisjoint(self.pending)
        ):
            return None
        self.skipped[self.lowest] = 0
        return self.lowest

    def expect(self, lane: str, at: float | None = None) -> int | None:
        """Lower lanes wait for ``lane``'s next task: from loop time ``at`` for ``grace``, or
        (None) until ``expect`` is called again with a time. The expectation's mark (for
        ``grace_over``), or None when nothing below its level waits."""
        if lane not in self.above_lowest:
            return None
        self._marks += 1
        self.pending[lane] = self._marks
        self.expected_at.pop(lane, None)
        if at is not None:
            self.expected_at[lane] = at
        return self._marks

    def grace_over(self, lane: str, mark: int) -> bool:
        """The grace of expectation ``mark`` is over: True if it was ``lane``'s latest (lower
        lanes stop waiting for it)."""
        if self.pending.get(lane) == mark:
            del self.pending[lane]  # its task, if it comes, still counts as a wait
            return True
        return False

    def delivered(self, lane: str, now: float) -> None:
        """A task of ``lane`` came at loop time ``now``: the lane is no longer pending, and
        the time since it was expected is a wait the grace follows."""
        # ``in`` and ``del``, not dict.pop: no call on a delivery's path for what is absent.
        if lane in self.pending:
            del self.pending[lane]
        if lane in self.expected_at:
            self.waited(now - self.expected_at[lane])
            del self.expected_at[lane]

    def waited(self, seconds: float) -> None:
        """A higher lane's next task came ``seconds`` after it was expected: ``grace`` (how
        long lower lanes wait for one) becomes twice the recent median, within its bounds."""
        if seconds > LOOKAHEAD_GRACE_MAX_S:
            return  # the lane was empty, and a task came later
        self._waits.append(seconds)
        median = statistics.median(self._waits)
        self.grace = min(max(LOOKAHEAD_GRACE_S, 2 * median), LOOKAHEAD_GRACE_MAX_S)

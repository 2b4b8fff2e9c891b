"""Where a lane's consumer finds room under the cap (``take_room``): a lane left without a
look-ahead needs a consumer, and a worker holds at most ``concurrency + lanes`` (the lane
scheduler's bound, ``worker.lanes``), so another consumer gives up its place, in this order:

1. the consumer of the task being released (cancelled before its ack, so the broker never
   sends it another), if its lane keeps another look-ahead;
2. an armed idle consumer of the lowest lane that keeps another look-ahead (of a fair peer,
   only one idle for ``lane_fairness.EMPTY_LANE_S``, withdrawn: the room counts from its
   cancel-ok);
3. else a surplus waiting task of the lowest such lane that is no fair peer is given back
   (only after tasks of one lane waited behind a burst of another).

Nothing is taken while a surplus task is on its way back or a withdrawn consumer's cancel-ok
is: that is the room. Plain data in, a choice out: ``lane_serving`` carries it out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Room:
    """Room under the cap: ``how`` it is made, from ``lane``'s consumer ``tag`` ("surplus":
    the lane's last waiting task goes back, its consumer with it)."""

    how: Literal["ending", "idle", "withdraw", "surplus"]
    lane: str
    tag: str = ""


def _never(_: str) -> str | None:
    return None


def take_room(
    lane_in_need: str,
    lanes: Sequence[str],
    *,
    idle: Mapping[str, Collection[str]],
    waiting: Mapping[str, Sized],
    opening: Mapping[str, int],
    peers: Collection[str] = (),
    ending: tuple[str, str] | None = None,
    leaving: bool = False,
    withdrawing: bool = False,
    withdrawable: Callable[[str], str | None] = _never,
) -> tuple[Room | None, bool]:
    """The room ``lane_in_need`` gets (None: none to take now), and whether a fair peer's
    idle consumer was too young to be withdrawn (a retry is due once it is old enough).

    ``lanes`` is highest first; ``idle``, ``waiting`` and ``opening`` are each lane's idle
    consumer tags, waiting tasks and consumers being opened (a lane's look-ahead is their
    sum); ``peers`` the fair peers of ``lane_in_need``; ``ending`` the (tag, lane) of the
    consumer whose task is being released, if it may still be cancelled; ``leaving``: a
    surplus task is on its way back; ``withdrawing``: a withdrawn consumer's cancel-ok is on
    its way; ``withdrawable``: a peer lane's idle consumer old enough to withdraw, or None.
    """
    if leaving:
        return None, False  # a surplus task is on its way back: that is the room

    def lookahead(lane: str) -> int:
        return len(idle[lane]) + len(waiting[lane]) + opening[lane]

    if ending is not None:
        tag, lane = ending
        if tag in idle[lane] and lookahead(lane) >= 2:
            return Room("ending", lane, tag), False
    if withdrawing:
        return None, False  # a withdrawn consumer's cancel-ok is on its way: that is the room
    young = False
    for lane in reversed(lanes):
        if idle[lane] and lookahead(lane) >= 2:
            if lane in peers:
                # Fair lanes take room from each other only by withdrawing a consumer idle
                # for EMPTY_LANE_S (likely on an empty lane), and the room counts only
                # from its cancel-ok: an armed consumer of a backlog is about to be sent
                # a task, and giving it back would bring it one closer to the DLQ (a
                # loaded run's 250 ms were not enough: 7 returns in a suite's run).
                aged = withdrawable(lane)
                if aged is None:
                    young = True
                    continue
                return Room("withdraw", lane, aged), young
            # The oldest tag, not set.pop()'s: the same choice on every run (a replayable model).
            return Room("idle", lane, min(idle[lane])), young
    for lane in reversed(lanes):
        if lane not in peers and len(waiting[lane]) >= 2:
            return Room("surplus", lane), young
    return None, young

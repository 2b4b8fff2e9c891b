"""Keeping every lane of a handler served (``LaneServing``): a lane left without a look-ahead
(a consumer not running a task: armed, holding the lane's waiting task, or being opened) gets
a new consumer; at the cap (``concurrency + lanes``) another consumer gives up its place first,
as ``lane_room.take_room`` decides, and this carries that out on the consumer books
(``LaneConsumers``). With nothing to give up now, the lane stays ``unserved`` and is served
when a task ends, a consume completes, a cancel-ok or give-back frees room, or a fair peer's
idle consumer is old enough to withdraw (``lane_fairness.EMPTY_LANE_S``).

Of the lane scheduler (``worker.lanes``) it knows three callbacks: whether the cap is reached
(``full``), whether lanes are served at all now (``active``: not stopping, not paused), and
how a counted consumer is opened (``open_lane``); the consumer books, the waiting deliveries and the
lane policies are the scheduler's, shared.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.worker.lane_consumers import LaneConsumers
from weclaw_mq.worker.lane_fairness import EMPTY_LANE_S, FairLanes
from weclaw_mq.worker.lane_priority import LanePriorities
from weclaw_mq.worker.lane_room import take_room


class LaneServing:
    """Each lane of ``lanes`` keeps a look-ahead under the cap; ``ending`` and ``cancel_ending``
    are the release's: the consumer of the task being released, and whether it gave up its
    place (the release then cancels it before the ack)."""

    def __init__(
        self,
        lanes: Sequence[str],
        *,
        consumers: LaneConsumers,
        waiting: dict[str, deque[AbstractIncomingMessage]],
        fair: FairLanes,
        priorities: LanePriorities,
        give_back: Callable[[AbstractIncomingMessage, str], Awaitable[object]],
        full: Callable[[], bool],
        active: Callable[[], bool],
        open_lane: Callable[[str], None],
    ) -> None:
        self.lanes = lanes
        self._consumers = consumers
        self._waiting = waiting
        self._fair = fair
        self._priorities = priorities
        self._give_back = give_back
        self._full = full
        self._active = active
        self._open_lane = open_lane
        # Lanes left without any consumer not running a task, waiting for room.
        self.unserved: set[str] = set()
        # Surplus waiting tasks being given back to make room (see _make_room): counted.
        self.leaving = 0
        # The consumer of the task being released, while ``release`` decides about it.
        self.ending: str | None = None
        self.cancel_ending = False
        # Fair lanes: the timer that serves the unserved lanes once the youngest idle consumer
        # of a peer lane is old enough to be withdrawn.
        self._empty_timer: asyncio.TimerHandle | None = None

    def lookahead(self, lane: str) -> int:
        """Consumers of ``lane`` that are not running a task."""
        consumers = self._consumers
        return len(consumers.idle[lane]) + len(self._waiting[lane]) + consumers.opening[lane]

    def renew(self, lane: str) -> None:
        """``lane`` has no look-ahead left: open a consumer, making room under the cap. With
        nothing to give up now (the surplus is still being opened), it is retried when a
        task ends or a consume completes: the cap holds, and no lane is left unconsumed."""
        if self._full() and not self._make_room(lane):
            self.unserved.add(lane)
            return
        self.unserved.discard(lane)
        self._consumers.opening[lane] += 1
        self._priorities.expect(lane)  # timed from its consume-ok (the scheduler's _open)
        self._open_lane(lane)

    def serve(self) -> None:
        """Serve the unserved lanes that still have no look-ahead, highest first."""
        if not self.unserved or not self._active():
            return
        for lane in [lane for lane in self.lanes if lane in self.unserved]:
            if self.lookahead(lane) == 0:
                self.renew(lane)
            else:
                self.unserved.discard(lane)

    def stop(self) -> None:
        if self._empty_timer is not None:
            self._empty_timer.cancel()
            self._empty_timer = None

    def _make_room(self, lane_in_need: str) -> bool:
        """Carry out ``take_room`` for ``lane_in_need``: True if the room is there now (a
        consumer cancelled), False if none is, or only from a cancel-ok or a give-back."""
        consumers = self._consumers
        ending = None
        if self.ending is not None and not self.cancel_ending:
            lane = consumers.lane_of.get(self.ending)
            if lane is not None:
                ending = (self.ending, lane)
        room, young = take_room(
            lane_in_need,
            self.lanes,
            idle=consumers.idle,
            waiting=self._waiting,
            opening=consumers.opening,
            peers=self._fair.peers[lane_in_need],
            ending=ending,
            leaving=bool(self.leaving),
            withdrawing=bool(consumers.withdrawing),
            withdrawable=consumers.withdrawable,
        )
        if young and self._empty_timer is None:  # retried once the youngest is old enough
            loop = asyncio.get_running_loop()
            self._empty_timer = loop.call_later(EMPTY_LANE_S, self._empty_time)
        if room is None:
            return False
        lane, tag = room.lane, room.tag
        if room.how == "surplus":
            message = self._waiting[lane].pop()
            tag = message.consumer_tag or ""
            consumers.forget(tag, lane)
            # Counted until it is given back (after its consumer's cancel-ok): the room
            # is there only then, and the unserved lane is served from there.
            self.leaving += 1
            consumers.spawn(self._give_back_surplus(message, tag, lane))
            return False
        if room.how == "withdraw":
            consumers.withdraw(tag, lane)
            return False
        if room.how == "ending":
            consumers.forget(tag, lane)
            self.cancel_ending = True  # release cancels it before the ack
        else:
            consumers.spawn(consumers.cancel(tag, lane))
        return True

    async def _give_back_surplus(
        self, message: AbstractIncomingMessage, tag: str, lane: str
    ) -> None:
        try:
            await self._consumers.cancel(tag, lane)  # forgotten already (``_make_room``)
            await self._give_back(message, "room for a higher lane's look-ahead")
        finally:
            self.leaving -= 1
        self.serve()

    def _empty_time(self) -> None:
        self._empty_timer = None
        self.serve()

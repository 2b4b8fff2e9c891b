"""Serving one handler's priority lanes (``Q.lane.urgent``, ``Q.lane.high``, ``Q``): the
waiting task of the highest lane starts first, and a lower lane is never starved forever.

The bound: a worker holds at most ``concurrency`` running messages plus one waiting message
per lane. Every consumer of a lane has prefetch 1, so it holds at most one message; a lane has
one *spare* consumer (its look-ahead: idle, or holding the one task waiting in that lane) plus
one consumer per running task of that lane. Consumers, and so held messages, are at most
``concurrency + lanes``.

Why not one consumer per lane whose prefetch follows the lane's running count: RabbitMQ
applies ``basic.qos`` (global=false) only to consumers created after it (measured on 3.10.8:
a consumer at prefetch 1 stayed at 1 after basic.qos 3), and quorum queues refuse global QoS.

When a task ends, before its message is settled (so the broker cannot hand its consumer a
message nobody planned for), the freed slot goes to the waiting task ``pick`` chooses:

- same lane as the task that ended: the ended task's consumer becomes the lane's spare (its
  ack lets the broker send it the next message). Nothing is opened or cancelled: the steady
  state of one busy lane costs what a single queue costs;
- another lane: the ended consumer is cancelled before its ack, and the chosen lane gets a
  new spare right away (so its next task is known at the next decision).

The anti-starvation rule (``pick``): a lane with a task waiting is passed over by at most
``starvation_limit`` starts of higher lanes; then its task starts next.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from ..publishing.connection import CLOSE_TIMEOUT_S, LINK_ERRORS

log = logging.getLogger("weclaw_mq.worker")

# A spare whose basic.consume is still on its way: the lane has its look-ahead coming.
_OPENING = "<opening>"
# After a lane's spare was opened (from its consume-ok) or re-armed (from the ack that frees
# it), how long lower lanes wait for that lane's next task: a queue with messages delivers one
# within a round trip, an empty one never does, and we cannot tell them apart sooner. A slot
# stays free that long only when a higher lane turns out to be empty: at the end of its burst.
LOOKAHEAD_GRACE_S = 0.02


def pick(
    lanes: Sequence[str],
    waiting: Sequence[str],
    skipped: dict[str, int],
    limit: int,
    pending: Collection[str] = (),
) -> str | None:
    """The lane whose waiting task starts next, updating ``skipped`` (pure: unit-tested).

    ``lanes`` is highest first; ``waiting`` the lanes with a task waiting. The highest
    waiting lane wins, unless a lower one was passed over ``limit`` times in a row: then the
    highest such starved lane wins. Each lower waiting lane passed over counts one skip.
    None (wait) when a lane above the winner is ``pending``: its spare consumer was just
    opened and its next task may be on the way (a starved lane does not wait).
    """
    candidates = [lane for lane in lanes if lane in waiting]
    if not candidates:
        return None
    starved = [lane for lane in candidates if skipped.get(lane, 0) >= limit]
    choice = starved[0] if starved else candidates[0]
    rank = lanes.index(choice)
    if not starved and any(lanes.index(lane) < rank for lane in pending):
        return None
    for lane in candidates:
        if lanes.index(lane) > rank:
            skipped[lane] = skipped.get(lane, 0) + 1
    skipped[choice] = 0
    return choice


class LaneScheduler:
    """The consumers of one handler's lanes on ``channel`` (which has prefetch 1), and the
    choice of the next task to start when a slot frees."""

    def __init__(
        self,
        channel: AbstractChannel,
        lanes: Sequence[str],
        *,
        concurrency: int,
        starvation_limit: int,
        start: Callable[[AbstractIncomingMessage], asyncio.Task[None]],
        give_back: Callable[[AbstractIncomingMessage, str], Awaitable[object]],
        redeclare: Callable[[], Awaitable[None]],
    ) -> None:
        self.channel = channel
        self.lanes = list(lanes)  # highest first
        self.concurrency = concurrency
        self.starvation_limit = starvation_limit
        self._start = start
        self._give_back = give_back
        self._redeclare = redeclare
        self._queues: dict[str, AbstractQueue] = {}
        self._lane_of: dict[str, str] = {}  # live consumer tag -> lane
        self._spare: dict[str, str | None] = dict.fromkeys(self.lanes)
        self._waiting: dict[str, AbstractIncomingMessage | None] = dict.fromkeys(self.lanes)
        # delivery tag -> (consumer tag, lane) of every running task
        self._running: dict[int, tuple[str, str]] = {}
        self._skipped: dict[str, int] = dict.fromkeys(self.lanes, 0)
        self._stopping = False
        self._background: set[asyncio.Task[None]] = set()
        # Lanes whose new spare may have a task on its way (see ``pick``'s pending), each
        # with the mark of its latest expectation (an older timer must not end a newer one).
        self._pending: dict[str, int] = {}
        self._marks = 0

    # -- what the worker calls ------------------------------------------------------------
    def owns(self, consumer_tag: str | None) -> bool:
        return consumer_tag is not None and consumer_tag in self._lane_of

    @property
    def held(self) -> int:
        """Messages this scheduler holds: running plus waiting (the bound: concurrency +
        lanes)."""
        return len(self._running) + sum(m is not None for m in self._waiting.values())

    async def start(self) -> None:
        for lane in self.lanes:
            self._queues[lane] = await self.channel.get_queue(lane, ensure=False)
            await self._open_spare(lane)

    async def release(self, message: AbstractIncomingMessage, *, reusable: bool = True) -> None:
        """A running task of ours is about to settle ``message``: free its slot, hand it on,
        and cancel its consumer first unless that consumer becomes a spare."""
        ended = self._running.pop(message.delivery_tag or 0, None)
        if ended is None or self._stopping:
            return
        tag, lane = ended
        reusable = reusable and tag in self._lane_of  # not cancelled by the broker
        chosen = self._pick()
        if chosen is not None:
            self._begin(chosen)
            if chosen == lane and reusable:
                self._spare[lane] = tag  # its ack re-arms it: the lane's next task comes to it
                self._expect(lane)
                return
            self._renew_spare(chosen)
        if reusable and self._spare[lane] is None:
            self._spare[lane] = tag
        else:
            await self._cancel(tag)
        self._fill()  # a slot left free while a higher lane's next task was on its way

    async def broker_cancelled(self, tag: str) -> None:
        """The broker cancelled one of our consumers (its queue was deleted, a leader moved):
        a running task still settles its message; a spare is replaced after a declare."""
        lane = self._lane_of.pop(tag, None)
        if lane is None or self._stopping or self._spare[lane] != tag:
            return
        log.warning("the broker cancelled our consumer of %r; consuming it again", lane)
        self._spare[lane] = None
        await self._redeclare()
        self._queues[lane] = await self.channel.get_queue(lane, ensure=False)
        await self._open_spare(lane)
        log.info("consuming %s again", lane)

    async def stop(self) -> None:
        """Take no new messages: cancel every consumer, give back the waiting ones."""
        self._stopping = True
        for task in list(self._background):
            task.cancel()
        for tag, lane in list(self._lane_of.items()):
            with contextlib.suppress(asyncio.TimeoutError, *LINK_ERRORS):
                await asyncio.wait_for(self._queues[lane].cancel(tag), CLOSE_TIMEOUT_S)
        for lane, message in self._waiting.items():
            if message is not None:
                self._waiting[lane] = None
                await self._give_back(message, "the worker is stopping")

    # -- inside ---------------------------------------------------------------------------
    async def _on_message(self, lane: str, message: AbstractIncomingMessage) -> None:
        if message.consumer_tag is not None:
            self._lane_of.setdefault(message.consumer_tag, lane)
        if self._stopping or self._waiting[lane] is not None:
            # Stopping; or (never expected) a second waiting task in one lane: given back,
            # so the bound holds and another worker can take it.
            why = "the worker is stopping" if self._stopping else "its lane already has one"
            await self._give_back(message, why)
            return
        self._pending.pop(lane, None)
        self._waiting[lane] = message
        self._fill()

    def _fill(self) -> None:
        """Start waiting tasks in free slots (no ended consumer to take over: each started
        lane gets a new spare)."""
        while len(self._running) < self.concurrency and not self._stopping:
            chosen = self._pick()
            if chosen is None:
                return
            self._begin(chosen)
            self._renew_spare(chosen)

    def _pick(self) -> str | None:
        waiting = [lane for lane, m in self._waiting.items() if m is not None]
        return pick(self.lanes, waiting, self._skipped, self.starvation_limit, self._pending)

    def _expect(self, lane: str, *, timed: bool = True) -> None:
        """Lower lanes wait for ``lane``'s next task (timed: for LOOKAHEAD_GRACE_S from now;
        else until ``_expect`` is called again with timed=True)."""
        if lane == self.lanes[-1]:
            return  # nothing below it waits
        self._marks += 1
        self._pending[lane] = self._marks
        if timed:
            loop = asyncio.get_running_loop()
            loop.call_later(LOOKAHEAD_GRACE_S, self._grace_over, lane, self._marks)

    def _grace_over(self, lane: str, mark: int) -> None:
        if self._pending.get(lane) == mark:
            del self._pending[lane]
            self._fill()

    def _begin(self, lane: str) -> None:
        message = self._waiting[lane]
        assert message is not None
        self._waiting[lane] = None
        self._running[message.delivery_tag or 0] = (message.consumer_tag or "", lane)
        self._spare[lane] = None
        task = self._start(message)
        # Every path through the delivery settles it (and so calls release); this frees the
        # slot if none did (a lost connection), with the consumer still holding the message.
        task.add_done_callback(functools.partial(self._ended, message))

    def _ended(self, message: AbstractIncomingMessage, _: object) -> None:
        if (message.delivery_tag or 0) in self._running:
            self._spawn(self.release(message, reusable=False))

    def _renew_spare(self, lane: str) -> None:
        """After a task of ``lane`` started: a new spare, whose task (if the lane has more)
        lower lanes wait for, up to LOOKAHEAD_GRACE_S after its consume-ok."""
        self._spare[lane] = _OPENING
        self._expect(lane, timed=False)
        self._spawn(self._open_spare(lane))

    async def _open_spare(self, lane: str) -> None:
        if self._stopping:
            return
        self._spare[lane] = _OPENING
        try:
            tag = await self._queues[lane].consume(functools.partial(self._on_message, lane))
        finally:
            if lane in self._pending:
                self._expect(lane)
        self._lane_of[tag] = lane
        self._spare[lane] = tag

    async def _cancel(self, tag: str) -> None:
        lane = self._lane_of.pop(tag, None)
        if lane is None:
            return
        with contextlib.suppress(asyncio.TimeoutError, *LINK_ERRORS):
            await asyncio.wait_for(self._queues[lane].cancel(tag), CLOSE_TIMEOUT_S)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background_ended)

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            # A consume that failed means the channel is gone: the session ends and the
            # reconnect consumes every lane afresh.
            log.warning("lane consumer change failed (%s: %s)", type(e).__name__, e)

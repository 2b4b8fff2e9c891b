"""The books of one handler's lane consumers on one channel (``LaneConsumers``): which exist,
in which lane, in which state, and the consume and cancel RPCs that change them.

A consumer is counted from before its consume is sent (``opening``, under our own tag, so
that an early delivery and the consume's return agree on which of them stops counting it as
opening), then is live (``lane_of``), idle while armed and holding nothing (``idle``), and
once cancelled by us its tag is remembered a while (``cancelled``) so that a delivery still
behind the cancel-ok goes back. A fair lane's consumer withdrawn to make room stays counted
until its cancel-ok (``withdrawing``), and, if a task reached it first, until that task is
released (``withdrawn``). The RPCs run as background tasks kept here until they end.

Which consumer to open or cancel, and when, the lane scheduler decides (``worker.lanes``);
this keeps the books. It knows two things of the scheduler, given as callbacks: whether a
consumer holds a task (``holds``) and that a withdrawal freed room (``freed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from weclaw_mq.wire.connection import CLOSE_TIMEOUT_S, LINK_ERRORS
from weclaw_mq.worker.lane_fairness import FairLanes

log = logging.getLogger("weclaw_mq.worker")

CANCELLED_MEMORY_S = 5.0
LANE_TAG = "weclaw-lane-"
# Tags of our bulk consumers (unique, so a delivery tells which channel it came on).
BULK_TAG = "weclaw-bulk-"

# Subscribes ``callback`` to a queue with our consumer tag; returns the tag (incoming.consume).
Subscribe = Callable[..., Awaitable[str]]
# A lane consumer's callback: called with each delivery.
Callback = Callable[[AbstractIncomingMessage], Awaitable[None]]


class LaneConsumers:
    """The consumers of ``lanes`` on ``channel``: counted, opened, cancelled, withdrawn.

    The scheduler and ``LaneServing`` read the books (``lane_of``, ``idle``, ``opening``,
    ``opening_tags``, ``cancelled``, the withdrawal sets, ``queues``, ``bulk``) directly, with
    no call per delivery, and change them only through the methods, except the
    ``opening[lane] += 1`` of a decision to open."""

    def __init__(
        self,
        channel: AbstractChannel,
        lanes: Sequence[str],
        *,
        subscribe: Subscribe,
        fair: FairLanes,
        holds: Callable[[str, str], bool],
        freed: Callable[[], None],
    ) -> None:
        self.channel = channel
        self._subscribe = subscribe
        self._fair = fair
        self._holds = holds  # (tag, lane): the consumer holds a task, waiting or running
        self._freed = freed  # a withdrawn consumer stopped counting: room may be there
        self.queues: dict[str, AbstractQueue] = {}
        self.lane_of: dict[str, str] = {}  # every live consumer tag -> its lane
        self.cancelled: set[str] = set()  # cancelled by us: a late delivery goes back
        self.idle: dict[str, set[str]] = {lane: set() for lane in lanes}
        # Consumers being opened, per lane: counted from the decision to open, before the
        # consume is sent (the cap holds while it is on its way).
        self.opening: dict[str, int] = dict.fromkeys(lanes, 0)
        # The tags of the consumers counted in opening whose consume was sent (see open).
        self.opening_tags: set[str] = set()
        # Fair lanes' consumers cancelled to make room, until their cancel-ok (``withdraw``):
        # still counted, and a delivery that reaches one first is kept and run, not given back.
        self.withdrawing: set[str] = set()
        # ... and those whose cancel-ok came while they held a task: forgotten at its release.
        self.withdrawn: set[str] = set()
        # The bulk consumer (the lowest lane's, on its own channel: ``worker.lanes``): its tag,
        # set before its consume is sent, None if there is none; and its queue object.
        self.bulk: str | None = None
        self.bulk_queue: AbstractQueue | None = None
        self._background: set[asyncio.Task[None]] = set()

    async def load_queue(self, lane: str) -> None:
        """The queue object of ``lane`` (at the start, and after a redeclare)."""
        self.queues[lane] = await self.channel.get_queue(lane, ensure=False)

    async def load_bulk_queue(self, channel: AbstractChannel, lane: str) -> None:
        """The queue object of the bulk consumer: ``lane`` on its own ``channel``."""
        self.bulk_queue = await channel.get_queue(lane, ensure=False)

    async def open_bulk(self, callback: Callback) -> None:
        """Consume the bulk queue, unless a bulk consumer is live (a second would be nobody's)."""
        assert self.bulk_queue is not None
        if self.bulk is not None:
            return
        tag = f"{BULK_TAG}{uuid.uuid4().hex}"
        self.bulk = tag  # before the consume: deliveries may come before its consume-ok
        await self._subscribe(self.bulk_queue, callback, consumer_tag=tag)

    def end_bulk(self) -> None:
        """Cancel the bulk consumer, if any, in the background (its running tasks still ack on
        its channel)."""
        tag, self.bulk = self.bulk, None
        if tag is not None and self.bulk_queue is not None:
            self.end_on(self.bulk_queue, tag)

    async def open(self, lane: str, callback: Callback, *, send: bool = True) -> str | None:
        """Consume ``lane`` (already counted in ``opening``; ``send``: False when the consume
        is no longer wanted): the new consumer's tag once it is live, or None (not sent, or
        cancelled before its consume-ok). It stops counting as opening either way."""
        # Our tag, not the broker's: known before the consume-ok, so an early delivery
        # (``live``) and this method agree on which of them stops counting it as opening.
        tag = f"{LANE_TAG}{uuid.uuid4().hex}"
        self.opening_tags.add(tag)
        live = False
        try:
            if send:
                await self._subscribe(self.queues[lane], callback, consumer_tag=tag)
                live = tag not in self.cancelled
        finally:
            # Counted as live before it stops counting as opening: in between, room would
            # seem to be there that is not (the cap + 1 consumers).
            if live:
                self.lane_of[tag] = lane
            if tag in self.opening_tags:  # else an early delivery did it (``live``)
                self.opening_tags.discard(tag)
                self.opening[lane] -= 1
        return tag if live else None

    def live(self, tag: str, lane: str) -> None:
        """The first delivery of ``tag`` came before its consume returned (the callback runs
        in the delivery's own task: see .incoming): counted as live from now on, not as
        opening, or the cap would count it twice and hold back a lane's spare."""
        self.opening_tags.discard(tag)
        self.opening[lane] -= 1
        self.lane_of[tag] = lane

    def armed(self, lane: str, tag: str) -> None:
        """``tag`` of ``lane`` is idle (armed) from now."""
        self.idle[lane].add(tag)
        if self._fair.served is not None:  # only fair lanes ask how long (``withdrawable``)
            self._fair.armed(tag, asyncio.get_running_loop().time(), self.idle)

    def rearm(self, lane: str, tag: str) -> None:
        """The task ``tag`` held went back unstarted: armed again by the nack, if it is still
        live and not withdrawn."""
        withdrawn = tag in self.withdrawing or tag in self.withdrawn
        if tag in self.lane_of and not withdrawn:
            self.armed(lane, tag)

    def pop_idle(self, lane: str) -> str:
        """The oldest idle tag of ``lane``, no longer idle."""
        # The oldest tag, not set.pop()'s: the same choice on every run (a replayable model).
        tag = min(self.idle[lane])
        self.idle[lane].discard(tag)
        return tag

    def withdrawable(self, lane: str) -> str | None:
        """An idle consumer of the fair lane ``lane`` old enough to withdraw (``FairLanes``)."""
        return self._fair.withdrawable(self.idle[lane], asyncio.get_running_loop().time())

    def forget(self, tag: str, lane: str) -> None:
        """``tag`` stops counting now: cancelled by us (its cancel is the caller's to send)."""
        self.lane_of.pop(tag, None)
        self.idle[lane].discard(tag)
        self.cancelled.add(tag)

    def lost(self, tag: str) -> str | None:
        """The broker cancelled ``tag``: forgotten; its lane, None if it was not live."""
        lane = self.lane_of.pop(tag, None)
        if lane is not None:
            self.idle[lane].discard(tag)
        return lane

    def cancel(self, tag: str, lane: str) -> Awaitable[None]:
        """Forget ``tag`` now; the awaitable sends its cancel."""
        self.forget(tag, lane)
        return self._cancel(tag, lane)

    async def _cancel(self, tag: str, lane: str) -> None:
        await self.cancel_on(self.queues[lane], tag)

    def drop(self, tag: str) -> None:
        """Forget a live consumer that will not be re-armed, cancelled in the background."""
        lane = self.lane_of.get(tag)
        if lane is not None:
            self.spawn(self.cancel(tag, lane))

    def end_on(self, queue: AbstractQueue, tag: str) -> None:
        """Cancel ``tag`` on ``queue`` in the background (the bulk consumer, or one not ours):
        a delivery still behind its cancel-ok goes back."""
        self.cancelled.add(tag)
        self.spawn(self.cancel_on(queue, tag))

    def disown(self, tag: str, queue: AbstractQueue) -> None:
        """One owner per consumer: a delivery came on ``tag``, which we do not count; it is
        cancelled (once), and the caller gives its delivery back."""
        log.warning(
            "a delivery of %s came on consumer %s, which no lane scheduler owns; cancelling "
            "it and giving the task back",
            queue.name,
            tag,
        )
        self.end_on(queue, tag)

    async def cancel_on(self, queue: AbstractQueue, tag: str) -> None:
        with contextlib.suppress(asyncio.TimeoutError, *LINK_ERRORS):
            await asyncio.wait_for(queue.cancel(tag), CLOSE_TIMEOUT_S)
        # Deliveries sent before the cancel-ok are behind us by now; the tag is kept a while
        # longer for one still being dispatched, then forgotten (no growth with time).
        asyncio.get_running_loop().call_later(CANCELLED_MEMORY_S, self.cancelled.discard, tag)

    def withdraw(self, tag: str, lane: str) -> None:
        """Cancel the idle ``tag`` to make room: it stays counted (a delivery that reaches it
        before its cancel-ok waits and runs as any other) until the cancel-ok; then it is
        forgotten if it holds nothing, else when its task is released (``released``)."""
        self.idle[lane].discard(tag)
        self.withdrawing.add(tag)
        self.spawn(self._withdrawal(tag, lane))

    async def _withdrawal(self, tag: str, lane: str) -> None:
        try:
            await self._cancel(tag, lane)
        finally:
            self.withdrawing.discard(tag)
            self.cancelled.add(tag)  # a delivery still behind the cancel-ok goes back
        if self._holds(tag, lane) and tag in self.lane_of:
            self.withdrawn.add(tag)
        else:
            self.lane_of.pop(tag, None)
        self._freed()

    def released(self, tag: str) -> None:
        """The task of the withdrawn ``tag`` was released: it is forgotten if its cancel-ok
        came (else at the cancel-ok)."""
        if tag in self.withdrawn:
            self.withdrawn.discard(tag)
            self.lane_of.pop(tag, None)

    async def cancel_every(self) -> None:
        """Forget and cancel every live consumer (the breaker paused the lanes)."""
        for tag, lane in list(self.lane_of.items()):
            await self.cancel(tag, lane)

    async def stop(self) -> None:
        """Let the consumer changes under way end, then cancel every live consumer, the bulk
        one last."""
        if self._background:
            # Not cancelled: aiormq closes the channel under a cancelled consume RPC, and the
            # running tasks still need it for their acks.
            await asyncio.wait(set(self._background), timeout=CLOSE_TIMEOUT_S)
        for tag, lane in list(self.lane_of.items()):
            with contextlib.suppress(asyncio.TimeoutError, *LINK_ERRORS):
                await asyncio.wait_for(self.queues[lane].cancel(tag), CLOSE_TIMEOUT_S)
        if self.bulk is not None and self.bulk_queue is not None:
            with contextlib.suppress(asyncio.TimeoutError, *LINK_ERRORS):
                await asyncio.wait_for(self.bulk_queue.cancel(self.bulk), CLOSE_TIMEOUT_S)

    def spawn(self, work: Awaitable[None]) -> None:
        """Run ``work`` in the background, kept until it ends (``stop`` waits for it)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background_ended)

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            # A consume that failed means the channel is gone: the session ends and the
            # reconnect consumes every lane afresh.
            log.warning("lane consumer change failed (%s: %s)", type(e).__name__, e)

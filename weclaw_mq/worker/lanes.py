"""Serving one handler's priority lanes (``Q.lane.urgent``, ``Q.lane.high``, ``Q``): the
waiting task of the highest lane starts first, and a lower lane is never starved forever.

The bound: a worker holds at most ``concurrency + lanes`` messages of a handler (running ones
included). Every lane consumer has prefetch 1, so it holds at most one message, and we never
have more than ``concurrency + lanes`` consumers (opening counted).

Why not one consumer per lane whose prefetch follows the lane's running count: RabbitMQ
applies ``basic.qos`` (global=false) only to consumers created after it (measured on 3.10.8:
a consumer at prefetch 1 stayed at 1 after basic.qos 3), and quorum queues refuse global QoS.

Each lane keeps at least one consumer that is not running a task (its look-ahead: armed, or
holding the lane's waiting task). A consumer whose task ended stays, re-armed by its ack, so
a busy lane keeps its consumers as one prefetch-C consumer would keep its window, with nothing
opened or cancelled. Only when a lane has no look-ahead left (its last waiting task started)
and the cap is reached is a consumer cancelled to make room, as ``lane_room.take_room``
decides: the one whose task is ending (cancelled before its ack, so the broker never sends it
another), an armed idle one of a lane that has another look-ahead, else a surplus waiting task
of the lowest such lane is given back.

The slot a task frees goes to the waiting task ``lane_priority.LanePriorities`` chooses: the
highest lane's, unless a lower lane was starved; a lane whose look-ahead was just started
makes lower lanes wait for it up to a grace that follows the broker's round trip.

Bulk mode (given a ``bulk_channel``): while the upper lanes are quiet, the lowest lane is
served by ONE consumer with prefetch ``concurrency + 1`` on its own channel (its acks go on
that channel), each upper lane by one armed prefetch-1 consumer: the same bound (C + 1 + one
per upper lane), with the broker serving 3 consumers instead of C + 3 (measured on 3.10: C + 3
prefetch-1 consumers cost the broker ~10% of throughput at C = 100). A worker starts in bulk
mode. The first upper-lane task to start (at the next free slot, as ``pick`` chooses) ends
it: the bulk consumer is cancelled, its waiting tasks are given back, its running ones finish
and are acked on the bulk channel (counted against the cap until then), and the lanes are
served per consumer as above. Bulk mode comes back once the worker is idle (nothing running
or waiting) and no upper-lane task was delivered for ``BULK_QUIET_S``: a prefetch-(C + 1)
consumer can only be opened while the lowest lane holds nothing (a consumer's prefetch is
fixed when it is created), and waiting for idle costs no throughput, unlike draining a busy
lane to make room. The circuit breaker's pause and the broker's cancel of the bulk consumer
also end bulk mode.

Fair share (``levels``, ``policy.fair_share``): lanes of one level are a handler's fair lanes,
taken in turn, that take room from each other without giving any task back
(``lane_fairness.FairLanes``): a withdrawn idle consumer is still counted until its
cancel-ok, so a task the broker sent it meanwhile waits and runs there. No bulk mode: the
lowest level is several tenants' lanes.

One owner per consumer: a scheduler counts every consumer it opens from before its consume is
sent; a delivery on any other consumer is never adopted (that consumer is cancelled, the task
given back), and a scheduler whose session ended (``retire``) starts nothing. The net behind
that: a sweep every ``held_bound_s / 2`` gives back a delivery held unstarted that long while
a slot is free (``lane_sweep``). ``tests/unit/test_lanes_model.py`` checks these rules on a
model broker.

The parts, each readable alone: this module starts the tasks and runs the bulk mode;
``lane_consumers`` keeps the consumers' books (opening, live, idle, cancelled, withdrawn) and
sends their consume and cancel RPCs; ``lane_serving`` keeps a look-ahead per lane under the
cap, carrying out ``lane_room.take_room``; ``lane_sweep`` is the held-delivery net.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from weclaw_mq.worker.incoming import consume
from weclaw_mq.worker.lane_consumers import BULK_TAG, LaneConsumers, Subscribe
from weclaw_mq.worker.lane_fairness import FairLanes
from weclaw_mq.worker.lane_priority import LanePriorities
from weclaw_mq.worker.lane_serving import LaneServing
from weclaw_mq.worker.lane_sweep import HELD_BOUND_S, HeldSweep

log = logging.getLogger("weclaw_mq.worker")

# Bulk mode comes back only after no upper-lane task was delivered for this long (and the
# worker is idle): an occasional URGENT task does not flap the consumers at every task, and
# a switch (a cancel, a consume) costs two round trips, nothing next to a second.
BULK_QUIET_S = 1.0


class LaneScheduler:
    """One handler's lanes on ``channel`` (which has prefetch 1): the tasks their consumers
    hold, started when a slot frees as the lane policies decide (``lane_priority``,
    ``lane_fairness``), and the bulk mode. The consumers' books are ``LaneConsumers``', each
    lane's look-ahead under the cap ``LaneServing``'s, the held-delivery net ``HeldSweep``'s."""

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
        bulk_channel: AbstractChannel | None = None,
        subscribe: Subscribe = consume,
        held_bound_s: float = HELD_BOUND_S,
        on_held: Callable[[], None] | None = None,
        levels: Sequence[int] | None = None,
    ) -> None:
        self.channel = channel
        self.lanes = list(lanes)  # highest first
        self._lowest = self.lanes[-1]
        self._upper = tuple(self.lanes[:-1])
        # Each lane's level (``pick``'s levels): lanes sharing one are fair-share lanes, served
        # in turn; None: one lane a level. Built once, not per choice.
        ranks = list(levels) if levels is not None else list(range(len(self.lanes)))
        rank_of = dict(zip(self.lanes, ranks, strict=True))
        # The decisions: which lane starts next (with the grace lower lanes wait), and the
        # fair lanes' peers, turns and withdrawable idle consumers.
        self._priorities = LanePriorities(self.lanes, rank_of, starvation_limit=starvation_limit)
        self._fair = FairLanes(rank_of, memory=4 * (concurrency + len(self.lanes)))
        # The books of our consumers (opening, live, idle, cancelled, withdrawn; the bulk one)
        # and the background tasks that open and cancel them; ``subscribe`` is how a consumer
        # is subscribed (incoming.consume; the lanes' model test gives its own).
        self._consumers = LaneConsumers(
            channel,
            self.lanes,
            subscribe=subscribe,
            fair=self._fair,
            holds=self._holds,
            freed=lambda: self._serving.serve(),
        )
        self._spawn = self._consumers.spawn
        # The channel of the bulk consumer (prefetch concurrency + 1), None: no bulk mode. Not
        # for fair lanes: the lowest level is several tenants' lanes, a bulk consumer would
        # serve one of them, and leaving bulk mode gives back what it held.
        self.bulk_channel = None if self._fair.peers[self._lowest] else bulk_channel
        # Each lane's consumer callback: a plain coroutine function, which aio-pika recognises
        # per delivery with fewer calls than a functools.partial.
        self._deliveries = {lane: self._delivery_callback(lane) for lane in self.lanes}
        self.concurrency = concurrency
        self.cap = concurrency + len(self.lanes)
        self._start = start
        self._give_back = give_back
        self._redeclare = redeclare
        self._waiting: dict[str, deque[AbstractIncomingMessage]] = {
            lane: deque() for lane in self.lanes
        }
        # delivery tag -> (consumer tag, lane) of every running task
        self._running: dict[int, tuple[str, str]] = {}
        # The lane whose waiting task starts next, or None (``LanePriorities.choose``): a
        # partial, not a method that delegates, for one call fewer per delivery.
        self._choose: Callable[[], str | None] = functools.partial(
            self._priorities.choose, self._waiting, self._fair.served, self._running_per_lane
        )
        self._stopping = False
        # Set once a stop has cancelled every consumer of ours: from then on a delivery that
        # still arrives is given back at once (before, it would come straight back to us).
        self._consumers_cancelled = False
        # Paused by the circuit breaker: no consumer is opened; waiting tasks still start
        # (and are deferred by the breaker, ``delivery``).
        self._paused = False
        # Each lane keeps a look-ahead under the cap (room made as ``take_room`` decides).
        self._serving = LaneServing(
            self.lanes,
            consumers=self._consumers,
            waiting=self._waiting,
            fair=self._fair,
            priorities=self._priorities,
            give_back=give_back,
            full=lambda: self.consumers >= self.cap,
            active=lambda: not (self._stopping or self._paused),
            open_lane=lambda lane: self._spawn(self._open(lane)),
        )
        # Bulk mode, and the running tasks the bulk consumer delivered (delivery tag on
        # bulk_channel -> consumer tag), also after it was cancelled.
        self._bulk_mode = self.bulk_channel is not None
        self._bulk_running: dict[int, str] = {}
        self._entering_bulk = False
        self._upper_seen = -BULK_QUIET_S  # loop time of the latest upper-lane delivery
        self._bulk_timer: asyncio.TimerHandle | None = None
        # The held-delivery net (``lane_sweep``): gives back a delivery waiting too long.
        self._sweep = HeldSweep(
            self._waiting,
            bound_s=held_bound_s,
            free=self._free_slot,
            held=self._held,
            swept=self._fill,
            on_held=on_held,
        )

    # -- what the worker calls ------------------------------------------------------------
    def owns(self, message: AbstractIncomingMessage) -> bool:
        """``message`` is a running task of ours (delivery tags are unique per channel; the
        bulk consumer's tag tells its channel)."""
        if (message.consumer_tag or "").startswith(BULK_TAG):
            return (message.delivery_tag or 0) in self._bulk_running
        return (message.delivery_tag or 0) in self._running

    @property
    def consumers(self) -> int:
        """Messages we may hold, counted as consumers (opening ones included; the bulk
        consumer counts its prefetch, a cancelled one its running tasks): never over ``cap``."""
        consumers = self._consumers
        held = len(consumers.lane_of) + sum(consumers.opening.values()) + self._serving.leaving
        if self._bulk_mode:
            return held + self.concurrency + 1
        return held + len(self._bulk_running)

    @property
    def bulk(self) -> bool:
        """The lowest lane is served by one prefetch-(C + 1) consumer (see the module doc)."""
        return self._bulk_mode

    def schedules(self, tag: str) -> bool:
        """``tag`` is one of our consumers, live or being opened (one owner per consumer)."""
        consumers = self._consumers
        return tag in consumers.lane_of or tag == consumers.bulk or tag in consumers.opening_tags

    def pending_lanes(self) -> list[str]:
        """Lanes whose next task may be on its way, so lower lanes wait (``pick``'s pending)."""
        return list(self._priorities.pending)

    @property
    def grace(self) -> float:
        """How long lower lanes wait for a higher lane's next task (``LanePriorities``)."""
        return self._priorities.grace

    async def start(self) -> None:
        self._sweep.arm()
        for lane in self.lanes:
            await self._consumers.load_queue(lane)
        if self.bulk_channel is not None:
            await self._consumers.load_bulk_queue(self.bulk_channel, self._lowest)
        first = self._upper if self._bulk_mode else self.lanes
        for lane in first:  # all counted before the first consume: its deliveries may grow a
            self._consumers.opening[lane] += 1  # lane toward the cap while the others open
        for lane in first:
            await self._open(lane)
        if self._bulk_mode:
            await self._consumers.open_bulk(self._on_bulk)
        elif self._serving.lookahead(self._lowest) == 0 and self.bulk_channel is not None:
            # bulk mode ended (an upper task started) before the lowest lane was opened
            self._serving.renew(self._lowest)

    async def release(self, message: AbstractIncomingMessage, *, reusable: bool = True) -> None:
        """A running task of ours is about to settle ``message``: free its slot and start
        the next task; its consumer stays (re-armed by the ack) unless room is needed, then
        it is cancelled here, before the ack."""
        if (message.consumer_tag or "").startswith(BULK_TAG):
            if self._bulk_running.pop(message.delivery_tag or 0, None) is None or self._stopping:
                return
            self._serving.serve()  # a cancelled bulk consumer's task frees room under the cap
            self._fill()
            self._maybe_bulk()
            return
        ended = self._running.pop(message.delivery_tag or 0, None)
        if ended is None or self._stopping:
            return
        tag, lane = ended
        consumers, serving = self._consumers, self._serving
        if tag in consumers.withdrawing or tag in consumers.withdrawn:
            # Withdrawn to make room (``LaneConsumers.withdraw``) after this task came: never
            # re-armed; forgotten now if its cancel-ok came, else then.
            consumers.released(tag)
            serving.serve()
            self._fill()
            return
        if not (reusable and tag in consumers.lane_of):  # broker-cancelled, or no ack coming
            consumers.drop(tag)
            serving.serve()
            self._fill()
            return
        consumers.armed(lane, tag)
        serving.ending, serving.cancel_ending = tag, False
        try:
            serving.serve()
            self._fill()
        finally:
            serving.ending = None
        if serving.cancel_ending:
            await consumers.cancel(tag, lane)
        self._maybe_bulk()

    async def broker_cancelled(self, tag: str) -> None:
        """The broker cancelled one of our consumers (its queue was deleted, a leader moved):
        a running task still settles its message; a lane left without a look-ahead gets a
        new consumer after a declare."""
        if tag == self._consumers.bulk and not self._stopping:
            self._leave_bulk(renew=False)
            await self._consume_again(self._lowest)
            return
        lane = self._consumers.lost(tag)
        if lane is None or self._stopping or self._serving.lookahead(lane):
            return
        await self._consume_again(lane)

    async def _consume_again(self, lane: str) -> None:
        log.warning("the broker cancelled our consumer of %r; consuming it again", lane)
        await self._redeclare()
        await self._consumers.load_queue(lane)
        self._consumers.opening[lane] += 1
        await self._open(lane)
        log.info("consuming %s again", lane)

    async def pause(self) -> None:
        """Take no new messages until ``resume``: cancel every consumer (the breaker opened)."""
        self._paused = True
        if self._bulk_mode:
            self._leave_bulk(renew=False)
        await self._consumers.cancel_every()

    async def resume(self) -> None:
        """Consume again: one consumer for each lane without a look-ahead, as at start."""
        self._paused = False
        for lane in self.lanes:
            lookahead = self._serving.lookahead(lane)
            if lookahead == 0 and self.consumers < self.cap and not self._stopping:
                self._consumers.opening[lane] += 1
                await self._open(lane)

    async def fetch(self) -> AbstractIncomingMessage | None:
        """One task by basic.get, highest lane first (the breaker's probe), or None."""
        for lane in self.lanes:
            message = await self._consumers.queues[lane].get(no_ack=False, fail=False)
            if message is not None:
                return message
        return None

    def retire(self) -> None:
        """Our session ended without a stop (its connection is lost or being closed): start
        nothing any more, and give back what still reaches us. The waiting deliveries are
        forgotten, not nacked: the closing connection returns them all at once."""
        self._stopping = True
        self._consumers_cancelled = True  # what still reaches us is given back, as before
        self._stop_timers()
        for waiting in self._waiting.values():
            waiting.clear()

    def _stop_timers(self) -> None:
        self._sweep.stop()
        self._serving.stop()
        if self._bulk_timer is not None:
            self._bulk_timer.cancel()
            self._bulk_timer = None

    async def stop(self) -> None:
        """Take no new messages: cancel every consumer, give back the waiting ones."""
        self._stopping = True
        self._stop_timers()
        await self._consumers.stop()  # the changes under way end first, then the cancels
        self._consumers_cancelled = True
        for waiting in self._waiting.values():
            while waiting:
                await self._give_back(waiting.popleft(), "the worker is stopping")

    # -- inside ---------------------------------------------------------------------------
    def _delivery_callback(
        self, lane: str
    ) -> Callable[[AbstractIncomingMessage], Coroutine[Any, Any, None]]:
        async def on_message(message: AbstractIncomingMessage) -> None:
            await self._on_message(lane, message)

        return on_message

    def _parked_for_the_stop(self, lane: str, message: AbstractIncomingMessage) -> bool:
        """While a stop has not cancelled our consumers yet, a delivery is held with the
        waiting ones, which the stop gives back after the cancels: given back now, it would
        be delivered straight back to a live consumer of ours, each return counting toward
        the queue's delivery limit (a loop of them dead-lettered a task in a loaded run)."""
        if not self._stopping or self._consumers_cancelled:
            return False
        self._waiting[lane].append(message)
        return True

    async def _on_message(self, lane: str, message: AbstractIncomingMessage) -> None:
        tag = message.consumer_tag or ""
        if self._parked_for_the_stop(lane, message):
            return
        consumers = self._consumers
        if self._stopping or tag in consumers.cancelled:
            # Stopping, or it reached a consumer we had just cancelled: given back, so
            # another worker (or our next look-ahead) takes it.
            why = "the worker is stopping" if self._stopping else "its consumer was cancelled"
            await self._give_back(message, why)
            return
        if tag in consumers.opening_tags:
            consumers.live(tag, lane)  # its first delivery, before its consume() returned
        elif tag not in consumers.lane_of:
            # A consumer we do not schedule: never adopted (the cap would not count it);
            # cancelled so that it takes nothing more, and its delivery goes back.
            consumers.disown(tag, consumers.queues[lane])
            await self._give_back(message, "its consumer is not ours")
            return
        consumers.idle[lane].discard(tag)
        priorities = self._priorities
        if lane in priorities.pending or lane in priorities.expected_at:
            priorities.delivered(lane, asyncio.get_running_loop().time())
        if lane != self._lowest:
            self._upper_seen = asyncio.get_running_loop().time()
        self._waiting[lane].append(message)
        self._fill()

    async def _on_bulk(self, message: AbstractIncomingMessage) -> None:
        tag = message.consumer_tag or ""
        if self._parked_for_the_stop(self._lowest, message):
            return
        if self._stopping or tag in self._consumers.cancelled:
            why = "the worker is stopping" if self._stopping else "its consumer was cancelled"
            await self._give_back(message, why)
            return
        if tag != self._consumers.bulk:
            assert self._consumers.bulk_queue is not None
            self._consumers.disown(tag, self._consumers.bulk_queue)
            await self._give_back(message, "its consumer is not ours")
            return
        self._waiting[self._lowest].append(message)
        self._fill()

    def _free_slot(self) -> bool:
        return len(self._running) + len(self._bulk_running) < self.concurrency

    def _held(self, lane: str, message: AbstractIncomingMessage) -> None:
        """The sweep took ``message`` out of ``lane``'s waiting ones: given back; its consumer
        is re-armed by the nack (a bulk window stays)."""
        self._spawn(self._give_back_one(message, "held without starting"))
        self._consumers.rearm(lane, message.consumer_tag or "")

    def _holds(self, tag: str, lane: str) -> bool:
        """Consumer ``tag`` of ``lane`` holds a task, waiting or running."""
        return any(m.consumer_tag == tag for m in self._waiting[lane]) or any(
            t == tag for t, _ in self._running.values()
        )

    def _fill(self) -> None:
        """Start waiting tasks in free slots, highest lane first."""
        while len(self._running) + len(self._bulk_running) < self.concurrency:
            if self._stopping:
                return
            chosen = self._choose()
            if chosen is None:
                return
            message = self._waiting[chosen].popleft()
            tag = message.consumer_tag or ""
            if self._fair.served is not None:
                self._fair.started(chosen)
            if self._bulk_mode:
                if chosen == self._lowest:
                    self._bulk_running[message.delivery_tag or 0] = tag
                    self._start(message).add_done_callback(
                        functools.partial(self._ended_bulk, message)
                    )
                    continue
                self._leave_bulk(renew=True)  # an upper lane is busy: per-consumer mode
            self._running[message.delivery_tag or 0] = (tag, chosen)
            task = self._start(message)
            # Every path through the delivery settles it (and so calls release); this frees
            # the slot if none did (a lost connection: no ack will re-arm the consumer).
            task.add_done_callback(functools.partial(self._ended, message))
            if self._paused:
                continue  # no consumer is renewed or added while paused
            if not self._waiting[chosen]:
                if self._serving.lookahead(chosen) == 0:
                    self._serving.renew(chosen)
                elif chosen in self._priorities.above_lowest:  # nothing below the lowest waits
                    self._expect(chosen)
            if self.consumers < self.cap:
                # Grow toward the cap in the lane that is busy: prefetch-1 consumers are the
                # window a single prefetch-C consumer would have (fast handlers need it).
                self._consumers.opening[chosen] += 1
                self._spawn(self._open(chosen))

    def _running_per_lane(self) -> dict[str, int]:
        """How many tasks of each lane run (fair lanes' turns; counted when asked, not kept)."""
        counts = dict.fromkeys(self.lanes, 0)
        for _, lane in self._running.values():
            counts[lane] += 1
        counts[self._lowest] += len(self._bulk_running)
        return counts

    def _ended_bulk(self, message: AbstractIncomingMessage, _: object) -> None:
        if (message.delivery_tag or 0) in self._bulk_running:
            self._spawn(self.release(message, reusable=False))

    # -- bulk mode --------------------------------------------------------------------------
    def _leave_bulk(self, *, renew: bool) -> None:
        """Cancel the bulk consumer: its waiting tasks go back, its running ones finish (and
        count against the cap until then); ``renew``: the lowest lane gets a consumer."""
        self._bulk_mode = False
        self._consumers.end_bulk()
        waiting = self._waiting[self._lowest]
        while waiting:
            self._spawn(self._give_back_one(waiting.pop(), "the lanes left bulk mode"))
        log.debug("lanes of %s: per-consumer mode", self._lowest)
        if renew and not self._paused and not self._stopping:
            self._serving.renew(self._lowest)

    async def _give_back_one(self, message: AbstractIncomingMessage, why: str) -> None:
        await self._give_back(message, why)

    def _maybe_bulk(self) -> None:
        """Enter bulk mode if the worker is idle and the upper lanes have been quiet for
        ``BULK_QUIET_S`` (else check again when that time is up)."""
        if (
            self.bulk_channel is None
            or self._bulk_mode
            or self._entering_bulk
            or self._paused
            or self._stopping
            or self._running
            or self._bulk_running
            or self._serving.unserved
            or any(self._waiting.values())
            or any(self._consumers.opening.values())
        ):
            return
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._upper_seen
        if quiet < BULK_QUIET_S:
            if self._bulk_timer is None:
                self._bulk_timer = loop.call_later(BULK_QUIET_S - quiet, self._bulk_time)
            return
        self._entering_bulk = True
        self._spawn(self._enter_bulk())

    def _bulk_time(self) -> None:
        self._bulk_timer = None
        self._maybe_bulk()

    async def _enter_bulk(self) -> None:
        try:
            # The lowest lane's consumers and every upper lane's surplus (all idle: nothing
            # runs or waits) are cancelled first; a delivery racing the cancel goes back.
            consumers = self._consumers
            cancels = []
            for lane in self.lanes:
                keep = 0 if lane == self._lowest else 1
                while len(consumers.idle[lane]) > keep:
                    cancels.append(consumers.cancel(consumers.pop_idle(lane), lane))
            await asyncio.gather(*cancels)
            if (
                self._paused
                or self._stopping
                or self._running
                or self._bulk_running
                or any(self._waiting.values())
                or any(consumers.opening.values())
                or any(len(consumers.idle[lane]) > 1 for lane in self._upper)
                or consumers.idle[self._lowest]
            ):
                # Busy again while we cancelled: stay per consumer.
                if not self._paused and not self._stopping:
                    self._serving.serve()
                    if self._serving.lookahead(self._lowest) == 0:
                        self._serving.renew(self._lowest)
                return
            for lane in self._upper:  # each upper lane keeps one armed look-ahead
                if self._serving.lookahead(lane) == 0:
                    self._serving.renew(lane)
            self._bulk_mode = True
            await self._consumers.open_bulk(self._on_bulk)
            log.debug("lanes of %s: bulk mode", self._lowest)
        finally:
            self._entering_bulk = False

    def _ended(self, message: AbstractIncomingMessage, _: object) -> None:
        if (message.delivery_tag or 0) in self._running:
            self._spawn(self.release(message, reusable=False))

    def _expect(self, lane: str) -> None:
        """Lower lanes wait for ``lane``'s next task for the grace from now."""
        loop = asyncio.get_running_loop()
        mark = self._priorities.expect(lane, loop.time())
        if mark is not None:
            loop.call_later(self._priorities.grace, self._grace_over, lane, mark)

    def _grace_over(self, lane: str, mark: int) -> None:
        if self._priorities.grace_over(lane, mark):
            self._fill()

    async def _open(self, lane: str) -> None:
        """Consume ``lane`` (counted in its opening by the caller), unless stopping or paused
        by then; the unserved lanes are served once it stops counting as opening."""
        tag = None
        try:
            send = not (self._stopping or self._paused)
            tag = await self._consumers.open(lane, self._deliveries[lane], send=send)
        finally:
            if tag is not None:
                self._opened(tag, lane)
            if lane in self._priorities.pending:
                self._expect(lane)
            self._serving.serve()

    def _opened(self, tag: str, lane: str) -> None:
        """The consume of ``tag`` completed and it is live (stop() cancels every live one):
        idle unless its first delivery came already; dropped if the breaker paused us."""
        if self._stopping:
            return
        if self._paused:
            self._consumers.drop(tag)  # opened as the breaker paused us
        elif not self._holds(tag, lane):
            self._consumers.armed(lane, tag)

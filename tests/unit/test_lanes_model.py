"""A model-based test of the lane scheduler (``worker.lanes``): hypothesis drives arrivals,
completions, slow broker answers, mode switches (upper-lane tasks, idle quiet time) and lost
connections against the real ``LaneScheduler`` over a model of the broker's consumers, on an
event loop whose clock only moves when the test says so.

The model broker is what RabbitMQ does for one channel's consumers, no more: a consumer
exists from the broker's handling of its basic.consume until its basic.cancel (RPCs answered
in order per channel, each answer when the test lets it come: a slow start-up is a consume
left unanswered); a consumer is sent a message while it holds fewer than its prefetch; a
message stays unacked on its channel until acked or nacked, also after its consumer was
cancelled; a lost connection returns every unacked message and ends every consumer.

After every step (with the loop run until nothing is ready) the invariants hold:
- the worker holds at most ``concurrency + lanes`` messages (the documented bound);
- every consumer on the broker belongs to the live scheduler (one owner per consumer);
- no delivery waits while a slot is free: a message held but not started means every slot
  runs a task, or a higher lane's next task may be one answer away (``pick``'s pending).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiormq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weclaw_mq.worker import lane_consumers as consumers_module
from weclaw_mq.worker.lane_priority import LOOKAHEAD_GRACE_S
from weclaw_mq.worker.lanes import LaneScheduler

LANES = ["urgent", "high", "normal"]  # highest first; the lowest is the handler queue
CONCURRENCY = 3
# Fair share (policy.fair_share): the NORMAL level is three lanes served in turn.
FAIR_LANES = ["urgent", "high", "f1", "f2", "normal"]
FAIR_LEVELS = [0, 1, 2, 2, 2]
# A fair handler without priorities: its lanes are all of one level.
FAIR_ONLY_LANES = ["f1", "f2", "normal"]
FAIR_ONLY_LEVELS = [0, 0, 0]


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` moves only by ``advance``: timers fire when the test
    says, never by the wall clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now


@dataclass(eq=False)
class Msg:
    """A delivery as the scheduler sees it (the attributes it reads), and where it is."""

    n: int
    lane: str
    consumer_tag: str | None = None
    delivery_tag: int | None = None
    channel: ModelChannel | None = None
    started: bool = False
    released: bool = False

    @property
    def message_id(self) -> str:
        return f"task-{self.n}"


@dataclass(eq=False)
class Consumer:
    tag: str
    queue: str
    channel: ModelChannel
    callback: Callable[[Any], Awaitable[None]]
    unacked: set[Msg] = field(default_factory=set)


@dataclass(eq=False)
class ModelChannel:
    broker: ModelBroker
    prefetch: int
    alive: bool = True
    tags: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    # RPCs sent and not answered yet, in order: (kind, argument, future of the answer)
    rpcs: deque[tuple[str, Any, asyncio.Future[Any]]] = field(default_factory=deque)
    unacked: set[Msg] = field(default_factory=set)

    async def get_queue(self, name: str, ensure: bool = False) -> ModelQueue:
        return ModelQueue(self, name)

    async def rpc(self, kind: str, argument: Any) -> Any:
        if not self.alive:
            raise aiormq.exceptions.ChannelInvalidStateError("channel closed")
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.rpcs.append((kind, argument, answer))
        try:
            return await answer
        except asyncio.CancelledError:
            # aiormq closes a channel whose RPC was cancelled (a timeout): the session ends
            self.broker.lose([self])
            raise


@dataclass(eq=False)
class ModelQueue:
    channel: ModelChannel
    name: str

    async def cancel(self, tag: str) -> None:
        await self.channel.rpc("cancel", tag)

    async def get(self, no_ack: bool = False, fail: bool = False) -> None:
        return None


class ModelBroker:
    def __init__(self, loop: asyncio.AbstractEventLoop, lanes: list[str]) -> None:
        self.loop = loop
        self.ready: dict[str, deque[Msg]] = {lane: deque() for lane in lanes}
        self.consumers: dict[str, Consumer] = {}

    async def subscribe(
        self, queue: ModelQueue, callback: Callable[[Any], Awaitable[None]], *, consumer_tag: str
    ) -> str:
        assert consumer_tag not in self.consumers, "a consumer tag used twice"
        await queue.channel.rpc("consume", (queue.name, callback, consumer_tag))
        return consumer_tag

    def answer(self, channel: ModelChannel) -> None:
        """The broker handles the channel's next RPC and answers it."""
        kind, argument, answer = channel.rpcs.popleft()
        if kind == "consume":
            name, callback, tag = argument
            self.consumers[tag] = Consumer(tag, name, channel, callback)
        else:
            self.consumers.pop(argument, None)
        if not answer.done():
            answer.set_result(None)

    def deliverable(self) -> list[Consumer]:
        return [
            c
            for c in self.consumers.values()
            if c.channel.alive and self.ready[c.queue] and len(c.unacked) < c.channel.prefetch
        ]

    def deliver(self, consumer: Consumer) -> None:
        task = self.ready[consumer.queue].popleft()
        message = Msg(task.n, task.lane)  # each delivery its own object, as aiormq's
        channel = consumer.channel
        message.consumer_tag = consumer.tag
        message.delivery_tag = next(channel.tags)
        message.channel = channel
        consumer.unacked.add(message)
        channel.unacked.add(message)
        self.loop.create_task(consumer.callback(message))

    def settle(self, message: Msg, *, requeue: bool) -> None:
        channel = message.channel
        if channel is None or not channel.alive or message not in channel.unacked:
            raise aiormq.exceptions.ChannelInvalidStateError("not on an open channel")
        channel.unacked.discard(message)
        for consumer in self.consumers.values():
            consumer.unacked.discard(message)
        if requeue:
            self.ready[message.lane].appendleft(Msg(message.n, message.lane))

    def lose(self, channels: list[ModelChannel]) -> None:
        """The connection of ``channels`` closes: unacked messages return, consumers end,
        RPCs in flight fail."""
        for channel in channels:
            channel.alive = False
            for message in sorted(channel.unacked, key=lambda m: -m.n):
                self.ready[message.lane].appendleft(Msg(message.n, message.lane))
            channel.unacked.clear()
            while channel.rpcs:
                _, _, answer = channel.rpcs.popleft()
                if not answer.done():
                    answer.set_exception(aiormq.exceptions.ChannelInvalidStateError("closed"))
                    answer.exception()  # retrieved: an abandoned RPC is no error of the test
        for tag in [t for t, c in self.consumers.items() if c.channel in channels]:
            del self.consumers[tag]


class Session:
    """One broker session of the worker: its channels and its lane scheduler."""

    def __init__(
        self, broker: ModelBroker, *, bulk: bool, lanes: list[str], levels: list[int] | None
    ) -> None:
        self.broker = broker
        self.lane_channel = ModelChannel(broker, prefetch=1)
        self.bulk_channel = ModelChannel(broker, prefetch=CONCURRENCY + 1) if bulk else None
        self.running: dict[Msg, asyncio.Event] = {}
        self.retired = False
        # Deliveries given back (why, task number) while the session was live.
        self.given_back: list[tuple[str, int]] = []
        self.scheduler = LaneScheduler(
            self.lane_channel,  # type: ignore[arg-type]
            lanes,
            concurrency=CONCURRENCY,
            starvation_limit=3,
            start=self._start,
            give_back=self._give_back,
            redeclare=self._redeclare,
            bulk_channel=self.bulk_channel,  # type: ignore[arg-type]
            subscribe=broker.subscribe,
            levels=levels,
        )

    @property
    def channels(self) -> list[ModelChannel]:
        return [c for c in (self.lane_channel, self.bulk_channel) if c is not None]

    def _start(self, message: Any) -> asyncio.Task[None]:
        assert not message.started, f"task {message.n} started twice"
        assert not self.retired, f"task {message.n} started by the scheduler of a lost session"
        message.started = True
        done = asyncio.Event()
        self.running[message] = done
        return asyncio.get_running_loop().create_task(self._run(message, done))

    async def _run(self, message: Msg, done: asyncio.Event) -> None:
        try:
            await done.wait()
        finally:
            # The handler has returned: its slot is free from here (the settle releases it
            # before the ack, and the next task may start before that ack is sent).
            self.running.pop(message, None)
            message.released = True
        await self._settle(message, requeue=None)

    async def _give_back(self, message: Any, why: str) -> None:
        if not self.retired:
            self.given_back.append((why, message.n))
        await self._settle(message, requeue=True)

    async def _settle(self, message: Msg, *, requeue: bool | None) -> None:
        # As Settler._settle with the worker's before_settle (consume._release).
        if self.scheduler.owns(message):  # type: ignore[arg-type]
            await self.scheduler.release(message)  # type: ignore[arg-type]
        with contextlib.suppress(aiormq.exceptions.ChannelInvalidStateError):
            self.broker.settle(message, requeue=bool(requeue))

    async def _redeclare(self) -> None:
        return None


class _CountedIds:
    """Stands in for ``uuid`` in ``worker.lane_consumers``: consumer tags in order, so a drawn
    example replays the same way (hypothesis replays to shrink)."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def uuid4(self) -> uuid.UUID:
        return uuid.UUID(int=next(self.numbers))


class LanesModel(RuleBasedStateMachine):
    # The handler's lanes, highest first, and their levels (None: one lane a level).
    lanes = LANES
    levels: list[int] | None = None

    def __init__(self) -> None:
        super().__init__()
        self._uuid = consumers_module.uuid
        consumers_module.uuid = _CountedIds()  # type: ignore[assignment]
        self.loop = VirtualLoop()
        self.broker = ModelBroker(self.loop, self.lanes)
        self.cap = CONCURRENCY + len(self.lanes)
        self.numbers = itertools.count()
        self.sessions: list[Session] = []
        self.session = self._new_session()

    def _new_session(self) -> Session:
        session = Session(self.broker, bulk=True, lanes=self.lanes, levels=self.levels)
        self.sessions.append(session)
        self.session = session
        self.loop.create_task(self._start(session))
        self._quiesce()
        return session

    async def _start(self, session: Session) -> None:
        # A start whose channel closed ends its session, as in the worker (it reconnects).
        with contextlib.suppress(aiormq.exceptions.ChannelInvalidStateError):
            await session.scheduler.start()

    def teardown(self) -> None:
        self.broker.lose([c for s in self.sessions for c in s.channels])
        for session in self.sessions:
            for done in session.running.values():
                done.set()
        self._quiesce()

        async def ended() -> None:
            while tasks := asyncio.all_tasks() - {asyncio.current_task()}:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        self.loop.run_until_complete(ended())
        consumers_module.uuid = self._uuid
        self.loop.close()

    def _quiesce(self) -> None:
        """Run the loop until nothing is ready (timers wait for ``advance``)."""

        async def idle() -> None:
            quiet = 0
            for _ in range(3_000):
                if quiet >= 3:
                    return
                await asyncio.sleep(0)
                quiet = quiet + 1 if len(self.loop._ready) <= 1 else 0  # type: ignore[attr-defined]
            raise AssertionError(f"the scheduler never settles: {list(self.loop._ready)[:5]}")  # type: ignore[attr-defined]

        self.loop.run_until_complete(idle())
        if not self.session.retired and not all(c.alive for c in self.session.channels):
            # a channel of the session closed: the worker ends the session and reconnects
            self._lose()

    # -- rules ------------------------------------------------------------------------------
    @rule(index=st.integers(0, len(FAIR_LANES) - 1), count=st.integers(1, 4))
    def publish(self, index: int, count: int) -> None:
        lane = self.lanes[index % len(self.lanes)]
        for _ in range(count):
            self.broker.ready[lane].append(Msg(next(self.numbers), lane))

    @precondition(lambda self: self.broker.deliverable())
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        consumer = data.draw(st.sampled_from(self.broker.deliverable()))
        self.broker.deliver(consumer)
        self._quiesce()

    @precondition(lambda self: any(c.rpcs for c in self.session.channels))
    @rule(data=st.data(), deliver_first=st.booleans())
    def answer(self, data: st.DataObject, deliver_first: bool) -> None:
        """The broker answers the next RPC of a channel; with ``deliver_first`` a delivery to
        the new consumer is read before the consume-ok reaches its caller."""
        channel = data.draw(st.sampled_from([c for c in self.session.channels if c.rpcs]))
        kind, argument, _ = channel.rpcs[0]
        self.broker.answer(channel)
        if deliver_first and kind == "consume":
            consumer = self.broker.consumers[argument[2]]
            if consumer in self.broker.deliverable():
                self.broker.deliver(consumer)
        self._quiesce()

    @precondition(lambda self: any(s.running for s in self.sessions))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        running = [done for s in self.sessions for done in s.running.values()]
        data.draw(st.sampled_from(running)).set()
        self._quiesce()

    @rule(seconds=st.sampled_from([LOOKAHEAD_GRACE_S / 2, LOOKAHEAD_GRACE_S * 2, 1.5, 6.0]))
    def advance(self, seconds: float) -> None:
        self.loop.now += seconds
        self._quiesce()

    @precondition(lambda self: len(self.sessions) < 4)
    @rule()
    def lose_connection(self) -> None:
        """The connection drops; the worker starts a new session (its consumes answered as
        the broker gets to them)."""
        self._lose()

    def _lose(self) -> None:
        # As Worker._session: the session's schedulers are retired as it ends.
        self.broker.lose(self.session.channels)
        self.session.retired = True
        self.session.scheduler.retire()
        self._quiesce()
        self.session = self._new_session()

    # -- invariants -------------------------------------------------------------------------
    def _held(self) -> list[Msg]:
        # Deliveries not released yet: a finished task frees its slot before its ack, and the
        # next task may start in that round trip (the settle's order, worker.settle).
        return [m for c in self.session.channels for m in c.unacked if not m.released]

    def _describe(self) -> str:
        sched = self.session.scheduler
        held = sorted((m.n, m.lane, (m.consumer_tag or "")[-3:], m.started) for m in self._held())
        consumers = sorted(
            (c.tag[-3:], c.queue, len(c.unacked)) for c in self.broker.consumers.values()
        )
        return (
            f"held {held}; broker consumers {consumers}; bulk mode {sched.bulk}, "
            f"scheduler counts {sched.consumers}; running {len(self.session.running)}"
        )

    @invariant()
    def holds_at_most_concurrency_plus_lanes(self) -> None:
        held = self._held()
        assert len(held) <= self.cap, f"{len(held)} held, over {self.cap}: {self._describe()}"

    @invariant()
    def runs_at_most_concurrency(self) -> None:
        assert len(self.session.running) <= CONCURRENCY, self._describe()

    @invariant()
    def every_consumer_has_one_live_owner(self) -> None:
        scheduler = self.session.scheduler
        for consumer in self.broker.consumers.values():
            assert scheduler.schedules(consumer.tag) or any(
                kind == "cancel" and argument == consumer.tag
                for kind, argument, _ in consumer.channel.rpcs
            ), f"consumer {consumer.tag} of {consumer.queue} is scheduled by nobody"

    @invariant()
    def no_delivery_waits_while_a_slot_is_free(self) -> None:
        waiting = [m for m in self._held() if not m.started]
        running = len(self.session.running)
        if not waiting or running >= CONCURRENCY:
            return
        # A lower lane may wait for a higher lane's next task: within the grace after its
        # spare was armed, or while that spare's consume is unanswered (pick's pending).
        scheduler = self.session.scheduler
        if scheduler.pending_lanes():
            return
        raise AssertionError(
            f"{len(waiting)} deliveries wait ({sorted((m.lane, m.n) for m in waiting)}) "
            f"while {CONCURRENCY - running} slot(s) are free: {self._describe()}"
        )


LanesModel.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_lanes_model = LanesModel.TestCase


class FairLanesModel(LanesModel):
    """The same rules with fair-share lanes: three lanes of the NORMAL level, taken in turn."""

    lanes = FAIR_LANES
    levels = FAIR_LEVELS


FairLanesModel.TestCase.settings = LanesModel.TestCase.settings
test_fair_lanes_model = FairLanesModel.TestCase


class FairOnlyLanesModel(LanesModel):
    """A fair handler without priorities: three lanes of one level. Its lanes take room from
    each other without giving a task back (each return counts toward the delivery limit),
    whatever the broker's timing; the model test before withdrawals found returns here."""

    lanes = FAIR_ONLY_LANES
    levels = FAIR_ONLY_LEVELS

    @invariant()
    def gives_no_task_back(self) -> None:
        given = self.session.given_back
        assert not given, f"given back {given}: {self._describe()}"


FairOnlyLanesModel.TestCase.settings = LanesModel.TestCase.settings
test_fair_only_lanes_model = FairOnlyLanesModel.TestCase

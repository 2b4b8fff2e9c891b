"""The lane consumers' books (``worker.lane_consumers``) and the held-delivery net
(``worker.lane_sweep``) alone, without a scheduler: the consumers over the lanes' model broker
(``test_lanes_model``: a consume or cancel is answered when the test says), the sweep over a
waiting deque, both on an event loop whose clock moves only when the test says."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from tests.unit.test_lanes_model import ModelBroker, ModelChannel, Msg, VirtualLoop
from weclaw_mq.worker.lane_consumers import CANCELLED_MEMORY_S, LaneConsumers
from weclaw_mq.worker.lane_fairness import FairLanes
from weclaw_mq.worker.lane_sweep import HeldSweep

LANES = ["urgent", "normal"]


@pytest.fixture
def loop() -> Iterator[VirtualLoop]:
    loop = VirtualLoop()
    yield loop
    loop.close()


def inside(loop: VirtualLoop, call: Callable[[], object]) -> None:
    """``call`` on the running loop, as the scheduler makes it, then settle."""

    async def run() -> None:
        call()

    loop.run_until_complete(run())
    settle(loop)


def settle(loop: VirtualLoop) -> None:
    """Run the loop until nothing is ready (timers wait for the clock)."""

    async def idle() -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    loop.run_until_complete(idle())


class Books:
    """LaneConsumers on one model channel; ``holding``: the tags the caller says hold a task."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop
        self.broker = ModelBroker(loop, LANES)
        self.channel = ModelChannel(self.broker, prefetch=1)
        self.holding: set[str] = set()
        self.freed = 0
        self.consumers = LaneConsumers(
            self.channel,  # type: ignore[arg-type]
            LANES,
            subscribe=self.broker.subscribe,
            fair=FairLanes(dict.fromkeys(LANES, 0), memory=8),
            holds=lambda tag, _lane: tag in self.holding,
            freed=self._freed,
        )
        for lane in LANES:
            loop.run_until_complete(self.consumers.load_queue(lane))

    def _freed(self) -> None:
        self.freed += 1

    def run(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self.loop.create_task(work)
        settle(self.loop)
        return task

    def answer(self) -> None:
        self.broker.answer(self.channel)
        settle(self.loop)

    def open(self, lane: str) -> tuple[asyncio.Task[str | None], str]:
        """A consume of ``lane`` sent and not answered yet: its task and its tag."""
        self.consumers.opening[lane] += 1  # counted by the caller, as the scheduler does

        async def callback(_: Any) -> None:
            return None

        task = self.run(self.consumers.open(lane, callback))
        (tag,) = self.consumers.opening_tags
        return task, tag


def test_a_consumer_counts_as_opening_until_its_consume_ok_then_as_live(loop: VirtualLoop) -> None:
    books = Books(loop)
    task, tag = books.open("normal")
    assert books.consumers.opening["normal"] == 1 and tag not in books.consumers.lane_of
    books.answer()
    assert task.result() == tag
    assert books.consumers.opening["normal"] == 0
    assert books.consumers.lane_of == {tag: "normal"} and not books.consumers.opening_tags


def test_a_first_delivery_before_the_consume_ok_stops_the_opening_count_once(
    loop: VirtualLoop,
) -> None:
    books = Books(loop)
    task, tag = books.open("normal")
    books.consumers.live(tag, "normal")  # the scheduler's _on_message, before the consume-ok
    assert books.consumers.opening["normal"] == 0 and books.consumers.lane_of == {tag: "normal"}
    books.answer()
    assert task.result() == tag
    assert books.consumers.opening["normal"] == 0, "counted down twice"
    assert books.consumers.lane_of == {tag: "normal"}


def test_a_consumer_cancelled_before_its_consume_ok_never_becomes_live(loop: VirtualLoop) -> None:
    books = Books(loop)
    task, tag = books.open("urgent")
    books.consumers.forget(tag, "urgent")
    books.answer()
    assert task.result() is None
    assert tag not in books.consumers.lane_of and books.consumers.opening["urgent"] == 0


def test_a_consume_not_sent_stops_counting_as_opening(loop: VirtualLoop) -> None:
    books = Books(loop)
    books.consumers.opening["urgent"] += 1

    async def callback(_: Any) -> None:
        return None

    task = books.run(books.consumers.open("urgent", callback, send=False))
    assert task.result() is None
    assert books.consumers.opening["urgent"] == 0 and not books.channel.rpcs


def live_consumer(books: Books, lane: str) -> str:
    task, tag = books.open(lane)
    books.answer()
    assert task.result() == tag
    inside(books.loop, lambda: books.consumers.armed(lane, tag))
    return tag


def test_a_withdrawn_consumer_counts_until_its_cancel_ok_and_then_while_it_holds_a_task(
    loop: VirtualLoop,
) -> None:
    books = Books(loop)
    tag = live_consumer(books, "normal")
    inside(loop, lambda: books.consumers.withdraw(tag, "normal"))
    assert tag in books.consumers.lane_of and tag in books.consumers.withdrawing
    assert tag not in books.consumers.idle["normal"]
    books.holding.add(tag)  # a task reached it before the cancel-ok
    books.answer()  # the cancel-ok
    assert tag in books.consumers.lane_of, "forgotten while its task still runs"
    assert tag in books.consumers.withdrawn and tag in books.consumers.cancelled
    assert books.freed == 1
    books.consumers.released(tag)
    assert tag not in books.consumers.lane_of and not books.consumers.withdrawn


def test_a_withdrawn_consumer_holding_nothing_is_forgotten_at_its_cancel_ok(
    loop: VirtualLoop,
) -> None:
    books = Books(loop)
    tag = live_consumer(books, "urgent")
    inside(loop, lambda: books.consumers.withdraw(tag, "urgent"))
    books.answer()
    assert tag not in books.consumers.lane_of and not books.consumers.withdrawn
    assert books.freed == 1


def test_a_cancelled_tag_is_remembered_for_late_deliveries_then_forgotten(
    loop: VirtualLoop,
) -> None:
    books = Books(loop)
    tag = live_consumer(books, "normal")
    inside(loop, lambda: books.consumers.drop(tag))
    assert tag not in books.consumers.lane_of and tag in books.consumers.cancelled
    assert tag not in books.consumers.idle["normal"]
    books.answer()  # the cancel-ok
    assert tag in books.consumers.cancelled
    loop.now += CANCELLED_MEMORY_S
    settle(loop)
    assert tag not in books.consumers.cancelled


def test_a_failed_consumer_change_is_logged_and_forgotten(
    loop: VirtualLoop, caplog: pytest.LogCaptureFixture
) -> None:
    books = Books(loop)
    task, tag = books.open("normal")
    books.broker.lose([books.channel])  # the consume's channel closes under it
    settle(loop)
    assert task.done() and isinstance(task.exception(), Exception)
    assert books.consumers.opening["normal"] == 0 and tag not in books.consumers.lane_of

    async def fails() -> None:
        raise RuntimeError("channel gone")

    inside(loop, lambda: books.consumers.spawn(fails()))
    assert "lane consumer change failed (RuntimeError: channel gone)" in caplog.text
    loop.run_until_complete(books.consumers.stop())  # nothing left to wait for


class Sweep:
    def __init__(self, loop: VirtualLoop, *, free: bool) -> None:
        self.waiting: dict[str, deque[Any]] = {lane: deque() for lane in LANES}
        self.free = free
        self.held: list[tuple[str, str | None]] = []
        self.counted = 0
        self.swept = 0
        self.sweep = HeldSweep(
            self.waiting,
            bound_s=10.0,
            free=lambda: self.free,
            held=lambda lane, message: self.held.append((lane, message.message_id)),
            swept=self._swept,
            on_held=self._counted,
        )

    def _swept(self) -> None:
        self.swept += 1

    def _counted(self) -> None:
        self.counted += 1


def advance(loop: VirtualLoop, seconds: float, then: Callable[[], None] | None = None) -> None:
    loop.now += seconds
    settle(loop)
    if then is not None:
        then()


def test_a_delivery_held_past_the_bound_beside_a_free_slot_is_handed_back_and_counted(
    loop: VirtualLoop,
) -> None:
    sweep = Sweep(loop, free=True)
    sweep.waiting["normal"].append(Msg(1, "normal"))
    loop.call_soon(sweep.sweep.arm)
    settle(loop)
    advance(loop, 5.0)  # first seen waiting
    advance(loop, 5.0)  # held 5 s so far
    assert sweep.held == [] and sweep.swept == 2
    advance(loop, 5.0)  # held 10 s: the bound
    assert sweep.held == [("normal", "task-1")] and sweep.counted == 1
    assert not sweep.waiting["normal"]


def test_a_delivery_waiting_behind_busy_slots_stays_and_a_stopped_sweep_sweeps_no_more(
    loop: VirtualLoop,
) -> None:
    sweep = Sweep(loop, free=False)
    sweep.waiting["urgent"].append(Msg(2, "urgent"))
    loop.call_soon(sweep.sweep.arm)
    settle(loop)
    for _ in range(6):
        advance(loop, 5.0)
    assert sweep.held == [] and sweep.swept == 6
    assert [m.n for m in sweep.waiting["urgent"]] == [2]
    sweep.sweep.stop()
    sweep.free = True
    for _ in range(4):
        advance(loop, 5.0)
    assert sweep.held == [] and sweep.swept == 6

"""The plain-def handlers' threads (``worker.sync_threads``): at most ``size`` calls at once, an
abandoned call keeps its thread until it returns, a call that never got a thread is dropped
unrun, and the handler's outcome (any exception included) reaches its awaiting delivery."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_until
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.deadlines import Deadline, Deadlines
from weclaw_mq.worker.sync_threads import NoThreadFree, SyncThreads

WAIT_S = 10.0  # a bound on every wait for a thread: never reached when the code is right

_var: contextvars.ContextVar[str] = contextvars.ContextVar("test_sync_threads", default="unset")


class Blocker:
    """A call that says when it started and returns only when let go."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, value: Any = None) -> Any:
        self.threads.append(threading.current_thread())
        self.started.set()
        assert self.release.wait(WAIT_S), "never let go"
        return value


async def started(blocker: Blocker) -> None:
    assert await asyncio.to_thread(blocker.started.wait, WAIT_S), "the call never started"


class Delivery:
    """One delivery's wait for a call, under a deadline it can expire now (as a timeout)."""

    def __init__(
        self,
        pool: SyncThreads,
        deadlines: Deadlines,
        func: Callable[..., Any],
        *args: Any,
        timeout_s: float = 60.0,
    ) -> None:
        self.deadline = Deadline(deadlines, timeout_s)
        self.watch = Watch("q", "t")
        self.waiting = asyncio.Event()  # set as it calls run (which queues the call at once)
        self.task = asyncio.ensure_future(self._wait(pool, func, args))

    async def _wait(
        self, pool: SyncThreads, func: Callable[..., Any], args: tuple[Any, ...]
    ) -> Any:
        with self.deadline:
            self.waiting.set()
            return await pool.run(
                func, args, name="handle", deadline=self.deadline, watch=self.watch
            )

    async def time_out(self) -> None:
        await self.waiting.wait()
        self.deadline.end_now()
        with pytest.raises(TimeoutError):
            await self.task


@pytest.fixture
def pool() -> Any:
    threads = SyncThreads(2)
    yield threads
    threads.shutdown()


async def test_threads_are_made_as_calls_need_them_and_never_more_than_the_size(
    pool: SyncThreads,
) -> None:
    deadlines = Deadlines()
    assert (pool.threads, pool.running) == (0, 0)  # nothing before the first call
    assert await Delivery(pool, deadlines, lambda: 7).task == 7
    assert pool.threads == 1  # one call at a time needed one thread, reused after
    assert await Delivery(pool, deadlines, lambda: 8).task == 8
    assert (pool.threads, pool.running) == (1, 0)

    first, second, third = Blocker(), Blocker(), Blocker()
    waits = [Delivery(pool, deadlines, b, n) for n, b in enumerate((first, second, third))]
    await started(first)
    await started(second)
    assert (pool.threads, pool.running) == (2, 2)
    assert not third.started.is_set()  # no third thread: it waits for one
    first.release.set()
    assert await waits[0].task == 0
    await started(third)  # in the thread the first call freed
    second.release.set()
    third.release.set()
    assert [await w.task for w in waits[1:]] == [1, 2]
    assert (pool.threads, pool.running, pool.abandoned) == (2, 0, 0)


async def test_an_abandoned_call_keeps_its_thread_until_it_returns_and_its_outcome_is_dropped(
    pool: SyncThreads, caplog: pytest.LogCaptureFixture
) -> None:
    deadlines = Deadlines()
    stuck = Blocker()
    abandoned = Delivery(pool, deadlines, stuck, "late")
    await started(stuck)
    with caplog.at_level(logging.INFO, "weclaw_mq.worker"):
        await abandoned.time_out()
    assert (pool.running, pool.abandoned) == (1, 1)
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "abandoned in its thread at its timeout of 60 s" in line, line
    assert "1 of 2 sync threads held by abandoned calls" in line, line

    # One thread is left: a call runs in it, beside the abandoned one.
    assert await Delivery(pool, deadlines, lambda: "beside").task == "beside"
    assert pool.threads == 2

    with caplog.at_level(logging.INFO, "weclaw_mq.worker"):
        caplog.clear()
        stuck.release.set()
        await wait_until(lambda: pool.abandoned == 0, WAIT_S, what="the abandoned call's return")
    assert pool.running == 0
    assert any("returned" in r.getMessage() for r in caplog.records)


async def test_with_every_thread_held_by_abandoned_calls_a_call_is_refused_unrun(
    pool: SyncThreads, caplog: pytest.LogCaptureFixture
) -> None:
    deadlines = Deadlines()
    stuck = [Blocker(), Blocker()]
    with caplog.at_level(logging.WARNING, "weclaw_mq.worker"):
        for blocker in stuck:
            delivery = Delivery(pool, deadlines, blocker)
            await started(blocker)
            await delivery.time_out()
    assert (pool.threads, pool.running, pool.abandoned) == (2, 2, 2)
    assert pool.stuck
    full = [r.getMessage() for r in caplog.records if "all 2 sync threads" in r.getMessage()]
    assert len(full) == 1, full  # said once, as the last thread was abandoned

    ran: list[str] = []
    for word in ("refused", "refused too"):
        with pytest.raises(NoThreadFree, match="all 2 are held by calls past their timeout"):
            await Delivery(pool, deadlines, ran.append, word).task
    assert pool.threads == 2  # no thread beyond the size
    assert (pool.running, pool.abandoned) == (2, 2)  # refused unrun: nothing abandoned more

    for blocker in stuck:
        blocker.release.set()
    await wait_until(lambda: not pool.stuck, WAIT_S, what="a thread given back")
    assert await Delivery(pool, deadlines, lambda: "next").task == "next"
    assert await Delivery(pool, deadlines, lambda: "and next").task == "and next"
    assert ran == []
    await wait_until(lambda: pool.abandoned == 0, WAIT_S, what="the abandoned calls' return")
    assert pool.running == 0


async def test_a_call_waiting_for_a_busy_thread_starts_its_clock_only_when_it_gets_one() -> None:
    pool = SyncThreads(1)
    try:
        deadlines = Deadlines()
        busy = Blocker()
        first = Delivery(pool, deadlines, busy)
        await started(busy)
        second = Delivery(pool, deadlines, lambda: "ran")
        await second.waiting.wait()
        await wait_until(lambda: second.deadline.at == math.inf, WAIT_S, what="the clock held")
        busy.release.set()
        assert await first.task is None
        assert await second.task == "ran"
    finally:
        pool.shutdown()


async def test_a_call_that_gets_no_thread_within_its_timeout_is_refused_unrun() -> None:
    pool = SyncThreads(1)
    busy = Blocker()
    try:
        deadlines = Deadlines()
        first = Delivery(pool, deadlines, busy)
        await started(busy)
        ran: list[str] = []
        second = Delivery(pool, deadlines, ran.append, "never", timeout_s=0.3)
        with pytest.raises(NoThreadFree, match=r"waited .* s for a thread; none free"):
            await second.task
        assert (pool.running, pool.abandoned) == (1, 0)
        busy.release.set()
        assert await first.task is None
        await wait_until(lambda: pool.running == 0, WAIT_S, what="the thread free")
        assert ran == []  # dropped: the free thread skipped it
    finally:
        busy.release.set()
        pool.shutdown()


class Own(Exception):
    pass


def _raises(error: BaseException) -> Callable[[], None]:
    def call() -> None:
        raise error

    return call


async def _returns_a_coroutine() -> None:
    return None


@pytest.mark.parametrize(
    ("func", "expected", "words"),
    [
        (_raises(Own("its own")), Own, "its own"),
        (_raises(SystemExit(3)), SystemExit, "3"),
        (_raises(asyncio.CancelledError("its own")), asyncio.CancelledError, "its own"),
        (_raises(StopIteration()), RuntimeError, "raised StopIteration"),
        (_returns_a_coroutine, TypeError, "returned an awaitable"),
    ],
)
async def test_what_the_call_raises_reaches_its_delivery_and_the_thread_serves_on(
    pool: SyncThreads, func: Callable[[], Any], expected: type[BaseException], words: str
) -> None:
    deadlines = Deadlines()
    deadline = Deadline(deadlines, 60.0)
    # Awaited here, not in a task of its own: asyncio lets a task's SystemExit out of the loop
    # (the worker's delivery catches it inside, as here).
    with pytest.raises(expected, match=words), deadline:
        await pool.run(func, (), name="handle", deadline=deadline, watch=Watch("q", "t"))
    assert (pool.running, pool.abandoned) == (0, 0)
    assert await Delivery(pool, deadlines, lambda: "served").task == "served"


async def test_the_call_sees_its_deliverys_context_vars(pool: SyncThreads) -> None:
    _var.set("the delivery's")
    assert await Delivery(pool, Deadlines(), _var.get).task == "the delivery's"


async def test_a_shutdown_ends_the_idle_threads_and_a_later_call_starts_the_pool_anew() -> None:
    pool = SyncThreads(3)
    deadlines = Deadlines()
    blockers = [Blocker() for _ in range(3)]
    waits = [Delivery(pool, deadlines, b) for b in blockers]
    for blocker in blockers:
        await started(blocker)
    for blocker in blockers:
        blocker.release.set()
    for wait in waits:
        await wait.task
    ours = {t for b in blockers for t in b.threads}
    assert len(ours) == 3 and all(t.daemon for t in ours)

    pool.shutdown()
    for thread in ours:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert pool.threads == 0
    assert await Delivery(pool, deadlines, lambda: "anew").task == "anew"
    assert pool.threads == 1
    pool.shutdown()


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        SyncThreads(0)


async def test_a_call_left_running_by_a_cancel_request_is_told_at_info_not_warned_about(
    pool: SyncThreads, caplog: pytest.LogCaptureFixture
) -> None:
    stuck = Blocker()
    cancelled = Delivery(pool, Deadlines(), stuck)
    await started(stuck)
    with caplog.at_level(logging.INFO, "weclaw_mq.worker"):
        cancelled.watch.request()  # as a cancel request does: sets it, then ends the deadline
        await cancelled.time_out()
    (line,) = [r for r in caplog.records if "sync handler handle" in r.getMessage()]
    assert line.levelno == logging.INFO and "left to see ctx.cancelled" in line.getMessage()
    assert pool.abandoned == 1
    stuck.release.set()
    await wait_until(lambda: pool.abandoned == 0, WAIT_S, what="the cancelled call's return")

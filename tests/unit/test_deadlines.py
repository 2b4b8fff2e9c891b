from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from tests.conftest import wait_until
from weclaw_mq.worker.deadlines import TICK_S, Deadlines


async def test_a_wait_past_its_deadline_raises_timeout_and_is_marked_expired() -> None:
    deadlines = Deadlines()
    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError), deadlines.within(0.05) as deadline:
        await asyncio.sleep(10)
    waited = asyncio.get_running_loop().time() - started
    assert deadline.expired
    assert 0.05 <= waited < 0.05 + 3 * TICK_S


async def test_a_timeout_error_of_the_body_itself_is_not_marked_expired() -> None:
    deadlines = Deadlines()
    with pytest.raises(TimeoutError), deadlines.within(10) as deadline:
        raise TimeoutError("the model API timed out")
    assert not deadline.expired


async def test_a_wait_that_ends_in_time_is_never_cancelled_later() -> None:
    deadlines = Deadlines()
    with deadlines.within(0.05) as deadline:
        await asyncio.sleep(0)
    await asyncio.sleep(0.05 + 2 * TICK_S)  # past the deadline: nothing may fire now
    assert not deadline.expired


async def test_a_cancel_from_outside_stays_a_cancellation() -> None:
    deadlines = Deadlines()
    entered = asyncio.Event()

    async def body() -> None:
        with deadlines.within(10):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_many_waits_share_one_ticker_and_each_fires_on_its_own() -> None:
    deadlines = Deadlines()

    async def wait(timeout_s: float, sleep_s: float) -> bool:
        try:
            with deadlines.within(timeout_s):
                await asyncio.sleep(sleep_s)
        except TimeoutError:
            return True
        return False

    outcomes = await asyncio.gather(*(wait(0.05, 1) for _ in range(50)), wait(5, 0.01))
    assert outcomes == [True] * 50 + [False]


# -- the task's cancel count after every way out of a deadline --------------------------------
# A cancel request the deadline made and did not take back would make a later CancelledError
# of the same task (aiormq cancelling an ack when its connection dies) look like a cancel
# meant for the task: it would escape instead of being handled as a lost connection.


async def _cancelling_after(body: Callable[[], Awaitable[object]], timeout_s: float) -> int:
    """Run ``body`` under a deadline in a fresh task; that task's ``cancelling()`` right after
    the deadline exited, whatever way it exited."""
    deadlines = Deadlines()

    async def run() -> int:
        try:
            with deadlines.within(timeout_s):
                await body()
        except Exception as e:  # only the count after the exit matters here
            del e
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    return await asyncio.create_task(run())


async def test_cancel_count_is_zero_after_a_normal_return() -> None:
    assert await _cancelling_after(lambda: asyncio.sleep(0), 10) == 0


async def test_cancel_count_is_zero_after_a_timeout() -> None:
    assert await _cancelling_after(lambda: asyncio.sleep(10), 0.05) == 0


async def test_cancel_count_is_zero_when_the_body_turns_the_cancellation_into_another_error() -> (
    None
):
    async def converts() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("the model client wrapped the cancellation") from None

    assert await _cancelling_after(converts, 0.05) == 0


async def test_cancel_count_is_zero_when_the_body_swallows_the_cancellation() -> None:
    async def swallows() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        await asyncio.sleep(0)

    assert await _cancelling_after(swallows, 0.05) == 0


async def test_a_converted_cancellation_surfaces_as_the_bodys_own_error() -> None:
    deadlines = Deadlines()
    with pytest.raises(RuntimeError), deadlines.within(0.05) as deadline:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("wrapped") from None
    assert deadline.expired  # the caller can still tell it was the deadline


async def test_cancel_count_stays_one_after_a_cancel_from_outside() -> None:
    deadlines = Deadlines()
    entered = asyncio.Event()
    counts: list[int] = []

    async def body() -> None:
        try:
            with deadlines.within(10):
                entered.set()
                await asyncio.sleep(10)
        finally:
            task = asyncio.current_task()
            assert task is not None
            counts.append(task.cancelling())

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert counts == [1]  # the outside request is the caller's: never taken back


async def test_a_body_that_swallows_its_cancellation_is_handed_to_on_stuck_after_the_grace() -> (
    None
):
    deadlines = Deadlines()
    stuck: list[asyncio.Task[object]] = []
    release = asyncio.Event()

    async def stubborn() -> bool:
        with deadlines.within(0.05, on_stuck=stuck.append, grace_s=0.1) as deadline:
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):  # ignores being told to stop
                    await release.wait()
        return deadline.abandoned

    task = asyncio.create_task(stubborn())
    loop = asyncio.get_running_loop()
    started = loop.time()
    await wait_until(lambda: stuck, 5, "the stuck body to be handed over")
    assert stuck == [task]
    assert loop.time() - started >= 0.15
    assert not task.done()
    release.set()
    assert await task is True


async def test_a_body_that_ends_within_the_grace_is_not_handed_to_on_stuck() -> None:
    deadlines = Deadlines()
    stuck: list[asyncio.Task[object]] = []

    async def slow_cleanup() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.02)  # closing a connection, say
            raise

    with (
        pytest.raises(TimeoutError),
        deadlines.within(0.05, on_stuck=stuck.append, grace_s=1) as deadline,
    ):
        await slow_cleanup()
    await asyncio.sleep(1 + 2 * TICK_S)
    assert stuck == []
    assert not deadline.abandoned


async def test_ending_a_wait_now_cancels_its_body_at_once_and_only_while_it_runs() -> None:
    deadlines = Deadlines()
    entered = asyncio.Event()
    holder: list[object] = []

    async def body() -> None:
        with deadlines.within(30) as deadline:
            holder.append(deadline)
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(body())
    await entered.wait()
    deadline = holder[0]
    assert hasattr(deadline, "end_now")
    deadline.end_now()
    # At once: the body sees it on its next step, not a tick later.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task, TICK_S / 2)
    assert deadline.expired and task.cancelling() == 0
    deadline.end_now()  # over: no effect
    assert task.cancelling() == 0

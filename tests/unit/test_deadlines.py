from __future__ import annotations

import asyncio

import pytest

from weclaw_mq.deadlines import TICK_S, Deadlines


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

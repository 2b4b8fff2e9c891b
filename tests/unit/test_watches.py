"""A long run's watch generations (``state.watches``): the pure rules, and the memory store
keeping them in its claim (the Redis scripts are run by tests/integration/test_long_runs.py)."""

from __future__ import annotations

import pytest

from weclaw_mq.state import Claim, MemoryTaskStore
from weclaw_mq.state.watches import WatchStep, is_stale, next_value


@pytest.mark.parametrize(
    ("current", "generation", "stale"),
    [
        (None, 1, False),  # nothing known: the copy counts, the guard decides
        (3, 3, False),
        (3, 4, False),  # a hand-over's copy published before the raise
        (3, 2, True),
        (-3, 3, True),  # the run ended at 3: its copies are stale
        (-3, 4, False),  # a new run's
    ],
)
def test_a_copy_is_stale_once_the_watch_passed_its_generation(
    current: int | None, generation: int, stale: bool
) -> None:
    assert is_stale(current, generation) is stale


def test_every_step_raises_the_generation_and_an_end_makes_every_copy_stale() -> None:
    started = next_value(None, 0, WatchStep.START)
    assert started == 1
    resumed = next_value(started, 1, WatchStep.START)  # the copy of 1 resumed the run
    assert resumed == 2 and is_stale(resumed, 1)
    raised = next_value(resumed, 3, WatchStep.RAISE)  # a hand-over's copy of 3
    assert raised == 3 and not is_stale(raised, 3) and is_stale(raised, 2)
    assert next_value(raised, 2, WatchStep.RAISE) == 3  # never lowered
    ended = next_value(raised, 3, WatchStep.END)
    assert ended == -3 and is_stale(ended, 3)
    assert next_value(ended, 0, WatchStep.START) == 4  # a retry's run starts past it


async def test_the_memory_store_claims_nothing_for_a_stale_watch_copy() -> None:
    store = MemoryTaskStore()
    assert await store.watch("q", "t", 0, WatchStep.START) == 1
    assert await store.claim("q", "t", "a", watch=1) is Claim.ACQUIRED
    assert await store.claim("q", "t", "b", watch=1) is Claim.BUSY  # the run is alive
    await store.watch("q", "t", 1, WatchStep.END)
    await store.release("q", "t", "a")
    assert await store.claim("q", "t", "c", watch=1) is Claim.STALE
    assert await store.claim("q", "t", "d") is Claim.ACQUIRED  # a retry's copy carries none

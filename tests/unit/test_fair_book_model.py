"""The fair book's model test (``tests/fair_book_model.py``) against the memory book: stale
worker counts, overlapping workers and producers answering in any order."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from hypothesis import HealthCheck, settings

from tests.fair_book_model import FairBookModel
from weclaw_mq.state.fair_book import FairBook, MemoryFairBook

_T = TypeVar("_T")


class MemoryBookModel(FairBookModel):
    def make_book(self) -> FairBook:
        return MemoryFairBook(clock_ms=lambda: 0.0)  # no batch outlives its deadline here

    def run(self, call: Awaitable[_T]) -> _T:
        # The memory book never suspends: its coroutine ends at its first step.
        step = _awaited(call)
        try:
            step.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        raise AssertionError("the memory book suspended")


async def _awaited(call: Awaitable[_T]) -> _T:
    return await call


MemoryBookModel.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_memory_fair_book_model = MemoryBookModel.TestCase


class MemoryBookKnownLanesModel(MemoryBookModel):
    """With producers reusing a known lane: loads still never too low, and exact when quiet."""

    KNOWN_LANES = True


MemoryBookKnownLanesModel.TestCase.settings = MemoryBookModel.TestCase.settings
test_memory_fair_book_model_with_known_lanes = MemoryBookKnownLanesModel.TestCase

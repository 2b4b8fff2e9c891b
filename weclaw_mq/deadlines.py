"""Deadlines for many short waits, kept by one timer instead of one timer per wait.

Every delivery waits twice under a deadline (its handler, and its ack). ``asyncio.timeout``
schedules and cancels a timer handle per wait, which showed up as the largest single cost of
our consume path. Here each wait only records its deadline in a dict; one ticker wakes a few
times a second and cancels the tasks that are past theirs. A deadline therefore fires up to
one tick late, which is nothing next to the model calls and acks it bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

TICK_S = 0.1


@dataclass(slots=True)
class Deadline:
    at: float
    expired: bool = False


class Deadlines:
    def __init__(self) -> None:
        self._due: dict[asyncio.Task[object], Deadline] = {}
        self._ticker: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def within(self, timeout_s: float) -> Iterator[Deadline]:
        """Like ``asyncio.timeout``: past ``timeout_s`` the body is cancelled and
        ``TimeoutError`` raised; ``deadline.expired`` tells it from a TimeoutError of the body's
        own. Not nestable within one task."""
        task = asyncio.current_task()
        assert task is not None
        loop = task.get_loop()
        deadline = Deadline(loop.time() + timeout_s)
        self._due[task] = deadline
        if self._ticker is None:
            self._ticker = loop.call_later(TICK_S, self._tick, loop)
        try:
            yield deadline
        except asyncio.CancelledError:
            if deadline.expired and task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            self._due.pop(task, None)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for task, deadline in list(self._due.items()):
            if deadline.at <= now and not deadline.expired:
                deadline.expired = True
                task.cancel()
        self._ticker = loop.call_later(TICK_S, self._tick, loop) if self._due else None

"""Deadlines for many short waits, kept by one timer instead of one timer per wait.

Every delivery waits twice under a deadline (its handler, and its ack). ``asyncio.timeout``
schedules and cancels a timer handle per wait, which showed up as the largest single cost of
our consume path. Here each wait only records its deadline in a dict; one ticker wakes a few
times a second and cancels the tasks that are past theirs. A deadline therefore fires up to
one tick late, which is nothing next to the model calls and acks it bounds.
"""

from __future__ import annotations

import asyncio

TICK_S = 0.1


class Deadline:
    """One wait under a deadline; a context manager (a class, not a generator: it runs twice
    per delivery)."""

    __slots__ = ("_owner", "_task", "at", "expired", "timeout_s")

    def __init__(self, owner: Deadlines, timeout_s: float) -> None:
        self._owner = owner
        self.timeout_s = timeout_s
        self.at = 0.0
        self.expired = False
        self._task: asyncio.Task[object] | None = None

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        assert task is not None, "a deadline needs a running task"
        self._task = task
        self.at = task.get_loop().time() + self.timeout_s
        self._owner._add(task, self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: object
    ) -> None:
        task = self._task
        assert task is not None
        self._owner._due.pop(task, None)
        if kind is asyncio.CancelledError and self.expired and task.uncancel() == 0:
            raise TimeoutError from error


class Deadlines:
    def __init__(self) -> None:
        self._due: dict[asyncio.Task[object], Deadline] = {}
        self._ticker: asyncio.TimerHandle | None = None

    def within(self, timeout_s: float) -> Deadline:
        """Like ``asyncio.timeout``: past ``timeout_s`` the body is cancelled and
        ``TimeoutError`` raised; ``deadline.expired`` tells it from a TimeoutError of the body's
        own. Not nestable within one task."""
        return Deadline(self, timeout_s)

    def _add(self, task: asyncio.Task[object], deadline: Deadline) -> None:
        self._due[task] = deadline
        if self._ticker is None:
            loop = task.get_loop()
            self._ticker = loop.call_later(TICK_S, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for task, deadline in list(self._due.items()):
            if deadline.at <= now and not deadline.expired:
                deadline.expired = True
                task.cancel()
        self._ticker = loop.call_later(TICK_S, self._tick, loop) if self._due else None

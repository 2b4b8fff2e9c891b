"""Deadlines for many short waits, kept by one timer instead of one timer per wait.

Every delivery waits twice under a deadline (its handler, and its ack). ``asyncio.timeout``
schedules and cancels a timer handle per wait, which showed up as the largest single cost of
our consume path. Here each wait only records its deadline in a dict; one ticker wakes a few
times a second and cancels the tasks that are past theirs. A deadline therefore fires up to
one tick late, which is nothing next to the model calls and acks it bounds.

A body that swallows its cancellation cannot be stopped by anyone; a wait given ``on_stuck``
is handed to that callback ``grace_s`` after its deadline (by the same ticker: no timer of its
own), so its caller can end the work elsewhere and stop waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from time import monotonic

log = logging.getLogger("weclaw_mq.worker.deadlines")

TICK_S = 0.1

# Deadlines are kept on ``time.monotonic``, the clock asyncio's own loop reads for
# ``loop.time()``, read directly: a clock read per wait is one C call, not a method of the loop.


class Deadline:
    """One wait under a deadline; a context manager (a class, not a generator: it runs twice
    per delivery)."""

    __slots__ = (
        "_left",
        "_owner",
        "_task",
        "abandoned",
        "at",
        "expired",
        "grace_s",
        "on_stuck",
        "started",
        "timeout_s",
    )

    def __init__(
        self,
        owner: Deadlines,
        timeout_s: float,
        on_stuck: Callable[[asyncio.Task[object]], object] | None = None,
        grace_s: float = 0.0,
    ) -> None:
        self._owner = owner
        self.timeout_s = timeout_s
        self.on_stuck = on_stuck
        self.grace_s = grace_s
        self.at = 0.0
        self.expired = False
        self.abandoned = False  # handed to on_stuck: its body ignored the cancellation
        self._task: asyncio.Task[object] | None = None

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        assert task is not None, "a deadline needs a running task"
        self._task = task
        # (monotonic) When the wait began: the worker's beat reads it (``worker.beat``).
        self.started = started = monotonic()
        self.at = started + self.timeout_s
        owner = self._owner
        owner._due[task] = self
        if owner._ticker is None:
            owner._start(task.get_loop())
        return self

    def hold(self) -> None:
        """Stop the clock (a plain def's call waiting for a thread): no expiry until
        ``restart``. A cancel request (``end_now``) still ends the wait at once."""
        if not self.expired and self.at != math.inf:
            self._left = max(self.at - monotonic(), 0.0)
            self.at = math.inf

    def restart(self) -> None:
        """Start the held clock again, with the time it had left. No effect once the deadline
        expired, or when it was not held."""
        if not self.expired and self.at == math.inf:  # (``_left`` is set by ``hold``)
            self.at = monotonic() + self._left

    def end_now(self) -> None:
        """Expire now (a cancel request, ``worker.cancel_watch``): the body is cancelled at once,
        not at the next tick, and ``on_stuck`` follows ``grace_s`` later if it ignores that.
        No effect once the body ended or the deadline expired."""
        task = self._task
        if task is None or self.expired or self._owner._due.get(task) is not self:
            return
        self.at = monotonic()
        self.expired = True
        task.cancel()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: object
    ) -> None:
        task = self._task
        assert task is not None
        self._owner._due.pop(task, None)
        # Nothing calls on_stuck once the body ended, and the callback usually refers back to
        # this deadline (a delivery's partial holds its cancel watch, which holds the
        # deadline): dropped here, that cycle never forms and the delivery is freed by its
        # reference counts, not by the garbage collector (benchmarks/README.md, "Numbers
        # behind the code").
        self.on_stuck = None
        # Take our cancel request back whatever the body made of it: re-raised, turned into
        # another error, or swallowed. Left counted, it would make every later CancelledError
        # of this task (aiormq cancelling an ack when its connection dies) look like a cancel
        # meant for the task, and escape.
        if self.expired and task.uncancel() == 0 and kind is asyncio.CancelledError:
            raise TimeoutError from error


class Deadlines:
    def __init__(self) -> None:
        self._due: dict[asyncio.Task[object], Deadline] = {}
        self._ticker: asyncio.TimerHandle | None = None

    def within(
        self,
        timeout_s: float,
        *,
        on_stuck: Callable[[asyncio.Task[object]], object] | None = None,
        grace_s: float = 0.0,
    ) -> Deadline:
        """Like ``asyncio.timeout``: past ``timeout_s`` the body is cancelled and
        ``TimeoutError`` raised; ``deadline.expired`` tells it from a TimeoutError of the body's
        own. Not nestable within one task.

        With ``on_stuck``: if the body is still running ``grace_s`` after it was cancelled,
        ``on_stuck(task)`` is called once (from the ticker) and ``deadline.abandoned`` set.

        (The paths of every delivery make ``Deadline(deadlines, timeout_s, ...)`` directly:
        the same object, one call less.)"""
        return Deadline(self, timeout_s, on_stuck, grace_s)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the ticker (a wait was added while none was due)."""
        self._ticker = loop.call_later(TICK_S, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = monotonic()
        for task, deadline in list(self._due.items()):
            if deadline.at > now:
                continue
            if not deadline.expired:
                deadline.expired = True
                task.cancel()
            elif deadline.on_stuck is not None and deadline.at + deadline.grace_s <= now:
                # Cancelled a grace ago and still running: it swallowed the cancellation.
                del self._due[task]
                deadline.abandoned = True
                try:
                    deadline.on_stuck(task)
                except Exception:  # the ticker serves every other wait: it must go on
                    log.exception("the on_stuck callback of a deadline failed")
        self._ticker = loop.call_later(TICK_S, self._tick, loop) if self._due else None

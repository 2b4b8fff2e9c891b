"""Cancel requests on one worker: the deliveries it is processing, by (queue, task id), and
what a request does to each (``state.cancel_records`` tells the whole story of a cancel).

A delivery is watched from before its claim to its end, so a request is never missed in
between: one that arrives before the handler starts keeps it from starting; one that arrives
while it runs expires the handler's deadline now: the handler is cancelled at once and, if
it ignores that, the deadline ticker ends the attempt without it after the grace, as for a
timeout. The delivery then acks the message as ``cancelled``.

The worker holds one subscription (``TaskStore.watch_cancels``), not one per task; after each
(re)subscription it asks the store about every delivery it is processing, so a request sent
while it was not listening still reaches its handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from weclaw_mq.state import TaskStore
from weclaw_mq.worker.deadlines import Deadline

log = logging.getLogger("weclaw_mq.worker")


class Watch:
    """One delivery's view of cancel requests."""

    __slots__ = ("_deadline", "_event", "attempt", "queue", "requested", "task_id")

    def __init__(self, queue: str, task_id: str, attempt: int = 1) -> None:
        self.queue = queue
        self.task_id = task_id
        self.attempt = attempt
        self.requested = False
        self._event: asyncio.Event | None = None  # made only for a handler that takes ctx
        self._deadline: Deadline | None = None

    def request(self) -> None:
        self.requested = True
        if self._event is not None:
            self._event.set()
        if self._deadline is not None:
            self._deadline.end_now()

    def event(self) -> asyncio.Event:
        """Set once the task is cancelled (``Context.cancel_requested``)."""
        if self._event is None:
            self._event = asyncio.Event()
            if self.requested:
                self._event.set()
        return self._event

    def attach(self, deadline: Deadline) -> None:
        """The handler runs under ``deadline`` now: a request cuts it short."""
        self._deadline = deadline
        if self.requested:
            deadline.end_now()

    def handler_started(self) -> float | None:
        """When (``time.monotonic``) its handler started; None before (read at a worker's beat,
        ``worker.beat``: the deadline the handler runs under knows, no clock read per delivery)."""
        started: float | None = getattr(self._deadline, "started", None)  # set once entered
        return started


class Cancels:
    """The deliveries of one worker and the requests for them."""

    def __init__(self) -> None:
        # One set, not an index by task id: adding and removing cost least on the path of
        # every delivery, and a request (rare) scans at most the worker's in-flight tasks.
        self._watched: set[Watch] = set()
        self.listening = asyncio.Event()  # set once subscribed (tests wait on it)
        # The set's own discard, not a method around it: one call less per delivery.
        self.unwatch: Callable[[Watch], None] = self._watched.discard

    # A pair of calls rather than a context manager: this runs for every delivery, where a
    # generator-based one costs more than the watch itself (make bench-own-cost).
    def watch(self, queue: str, task_id: str, attempt: int = 1) -> Watch:
        """Watch a delivery of ``task_id`` (its ``attempt``) from ``queue``; ``unwatch(watch)``
        it when it ends."""
        watch = Watch(queue, task_id, attempt)
        self._watched.add(watch)
        return watch

    def watched(self) -> list[Watch]:
        """Every delivery being processed now (for the worker's beat, ``worker.beat``)."""
        return list(self._watched)

    def request(self, task_id: str, queue: str | None) -> None:
        """A cancel request for ``task_id`` in ``queue`` (None: every queue)."""
        for watch in list(self._watched):
            if watch.task_id == task_id and (queue is None or queue == watch.queue):
                if not watch.requested:
                    log.info("task %s in %s: cancel requested", task_id, watch.queue)
                watch.request()

    async def recheck(self, store: TaskStore) -> None:
        """Ask the store about every delivery being processed (after a (re)subscription)."""
        for watch in list(self._watched):
            if not watch.requested and await store.is_cancelled(watch.queue, watch.task_id):
                watch.request()

    async def listen(self, store: TaskStore) -> None:
        """Until cancelled: pass ``store``'s cancel requests to the deliveries. Nothing waits
        for the first subscription: the recheck after it covers what started before."""

        async def subscribed() -> None:
            await self.recheck(store)
            self.listening.set()

        await store.watch_cancels(self.request, subscribed)

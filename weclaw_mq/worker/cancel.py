"""Cancel requests on one worker: the deliveries it is processing, by (queue, task id), and
what a request does to each (``state.cancel`` tells the whole story of a cancel).

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
import contextlib
import logging
from collections.abc import Iterator

from ..state import TaskStore
from .deadlines import Deadline

log = logging.getLogger("weclaw_mq.worker")


class Watch:
    """One delivery's view of cancel requests."""

    __slots__ = ("_deadline", "_event", "requested")

    def __init__(self) -> None:
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


class Cancels:
    """The deliveries of one worker, by task id, and the requests for them."""

    def __init__(self) -> None:
        # task id -> (queue, watch) of each delivery of it being processed here
        self._watched: dict[str, list[tuple[str, Watch]]] = {}
        self.listening = asyncio.Event()  # set once subscribed (tests wait on it)

    @contextlib.contextmanager
    def watching(self, queue: str, task_id: str) -> Iterator[Watch]:
        watch = Watch()
        entry = (queue, watch)
        self._watched.setdefault(task_id, []).append(entry)
        try:
            yield watch
        finally:
            entries = self._watched[task_id]
            entries.remove(entry)
            if not entries:
                del self._watched[task_id]

    def request(self, task_id: str, queue: str | None) -> None:
        """A cancel request for ``task_id`` in ``queue`` (None: every queue)."""
        for watched_queue, watch in self._watched.get(task_id, ()):
            if queue is None or queue == watched_queue:
                if not watch.requested:
                    log.info("task %s in %s: cancel requested", task_id, watched_queue)
                watch.request()

    async def recheck(self, store: TaskStore) -> None:
        """Ask the store about every delivery being processed (after a (re)subscription)."""
        for task_id, entries in list(self._watched.items()):
            for queue, watch in list(entries):
                if not watch.requested and await store.is_cancelled(queue, task_id):
                    self.request(task_id, queue)

    async def listen(self, store: TaskStore) -> None:
        """Until cancelled: pass ``store``'s cancel requests to the deliveries. Nothing waits
        for the first subscription: the recheck after it covers what started before."""

        async def subscribed() -> None:
            await self.recheck(store)
            self.listening.set()

        await store.watch_cancels(self.request, subscribed)

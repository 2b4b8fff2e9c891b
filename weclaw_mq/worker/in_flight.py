"""The deliveries being processed, per handler queue: each runs in a task of ours and is
settled on every path. Shared by the ``Worker`` and the test kit's ``TestBroker``, so both
count, replace and give back deliveries the same way."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.failures import describe
from weclaw_mq.worker.delivery import process
from weclaw_mq.worker.ends import GiveBack, carry_out
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")


class InFlight:
    def __init__(self, queues: Iterable[str] = ()) -> None:
        self._tasks: dict[str, set[asyncio.Task[None]]] = {q: set() for q in queues}
        # Tasks whose handler ignored its cancellation: they hold no message any more, are no
        # longer in flight, and a stop does not wait for them; held here until they end.
        self.abandoned: set[asyncio.Task[Any]] = set()

    def add_queue(self, queue: str) -> None:
        self._tasks.setdefault(queue, set())

    def of(self, queue: str) -> set[asyncio.Task[None]]:
        """The live set of ``queue``'s tasks (its ``__len__`` feeds the in-flight gauge)."""
        return self._tasks[queue]

    def count(self) -> int:
        return sum(len(tasks) for tasks in self._tasks.values())

    def all(self) -> set[asyncio.Task[None]]:
        return set().union(*self._tasks.values())

    def start(
        self, message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime
    ) -> asyncio.Task[None]:
        """Process ``message`` in a task of ours, counted in flight, settled on every path."""
        # ``_track``, spelled out: this runs for every delivery.
        task = asyncio.create_task(settled(message, spec, rt, process(message, spec, rt)))
        tasks = self._tasks[spec.queue]
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def replace(
        self,
        message: AbstractIncomingMessage,
        spec: HandlerSpec,
        rt: Runtime,
        stuck: asyncio.Task[Any],
        ending: Coroutine[Any, Any, None],
    ) -> None:
        """Run ``ending`` (the delivery's failure path) in place of ``stuck``, whose handler
        ignored its cancellation: the slot and the message are freed, the handler left."""
        self.abandon(stuck)
        self._track(spec.queue, settled(message, spec, rt, ending))

    def abandon(self, task: asyncio.Task[Any]) -> None:
        """No longer count ``task`` (a handler left behind); it keeps running, in
        ``abandoned`` until it ends."""
        for tasks in self._tasks.values():
            tasks.discard(task)
        self.abandoned.add(task)
        task.add_done_callback(self.abandoned.discard)

    def _track(self, queue: str, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        tasks = self._tasks[queue]
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task


async def settled(
    message: AbstractIncomingMessage,
    spec: HandlerSpec,
    rt: Runtime,
    work: Coroutine[Any, Any, None],
) -> None:
    """Run ``work`` (the processing of ``message``) and, whatever escapes it, settle the
    message: no path leaves it held by this live worker with nothing running for it."""
    try:
        await work
    except GeneratorExit:
        raise  # this coroutine is being closed: nothing can be awaited any more
    except asyncio.CancelledError:
        # Stopping hard (the grace ran out): give the message back now, not only when the
        # connection closes.
        await _give_back(message, spec, rt, "the worker stopped before it ended")
        raise
    except BaseException as e:
        # A bug of ours must not kill the consumer: the message goes back to its queue (the
        # broker's delivery limit bounds how often one message can do this).
        log.exception("unexpected error while processing (%s)", describe(e))
        await _give_back(message, spec, rt, f"unexpected error ({describe(e)})")


async def _give_back(
    message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime, why: str
) -> None:
    if message.processed:
        return  # settled before the error: nothing is held
    await carry_out(GiveBack(f"task {message.message_id}: {why}"), message, None, spec, rt)

"""A worker session's consumers: a single handler's queue subscribed (and paused by its
breaker), a laned handler's lane scheduler, a consumer the broker cancelled subscribed again,
and the dispatch of each delivery into a task of ours.

A mixin of ``consume.Worker``: it reads the worker's attributes declared below.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)

from weclaw_mq.app import App
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.policy.failures import describe
from weclaw_mq.settings import Settings
from weclaw_mq.wire.connection import LINK_ERRORS
from weclaw_mq.wire.topology import declare
from weclaw_mq.worker import ends
from weclaw_mq.worker.in_flight import InFlight
from weclaw_mq.worker.incoming import consume
from weclaw_mq.worker.lanes import LaneScheduler
from weclaw_mq.worker.long_runs import LongRuns
from weclaw_mq.worker.pausing import Pausable, QueueCircuit
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")


class Subscriptions:
    """How the worker subscribes its handler queues in a session, and dispatches deliveries."""

    app: App
    settings: Settings
    concurrency: int
    _stop: asyncio.Event
    _in_flight: InFlight
    _long_runs: LongRuns | None
    _circuits: dict[str, QueueCircuit]
    _recovering: set[str]
    _schedulers: list[LaneScheduler]

    async def _subscribe(
        self,
        channel: AbstractChannel,
        spec: HandlerSpec,
        runtime: Runtime,
        consumers: dict[str, tuple[HandlerSpec, AbstractQueue]],
        pausable: dict[str, _SingleConsumer],
        watches: list[Coroutine[Any, Any, None]],
    ) -> None:
        """Consume a single (unlaned) handler's queue; with a breaker, watch it too."""
        queue = await channel.get_queue(spec.queue, ensure=False)
        tag = await consume(queue, self._dispatcher(spec, runtime))
        consumers[tag] = (spec, queue)
        if spec.queue in self._circuits or spec.long_running:
            on_message = self._dispatcher(spec, runtime)
            single_consumer = _SingleConsumer(
                spec, queue, on_message, consumers, self._stop, self._recovering
            )
            pausable[spec.queue] = single_consumer
        if spec.queue in self._circuits:
            watches.append(self._watch(spec, runtime, single_consumer))

    async def _broker_cancelled(
        self,
        tag: str,
        conn: AbstractConnection,
        channel: AbstractChannel,
        runtime: Runtime,
        consumers: dict[str, tuple[HandlerSpec, AbstractQueue]],
        pausable: dict[str, _SingleConsumer],
    ) -> None:
        """The broker cancelled consumer ``tag``: subscribe its queue again (a single
        handler's) or let its lane scheduler do so."""
        if tag in consumers:
            spec, _ = consumers.pop(tag)
            self._recovering.add(spec.queue)
            queue, new_tag = await self._consume_again(conn, channel, spec, runtime)
            paused = pausable.get(spec.queue)
            if paused is not None and paused.paused:
                # Its breaker opened while we subscribed again: the new consumer would
                # deliver beside the pause (resume() subscribes anew).
                await queue.cancel(new_tag)
            else:
                consumers[new_tag] = (spec, queue)
            self._recovering.discard(spec.queue)
        for scheduler in self._schedulers:
            await scheduler.broker_cancelled(tag)

    def _lane_scheduler(
        self,
        conn: AbstractConnection,
        channel: AbstractChannel,
        spec: HandlerSpec,
        runtime: Runtime,
        version: ServerVersion | None,
        bulk_channel: AbstractChannel | None = None,
    ) -> LaneScheduler:
        async def give_back(message: AbstractIncomingMessage, why: str) -> None:
            await ends.give_back(message, spec, runtime, why, logging.INFO)

        async def redeclare() -> None:
            declaring = await conn.channel()
            await declare(declaring, [spec.queue_spec()])
            await declaring.close()

        lane_levels = spec.queue_spec().lane_levels(version)
        return LaneScheduler(
            channel,
            [lane for lane, _ in lane_levels],
            concurrency=self.concurrency,
            starvation_limit=self.settings.priority_starvation_limit,
            start=functools.partial(self._start, spec, runtime),
            give_back=give_back,
            redeclare=redeclare,
            bulk_channel=bulk_channel,
            held_bound_s=self.settings.held_delivery_s,
            on_held=lambda: self.app.metrics.held_deliveries.labels(spec.queue).inc(),
            levels=[rank for _, rank in lane_levels],
        )

    async def _consume_again(
        self,
        conn: AbstractConnection,
        channel: AbstractChannel,
        spec: HandlerSpec,
        runtime: Runtime,
    ) -> tuple[AbstractQueue, str]:
        """Consume ``spec``'s queue again after the broker cancelled our consumer.

        The queue is declared first, as at start (it may have been deleted): consuming from
        a missing queue would close the channel of every other consumer too. Any failure ends
        the session, and the reconnect path declares and consumes everything afresh.
        """
        log.warning("the broker cancelled our consumer of %r; consuming it again", spec.queue)
        try:
            declaring = await conn.channel()
            await declare(declaring, [spec.queue_spec()])
            await declaring.close()
            queue = await channel.get_queue(spec.queue, ensure=False)
            tag = await consume(queue, self._dispatcher(spec, runtime))
        except (*LINK_ERRORS, RuntimeError) as e:  # RuntimeError: aio-pika's "closed"
            raise aiormq.exceptions.ConnectionClosed(
                320, f"could not consume {spec.queue!r} again: {describe(e)}"
            ) from e
        log.info("consuming %s again", spec.queue)
        return queue, tag

    def _dispatcher(
        self, spec: HandlerSpec, runtime: Runtime
    ) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
        async def on_message(message: AbstractIncomingMessage) -> None:
            if self._stop.is_set():
                # Arrived after we decided to stop: given back now, so another worker can
                # take it while this one drains (which may last the whole grace period).
                await ends.give_back(message, spec, runtime, "the worker is stopping", logging.INFO)
                return
            long_runs = self._long_runs
            if (
                spec.long_running
                and long_runs is not None
                and long_runs.count(spec.queue) >= self.concurrency
            ):
                # Sent before its consumer paused for a queue full of long runs (which hold
                # no delivery, so the prefetch no longer bounds them): another worker's.
                # Long runs only, not every delivery in flight: runs ending and copies
                # deferred against a Redis that is down (each waiting out its timeout) held
                # the count up, and every delivery went back at once, raising its
                # x-delivery-count until the delivery limit dead-lettered it (issue 40's
                # Sentinel drill: tests/drills/test_redis_sentinel_drill.py).
                why = "this worker runs as many long runs as its concurrency"
                await ends.give_back(message, spec, runtime, why, logging.DEBUG)
                return
            # Our own task, not aiormq's: aiormq cancels its callback tasks when the
            # connection drops, and a model call that is paid for should still finish and
            # store its result even if its ack can no longer be sent.
            self._start(spec, runtime, message)

        return on_message

    def _start(
        self, spec: HandlerSpec, runtime: Runtime, message: AbstractIncomingMessage
    ) -> asyncio.Task[None]:
        """Process ``message`` in a task of ours, counted in flight, settled on every path."""
        return self._in_flight.start(message, spec, runtime)

    def _watch(
        self, spec: HandlerSpec, runtime: Runtime, consumers: Pausable
    ) -> Coroutine[Any, Any, None]:
        start = functools.partial(self._start, spec, runtime)
        return self._circuits[spec.queue].watch(consumers, start)


class _SingleConsumer:
    """The consumer of a handler queue without lanes (in ``consumers``, the session's
    tag -> (spec, queue) map), as its circuit breaker pauses and resumes it.

    ``paused`` is the breaker's word, kept here because the session loop may be subscribing
    the queue again (after the broker cancelled its consumer) when the breaker opens: it
    finds no tag to cancel then, and the loop drops the consumer it made once it sees
    ``paused``. Likewise a resume during that re-subscription adds nothing: the loop's new
    consumer is the queue's one."""

    def __init__(
        self,
        spec: HandlerSpec,
        queue: AbstractQueue,
        on_message: Callable[[AbstractIncomingMessage], Awaitable[None]],
        consumers: dict[str, tuple[HandlerSpec, AbstractQueue]],
        stopping: asyncio.Event,
        recovering: set[str],
    ) -> None:
        self.spec = spec
        self.queue = queue
        self.on_message = on_message
        self.consumers = consumers
        self.stopping = stopping
        self.recovering = recovering  # queues the session loop is subscribing again
        self.paused = False
        # Paused too while this worker runs as many long runs of it as its concurrency
        # (``worker.long_runs``): the breaker's resume leaves it paused then.
        self.full = False

    async def pause(self) -> None:
        self.paused = True
        await self._cancel()

    async def room(self, full: bool) -> None:
        """A long run began and filled the worker (``full``), or one ended and made room."""
        self.full = full
        if full:
            await self._cancel()
        elif not self.paused:
            await self.resume()

    async def _cancel(self) -> None:
        for tag, (spec, queue) in list(self.consumers.items()):
            if spec is self.spec:
                del self.consumers[tag]
                await queue.cancel(tag)

    async def resume(self) -> None:
        self.paused = False
        if self.full:
            return  # its long runs fill the worker: ``room`` resumes it
        if self.stopping.is_set():
            return  # the stop cancels consumers: none is added behind it
        if self.spec.queue in self.recovering:
            return  # the session loop's re-subscription is the queue's consumer
        if any(spec is self.spec for spec, _ in self.consumers.values()):
            return  # consuming already: a second consumer would double the prefetch
        tag = await consume(self.queue, self.on_message)
        self.consumers[tag] = (self.spec, self.queue)

    async def fetch(self) -> AbstractIncomingMessage | None:
        return await self.queue.get(no_ack=False, fail=False)


async def _broker_cancels(channels: set[AbstractChannel]) -> asyncio.Queue[str]:
    """The consumer tags the broker cancels on its own (basic.cancel) on ``channels``: when a
    queue is deleted, on some quorum leader changes, and on RabbitMQ 4.3's consumer timeout;
    the channel stays open and nothing else would tell us that no more deliveries come."""
    cancelled: asyncio.Queue[str] = asyncio.Queue()
    for ch in channels:
        underlay = await ch.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(
            lambda frame: cancelled.put_nowait(frame.consumer_tag or "")
        )
    return cancelled

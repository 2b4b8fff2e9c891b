"""The worker's lifecycle: connect, declare, consume, reconnect, and stop without losing work.

``--concurrency N`` sets prefetch = N per handler queue and so at most N handlers in flight
per queue: a worker never holds a message it is not processing (prefetch=1, generalised).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence

import aiormq
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage, AbstractQueue

from .app import App
from .connection import LINK_ERRORS, backoff_s, cancelled_by_caller, when_lost
from .deadlines import Deadlines
from .errors import ConfigurationError
from .handler import HandlerSpec
from .metrics import Outcome
from .process import Runtime, process
from .producer import Publisher
from .settings import BROKER_CONSUMER_TIMEOUT_S
from .settle import Settler
from .topology import declare

log = logging.getLogger("weclaw_mq.worker")


class Worker:
    def __init__(
        self,
        app: App,
        *,
        concurrency: int | None = None,
        queues: Sequence[str] | None = None,
        shutdown_grace_s: float | None = None,
    ) -> None:
        self.app = app
        self.settings = app.settings
        self.concurrency = concurrency if concurrency is not None else app.settings.concurrency
        if self.concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {self.concurrency}")
        self.shutdown_grace_s = (
            shutdown_grace_s if shutdown_grace_s is not None else app.settings.shutdown_grace_s
        )
        self.specs = self._select(app, queues)
        self.ready = asyncio.Event()  # set while consuming; tests and health checks wait on it
        self._stop = asyncio.Event()
        # Per queue, for the in-flight gauge; every delivery being processed is in one set.
        self._in_flight: dict[str, set[asyncio.Task[None]]] = {s.queue: set() for s in self.specs}
        self._deadlines = Deadlines()
        for spec in self.specs:
            app.metrics.count_in_flight(spec.queue, self._in_flight[spec.queue].__len__)
        self._name = f"{app.name}-worker-{socket.gethostname()}-{os.getpid()}"

    @staticmethod
    def _select(app: App, queues: Sequence[str] | None) -> list[HandlerSpec]:
        if not app.handlers:
            raise ConfigurationError(f"app {app.name!r} has no handlers to run")
        if not queues:
            return list(app.handlers.values())
        unknown = [q for q in queues if q not in app.handlers]
        if unknown:
            raise ConfigurationError(
                f"no handler for queue(s) {', '.join(unknown)}; known: {', '.join(app.handlers)}"
            )
        return [app.handlers[q] for q in queues]

    def stop(self) -> None:
        """Take no new messages; ``run`` returns once in-flight ones finish or the grace ends."""
        self._stop.set()

    @property
    def in_flight(self) -> int:
        return sum(len(tasks) for tasks in self._in_flight.values())

    async def run(self) -> None:
        self._warn_about_consumer_timeout()
        self._check_redis_pool()
        failures = 0
        while not self._stop.is_set():
            conn = await self.app.broker.connect_with_retry(name=self._name, stop=self._stop)
            if conn is None:
                break
            if failures:
                self.app.metrics.reconnects.labels("worker").inc()
                log.info("reconnected to the broker")
            try:
                await self._session(conn)
                failures = 0
            except LINK_ERRORS as e:
                failures += 1
                log.warning("broker connection lost (%s: %s)", type(e).__name__, e)
            except asyncio.CancelledError:
                if cancelled_by_caller():
                    raise
                failures += 1
                log.warning("broker connection lost (aiormq cancelled the session)")
            finally:
                self.ready.clear()
                with contextlib.suppress(Exception):
                    await conn.close()
            if not self._stop.is_set() and failures:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._stop.wait(), backoff_s(failures, self.settings.reconnect_max_delay_s)
                    )
        await self._drain()

    async def _session(self, conn: AbstractConnection) -> None:
        """Consume on one connection until it dies (raises) or ``stop`` is called (returns)."""
        declare_channel = await conn.channel()
        await declare(declare_channel, [s.queue_spec() for s in self.specs])
        await declare_channel.close()

        channel = await conn.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=self.concurrency)
        publisher = Publisher(self.app.broker, self.app.metrics, name=self._name, connection=conn)
        runtime = Runtime(
            app=self.app,
            settings=self.settings,
            settler=Settler(publisher, self._deadlines),
            deadlines=self._deadlines,
            metrics=self.app.metrics,
            guard=self.app.guard,
            results=self.app.results,
        )
        consumers: list[tuple[AbstractQueue, str]] = []
        for spec in self.specs:
            queue = await channel.get_queue(spec.queue, ensure=False)
            tag = await queue.consume(self._dispatcher(spec, runtime))
            consumers.append((queue, tag))
        log.info(
            "consuming %s with concurrency %d",
            ", ".join(s.queue for s in self.specs),
            self.concurrency,
        )
        self.ready.set()

        stop = asyncio.ensure_future(self._stop.wait())
        lost = asyncio.ensure_future(_first(when_lost(conn), channel.closed()))
        try:
            await asyncio.wait({stop, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            lost.cancel()
        if not self._stop.is_set():
            raise aiormq.exceptions.ConnectionClosed(320, "connection or channel closed")
        # Stopping: take no new deliveries, then let the running handlers finish and ack
        # while the connection is still open.
        for queue, tag in consumers:
            with contextlib.suppress(*LINK_ERRORS):
                await queue.cancel(tag)
        await self._drain()

    def _dispatcher(
        self, spec: HandlerSpec, runtime: Runtime
    ) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
        in_flight = self._in_flight[spec.queue]

        async def on_message(message: AbstractIncomingMessage) -> None:
            if self._stop.is_set():
                # Arrived after we decided to stop: left unacked, the broker gives it to
                # another worker when this connection closes.
                self.app.metrics.settled(spec.queue, Outcome.REQUEUED).inc()
                return
            # Our own task, not aiormq's: aiormq cancels its callback tasks when the
            # connection drops, and a model call that is paid for should still finish and
            # store its result even if its ack can no longer be sent.
            task = asyncio.create_task(self._handle(message, spec, runtime))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

        return on_message

    @staticmethod
    async def _handle(message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime) -> None:
        try:
            await process(message, spec, rt)
        except Exception:
            # A bug of ours must not kill the consumer; the message stays unacked.
            log.exception("unexpected error while processing; the task will be redelivered")

    async def _drain(self) -> None:
        """Wait for in-flight handlers up to the grace period, then cancel the rest (unacked)."""
        running = set().union(*self._in_flight.values())
        if not running:
            return
        log.info(
            "waiting up to %.0f s for %d in-flight task(s)", self.shutdown_grace_s, len(running)
        )
        _, pending = await asyncio.wait(running, timeout=self.shutdown_grace_s)
        for task in pending:
            task.cancel()
        if pending:
            log.warning(
                "%d task(s) still running after the grace period were cancelled; "
                "they stay unacked and will be redelivered",
                len(pending),
            )
            await asyncio.wait(pending)

    def _check_redis_pool(self) -> None:
        if self.app.guard is None and self.app.results is None:
            return
        needed = 2 * self.concurrency * len(self.specs) + 8
        if needed > self.settings.redis_max_connections:
            raise ConfigurationError(
                f"concurrency {self.concurrency} on {len(self.specs)} queue(s) needs about "
                f"{needed} Redis connections, over WECLAW_MQ_REDIS_MAX_CONNECTIONS="
                f"{self.settings.redis_max_connections}; raise it or lower the concurrency"
            )

    def _warn_about_consumer_timeout(self) -> None:
        for spec in self.specs:
            if spec.timeout_s >= BROKER_CONSUMER_TIMEOUT_S:
                log.warning(
                    "handler for %r may run %.0f s, past RabbitMQ's consumer_timeout (30 min by "
                    "default): the broker would close the channel and requeue its messages. "
                    "Raise it in rabbitmq.conf, e.g. 'consumer_timeout = %d' (milliseconds)",
                    spec.queue,
                    spec.timeout_s,
                    int(spec.timeout_s * 1000 * 2),
                )


async def _first(*awaitables: object) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()

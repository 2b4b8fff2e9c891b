"""The worker's lifecycle: connect, declare, consume, reconnect, and stop without losing work.

``--concurrency N`` sets prefetch = N per handler queue and so at most N handlers in flight
per queue: a worker never holds a message it is not processing (prefetch=1, generalised).
A handler with priority lanes (``priority.plan_priorities``) is consumed by ``lanes``
instead: at most N in flight, and at most N + one message per lane held.

Every bound of a stop is here and in ``draining``: in-flight handlers get ``shutdown_grace_s``,
then are cancelled and get ``DRAIN_CANCEL_S`` to give their messages back; a handler that ignores
even that is left behind (its message returns to the queue when the connection closes).
The worker's other topics are its mixins: ``start_checks`` (checks and warnings at start),
``status`` (its heartbeat), ``subscriptions`` (a session's consumers and dispatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)

from weclaw_mq.app import App
from weclaw_mq.contract.undecodable import tolerant_properties
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.breaker import CircuitState
from weclaw_mq.scheduling.scheduler import Scheduler
from weclaw_mq.settings import duration_bounds
from weclaw_mq.state.fair_book import fair_book_of
from weclaw_mq.state.workflow_records import workflows_of
from weclaw_mq.wire.connection import (
    CLOSE_TIMEOUT_S,
    LINK_ERRORS,
    backoff_s,
    cancelled_by_caller,
    server_version,
    when_lost,
)
from weclaw_mq.wire.producer import Publisher
from weclaw_mq.wire.topology import declare
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.deadlines import Deadlines
from weclaw_mq.worker.draining import DRAIN_CANCEL_S as DRAIN_CANCEL_S
from weclaw_mq.worker.draining import Draining
from weclaw_mq.worker.fair_counts import count_forever
from weclaw_mq.worker.health import QueueState, WorkerHealth
from weclaw_mq.worker.in_flight import InFlight
from weclaw_mq.worker.lanes import LaneScheduler
from weclaw_mq.worker.long_runs import LongRuns
from weclaw_mq.worker.pausing import QueueCircuit
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.settle import Settler
from weclaw_mq.worker.start_checks import REDIS_CONNECTIONS_NEEDED as REDIS_CONNECTIONS_NEEDED
from weclaw_mq.worker.start_checks import StartChecks
from weclaw_mq.worker.status import Status
from weclaw_mq.worker.subscriptions import Subscriptions, _broker_cancels, _SingleConsumer
from weclaw_mq.worker.sync_threads import SyncThreads
from weclaw_mq.workflows.deadlines import sweep_forever

log = logging.getLogger("weclaw_mq.worker")

# Lanes serve their lowest lane by one bulk consumer while the upper lanes are quiet
# (worker.lanes, bulk mode). WECLAW_MQ_LANES_BULK=0 keeps the per-consumer mode throughout
# (for comparing the two; benchmarks/priority.py).
LANES_BULK = os.environ.get("WECLAW_MQ_LANES_BULK", "1") != "0"


class Worker(StartChecks, Status, Draining, Subscriptions):
    """Consumes the handler queues of an App and runs their handlers.

    Args:
        app: The App whose handlers it runs.
        concurrency: How many deliveries it runs at once; default
            ``settings.concurrency``.
        queues: The handler queues to consume; default every handler of ``app``.
        shutdown_grace_s: How long a stop waits for in-flight deliveries; default
            ``settings.shutdown_grace_s``.
        broker_load_check: Whether to read the broker's file-handle and memory use at start;
            default ``settings.broker_load_check`` (``--processes N`` asks in one child).
        schedules: Whether to run the App's scheduler too (``scheduling.scheduler``: every
            replica competes for its lease, one fires); default
            ``settings.schedules_in_worker``.

    Raises:
        ConfigurationError: ``concurrency`` under 1, a ``shutdown_grace_s`` out of the
            setting's bounds, an App with no handlers, or a queue with no handler.
    """

    def __init__(
        self,
        app: App,
        *,
        concurrency: int | None = None,
        queues: Sequence[str] | None = None,
        shutdown_grace_s: float | None = None,
        broker_load_check: bool | None = None,
        schedules: bool | None = None,
    ) -> None:
        self.app = app
        self.schedules = app.settings.schedules_in_worker if schedules is None else schedules
        self.settings = app.settings
        self.broker_load_check = (
            app.settings.broker_load_check if broker_load_check is None else broker_load_check
        )
        self.concurrency = concurrency if concurrency is not None else app.settings.concurrency
        if self.concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {self.concurrency}")
        self.shutdown_grace_s = (
            shutdown_grace_s if shutdown_grace_s is not None else app.settings.shutdown_grace_s
        )
        floor, ceiling = duration_bounds("shutdown_grace_s") or (0.0, 0.0)
        if not floor <= self.shutdown_grace_s <= ceiling:  # a NaN fails both
            raise ConfigurationError(
                f"shutdown_grace_s must be a number of seconds from {floor:g} to {ceiling:g}, "
                f"got {self.shutdown_grace_s!r}"
            )
        self.specs = self._select(app, queues)
        self.ready = asyncio.Event()  # set while consuming; tests and health checks wait on it
        self._stop = asyncio.Event()
        # Per queue, for the in-flight gauge; every delivery being processed is in one set.
        self._in_flight = InFlight(s.queue for s in self.specs)
        self._deadlines = Deadlines()
        # The threads of its plain-def handlers: one pool for the worker, across reconnects,
        # its threads made as calls need them and let go when ``run`` returns.
        self.sync_threads = SyncThreads(self.settings.sync_threads)
        # Cancel requests for the deliveries in flight (worker.cancel_watch).
        self.cancels = Cancels()
        # Its long runs, which hold no delivery (worker.long_runs); None without such handlers.
        self._long_runs = (
            LongRuns(self.concurrency) if any(s.long_running for s in self.specs) else None
        )
        if self._long_runs is not None and app.store is None:
            raise ConfigurationError(
                "long_running handlers need the task store: set WECLAW_MQ_REDIS_URL "
                "(a long run is resumed through its guard and watch in Redis)"
            )
        # Per worker, not per session: a reconnect keeps each breaker's state.
        self._circuits = {
            s.queue: QueueCircuit(s.queue, s.breaker, app.metrics)
            for s in self.specs
            if s.breaker is not None
        }
        for spec in self.specs:
            app.metrics.count_in_flight(spec.queue, self._in_flight.of(spec.queue).__len__)
        self._name = f"{app.name}-worker-{socket.gethostname()}-{os.getpid()}"
        # Its id in the worker registry (``weclaw-mq inspect``; worker.beat).
        self.worker_id = uuid.uuid4().hex[:16]
        # For health(), read from the metrics server's thread: the session's connections
        # (consuming, publishing), and the queues whose consumer the broker cancelled and
        # that are not consumed again yet.
        self._conn: AbstractConnection | None = None
        self._publishing: AbstractConnection | None = None
        self._recovering: set[str] = set()
        # The lane schedulers of the current session (each owns its consumers: worker.lanes).
        self._schedulers: list[LaneScheduler] = []
        # The App's scheduler, when this worker fires the schedules too (for ``health``).
        self._scheduler: Scheduler | None = None
        # Decided here, not at the first session: WECLAW_MQ_OTEL=on without the extra is a
        # configuration error before anything connects.
        self._spans = app.spans

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
        """How many deliveries are being processed now, across its queues."""
        return self._in_flight.count()

    def health(self) -> WorkerHealth:
        """Is this worker doing its job now: broker connection open, every queue consumed?

        Safe to call from another thread (the metrics server's).

        Returns:
            The broker connections' state and each queue's.
        """
        conn, publishing = self._conn, self._publishing
        both_open = all(c is not None and not c.is_closed for c in (conn, publishing))
        session = self.ready.is_set() and both_open
        queues: dict[str, QueueState] = {}
        for spec in self.specs:
            circuit = self._circuits.get(spec.queue)
            if not session or spec.queue in self._recovering:
                queues[spec.queue] = QueueState.DOWN
            elif circuit is not None and circuit.state is not CircuitState.CLOSED:
                queues[spec.queue] = QueueState.PAUSED
            else:
                queues[spec.queue] = QueueState.CONSUMING
        scheduler = self._scheduler
        threads = self.sync_threads
        return WorkerHealth(
            broker_open=both_open,
            queues=queues,
            scheduler=None if scheduler is None else scheduler.state,
            sync_threads=threads.size if any(s.is_sync for s in self.specs) else 0,
            sync_threads_stuck=threads.abandoned,
        )

    @property
    def abandoned(self) -> int:
        """Handlers still running that ignored their cancellation (they hold no message)."""
        return len(self._in_flight.abandoned)

    async def run(self) -> None:
        """Consume until ``stop``, reconnecting whenever the broker connection is lost.

        Raises:
            ConfigurationError: ``WECLAW_MQ_REDIS_MAX_CONNECTIONS`` is under what a worker
                needs (``REDIS_CONNECTIONS_NEEDED``).
        """
        self._warn_about_consumer_timeout()
        self._warn_about_sync_threads()
        self._check_redis_pool()
        # Startup hooks and resources, before anything connects: a failure starts nothing.
        await self.app.lifespan.open()
        try:
            await self._run_open()
        finally:
            # After the drain: no handler of this worker uses a resource any more.
            await self.app.lifespan.close()

    async def _run_open(self) -> None:
        # Without it, one message whose properties pamqp cannot decode closes the whole
        # connection and returns every message in flight with it, again and again until the
        # delivery limit dead-letters them all (innocent tasks lost to the DLQ:
        # tests/integration/test_undecodable_properties.py); read tolerantly, it arrives as a
        # marker that ``process`` rejects at once.
        store = self.app.store
        scheduler = Scheduler(self.app) if self.schedules and self.app.schedules else None
        if scheduler is not None:
            scheduler.book  # noqa: B018  an App without Redis fails the start, not the task
        self._scheduler = scheduler
        # One subscription to cancel requests for the whole worker, whatever its sessions.
        listener = asyncio.create_task(self.cancels.listen(store)) if store is not None else None
        announcer = asyncio.create_task(self._say_if_redis_is_away()) if listener else None
        # Off the start's path: rabbitmqctl takes about a second (weclaw_mq.wire.broker_load).
        load_check = (
            asyncio.create_task(self._warn_about_broker_load()) if self.broker_load_check else None
        )
        # What it runs, for 'weclaw-mq inspect': in the store's Redis, none without one.
        beat = self._beat(store)
        beating = asyncio.create_task(beat.run(self._stop)) if beat is not None else None
        # Workflows past their deadline (weclaw_mq.workflows.deadlines): every worker sweeps.
        sweeping = (
            asyncio.create_task(sweep_forever(self.app, self.settings.workflow_sweep_s))
            if workflows_of(store) is not None and self.app.results is not None
            else None
        )
        # The App's schedules, when this worker fires them too (--schedules): started again
        # if it dies, so a worker never stops firing them while it looks healthy.
        scheduling = (
            asyncio.create_task(scheduler.run_restarting()) if scheduler is not None else None
        )
        try:
            with tolerant_properties():
                await self._run()
        finally:
            self.sync_threads.shutdown()  # abandoned calls keep their daemon threads
            if scheduler is not None and scheduling is not None:
                scheduler.stop()  # gives the lease up at once: a standby takes over
                with contextlib.suppress(Exception):
                    await scheduling
            for task in (listener, announcer, load_check, beating, sweeping):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if beat is not None:
                await beat.leave()

    async def _run(self) -> None:
        failures = 0
        conn: AbstractConnection | None = None
        publishing: AbstractConnection | None = None
        try:
            while not self._stop.is_set():
                conn = await self.app.broker.connect_with_retry(name=self._name, stop=self._stop)
                if conn is None:
                    break
                # Its own connection: under a memory or disk alarm RabbitMQ blocks a connection
                # that publishes, and the acks on it would wait too (RabbitMQ's advice).
                publishing = await self.app.broker.connect_with_retry(
                    name=f"{self._name}-publish", stop=self._stop
                )
                if publishing is None:
                    break
                if failures:
                    self.app.metrics.reconnects.labels("worker").inc()
                    log.info("reconnected to the broker")
                try:
                    await self._session(conn, publishing)
                    break  # it returns only when stopping: the connections stay open to drain
                except LINK_ERRORS as e:
                    failures += 1
                    log.warning("broker connection lost (%s: %s)", type(e).__name__, e)
                except asyncio.CancelledError:
                    if cancelled_by_caller():
                        raise
                    failures += 1
                    log.warning("broker connection lost (aiormq cancelled the session)")
                self.ready.clear()
                await asyncio.gather(_close(conn), _close(publishing))
                conn = publishing = None
                if not self._stop.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(
                            self._stop.wait(),
                            backoff_s(failures, self.settings.reconnect_max_delay_s),
                        )
            # The one drain of a stop: with the connection still open when there is one, so
            # handlers finishing within the grace can still store and ack; after a lost
            # connection, handlers of the old session still get to store their results.
            await self._drain()
        finally:
            self.ready.clear()
            await asyncio.gather(*(_close(c) for c in (conn, publishing) if c is not None))

    async def _session(self, conn: AbstractConnection, publishing: AbstractConnection) -> None:
        """Consume on ``conn`` and publish (retries, dead letters, notifications) on
        ``publishing`` until either dies (raises) or ``stop`` is called (returns)."""
        self._conn, self._publishing = conn, publishing
        try:
            await self._consume(conn, publishing)
        finally:
            self._conn = self._publishing = None
            if self._long_runs is not None:
                self._long_runs.attach(None)  # its consumers end with the session
            self._recovering.clear()
            # Its lane schedulers end with it: none starts a task or adopts a delivery of a
            # session that is gone (a stop has already stopped them).
            for scheduler in self._schedulers:
                scheduler.retire()
            self._schedulers = []

    async def _channels(
        self, conn: AbstractConnection, *, laned: bool
    ) -> tuple[AbstractChannel, AbstractChannel, AbstractChannel | None]:
        """A session's consuming channel (prefetch = concurrency), its lane consumers' (the
        same one without laned handlers) and its lanes' bulk consumers' (None without)."""
        channel = await conn.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=self.concurrency)
        # Lane consumers hold one message each (worker.lanes): their own channel, prefetch 1.
        lane_channel = channel
        # The lanes' bulk consumers (worker.lanes, bulk mode): one prefetch-(C + 1) consumer
        # of each laned handler's lowest lane, on a channel of their own (basic.qos applies
        # per consumer, to consumers created after it).
        bulk_channel: AbstractChannel | None = None
        if laned:
            lane_channel = await conn.channel(publisher_confirms=False)
            await lane_channel.set_qos(prefetch_count=1)
            if LANES_BULK:
                bulk_channel = await conn.channel(publisher_confirms=False)
                await bulk_channel.set_qos(prefetch_count=self.concurrency + 1)
        return channel, lane_channel, bulk_channel

    async def _serve(
        self,
        conn: AbstractConnection,
        publishing: AbstractConnection,
        channels: tuple[AbstractChannel, AbstractChannel, AbstractChannel],
        watches: list[Coroutine[Any, Any, None]],
        cancelled: asyncio.Queue[str],
        runtime: Runtime,
        consumers: dict[str, tuple[HandlerSpec, AbstractQueue]],
        pausable: dict[str, _SingleConsumer],
    ) -> None:
        """Until ``stop`` or a lost connection, channel or breaker watch (returns either way),
        subscribe again each consumer the broker cancels."""
        channel, lane_channel, bulk_channel = channels
        stop = asyncio.ensure_future(self._stop.wait())
        lost = asyncio.ensure_future(
            # A breaker's watch returns only when it could not change the consumers.
            _first(
                when_lost(conn),
                when_lost(publishing),
                channel.closed(),
                lane_channel.closed(),
                bulk_channel.closed(),
                *watches,
            )
        )
        try:
            while not (stop.done() or lost.done()):
                next_cancel = asyncio.ensure_future(cancelled.get())
                try:
                    await asyncio.wait(
                        {stop, lost, next_cancel}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    next_cancel.cancel()
                if next_cancel.done() and not next_cancel.cancelled():
                    if stop.done() or lost.done():
                        continue
                    await self._broker_cancelled(
                        next_cancel.result(), conn, channel, runtime, consumers, pausable
                    )
        finally:
            stop.cancel()
            lost.cancel()

    async def _consume(self, conn: AbstractConnection, publishing: AbstractConnection) -> None:
        declare_channel = await conn.channel()
        await declare(declare_channel, [s.queue_spec() for s in self.specs])
        await declare_channel.close()

        version = server_version(conn)
        laned = [s for s in self.specs if len(s.queue_spec().lane_queues(version)) > 1]
        single = [s for s in self.specs if s not in laned]
        channel, lane_channel, bulk_channel = await self._channels(conn, laned=bool(laned))
        schedulers: list[LaneScheduler] = []
        self._schedulers = schedulers
        runtime = self._runtime(publishing, schedulers if laned else None)
        cancelled = await _broker_cancels({channel, lane_channel, bulk_channel or channel})
        consumers: dict[str, tuple[HandlerSpec, AbstractQueue]] = {}
        watches: list[Coroutine[Any, Any, None]] = []
        # The breaker-paused consumers of single handlers, by queue (their pause state).
        pausable: dict[str, _SingleConsumer] = {}
        for spec in single:
            await self._subscribe(channel, spec, runtime, consumers, pausable, watches)
        if self._long_runs is not None:
            self._long_runs.attach(functools.partial(_room, pausable, set()))
        for spec in laned:
            scheduler = self._lane_scheduler(
                conn, lane_channel, spec, runtime, version, bulk_channel
            )
            schedulers.append(scheduler)
            await scheduler.start()
            if spec.queue in self._circuits:
                watches.append(self._watch(spec, runtime, scheduler))
        # Fair-share lanes' counts for the producers (worker.fair_counts), while consuming.
        fair = [s for s in laned if s.fair is not None]
        book = fair_book_of(self.app.store) if fair else None
        counting = (
            asyncio.create_task(count_forever(conn, fair, book)) if book is not None else None
        )
        log.info(
            "consuming %s with concurrency %d",
            ", ".join(s.queue for s in self.specs),
            self.concurrency,
        )
        self.ready.set()

        try:
            await self._serve(
                conn,
                publishing,
                (channel, lane_channel, bulk_channel or channel),
                watches,
                cancelled,
                runtime,
                consumers,
                pausable,
            )
        finally:
            if counting is not None:
                counting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await counting
        if not self._stop.is_set():
            raise aiormq.exceptions.ConnectionClosed(320, "connection or channel closed")
        # Stopping: take no new deliveries; ``_run`` then lets the running handlers finish
        # and ack while the connection is still open.
        for tag, (_, queue) in list(consumers.items()):
            with contextlib.suppress(asyncio.TimeoutError, *LINK_ERRORS):
                await asyncio.wait_for(queue.cancel(tag), CLOSE_TIMEOUT_S)
        for scheduler in schedulers:
            await scheduler.stop()

    def _runtime(
        self, publishing: AbstractConnection, schedulers: list[LaneScheduler] | None
    ) -> Runtime:
        """What every delivery of this session needs; ``schedulers``: the lanes to release a
        settled delivery's slot in, None without laned handlers."""
        publisher = Publisher(
            self.app.broker, self.app.metrics, name=self._name, connection=publishing
        )
        return Runtime(
            app=self.app,
            settings=self.settings,
            settler=Settler(
                publisher,
                self._deadlines,
                self.app.metrics,
                before_settle=None
                if schedulers is None
                else functools.partial(_release, schedulers),
                retry_level=logging.getLevelName(self.settings.retry_log_level),
                tracebacks=self.settings.failure_tracebacks,
                observed=any(
                    (chain := self.app.handler_chain(s)) is not None and chain.afters
                    for s in self.specs
                ),
            ),
            deadlines=self._deadlines,
            threads=self.sync_threads,
            metrics=self.app.metrics,
            store=self.app.store,
            results=self.app.results,
            take_over=self._in_flight.replace,
            cancels=self.cancels,
            circuits=self._circuits,
            spans=self._spans,
            hooks=self.app.middleware if self.app.middleware.runs else None,
            long_runs=self._long_runs,
        )


async def _release(schedulers: list[LaneScheduler], message: AbstractIncomingMessage) -> None:
    """Before a settle: the lane scheduler whose consumer delivered ``message`` frees its slot."""
    for scheduler in schedulers:
        if scheduler.owns(message):
            await scheduler.release(message)
            return


def _room(
    pausable: dict[str, _SingleConsumer], pending: set[asyncio.Task[None]], queue: str, full: bool
) -> None:
    """A queue's long runs filled the worker, or one ended: pause or resume its consumer."""
    consumer = pausable.get(queue)
    if consumer is None:
        return  # a laned handler: its lane slots stay taken until its runs end
    task = asyncio.ensure_future(consumer.room(full))
    pending.add(task)
    task.add_done_callback(_forget_room)
    task.add_done_callback(pending.discard)


def _forget_room(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:  # a closing channel: the session ends
        log.debug("could not pause or resume a consumer: %s", task.exception())


async def _close(conn: AbstractConnection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(conn.close(), CLOSE_TIMEOUT_S)


async def _first(*awaitables: object) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()

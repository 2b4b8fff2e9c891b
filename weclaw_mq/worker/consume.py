"""The worker's lifecycle: connect, declare, consume, reconnect, and stop without losing work.

``--concurrency N`` sets prefetch = N per handler queue and so at most N handlers in flight
per queue: a worker never holds a message it is not processing (prefetch=1, generalised).
A handler with priority lanes (``priority.plan_priorities``) is consumed by ``lanes``
instead: at most N in flight, and at most N + one message per lane held.

Every bound of a stop is here: in-flight handlers get ``shutdown_grace_s``, then are cancelled
and get ``DRAIN_CANCEL_S`` to give their messages back; a handler that ignores even that is
left behind (its message returns to the queue when the connection closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
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
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.policy.failures import describe
from weclaw_mq.scheduling.scheduler import Scheduler
from weclaw_mq.settings import BROKER_CONSUMER_TIMEOUT_S, duration_bounds
from weclaw_mq.state.cost_ledger import CostLedger, ledger_of
from weclaw_mq.state.fair_book import fair_book_of
from weclaw_mq.state.model_health import ModelHealth, health_of
from weclaw_mq.state.worker_registry import registry_of
from weclaw_mq.state.workflow_records import workflows_of
from weclaw_mq.wire.broker_load import read_broker_load
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
from weclaw_mq.worker import ends
from weclaw_mq.worker.beat import Beat
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.deadlines import Deadlines
from weclaw_mq.worker.fair_counts import count_forever
from weclaw_mq.worker.health import QueueState, WorkerHealth
from weclaw_mq.worker.in_flight import InFlight
from weclaw_mq.worker.incoming import consume
from weclaw_mq.worker.lanes import LaneScheduler
from weclaw_mq.worker.limiting import Limiter
from weclaw_mq.worker.pausing import Pausable, QueueCircuit
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.settle import Settler
from weclaw_mq.worker.sync_threads import SyncThreads
from weclaw_mq.workflows.deadlines import sweep_forever

log = logging.getLogger("weclaw_mq.worker")

# Lanes serve their lowest lane by one bulk consumer while the upper lanes are quiet
# (worker.lanes, bulk mode). WECLAW_MQ_LANES_BULK=0 keeps the per-consumer mode throughout
# (for comparing the two; benchmarks/priority.py).
LANES_BULK = os.environ.get("WECLAW_MQ_LANES_BULK", "1") != "0"

# After the grace, cancelled handlers get this long to give their messages back.
DRAIN_CANCEL_S = 5.0

# The most connections one of a worker's Redis pools takes, whatever its concurrency: the
# store's auto-pipeline (one round trip at a time), its cancel subscription and one lone
# command (state.redis); the stream store's writes (streaming.redis.WRITES_IN_FLIGHT); the
# limiter's round trips (worker.limiting.ROUND_TRIPS_IN_FLIGHT) and its renewer.
REDIS_CONNECTIONS_NEEDED = 8


class Worker:
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
        # Tasks whose handler ignored its cancellation: they hold no message any more, are no
        # longer in flight, and a stop does not wait for them.
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._deadlines = Deadlines()
        # The threads of its plain-def handlers: one pool for the worker, across reconnects,
        # its threads made as calls need them and let go when ``run`` returns.
        self.sync_threads = SyncThreads(self.settings.sync_threads)
        # One per run, across reconnects: the slots it holds outlive a broker session.
        self._limiter: Limiter | None = None
        # Where the App's reported model usage is costed and recorded (App(prices=)).
        self._ledger: CostLedger | None = None
        # Where the models of its handlers' fallback chains are known up or down.
        self._health: ModelHealth | None = None
        # Cancel requests for the deliveries in flight (worker.cancel_watch).
        self.cancels = Cancels()
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
        return len(self._abandoned)

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
        if self.app.prices:
            self._ledger = ledger_of(
                store,
                self.app.name,
                usage_ttl_s=self.settings.result_ttl_s,
                days_kept=self.settings.cost_days_kept,
            )
        if any(s.fallback is not None for s in self.specs):
            self._health = health_of(store, self.app.name)
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

    def _beat(self, store: object) -> Beat | None:
        registry = registry_of(store)
        if registry is None:
            return None
        return Beat(
            registry,
            worker_id=self.worker_id,
            app=self.app.name,
            queues=[s.queue for s in self.specs],
            concurrency=self.concurrency,
            cancels=self.cancels,
            state=self._state,
            interval_s=self.settings.worker_beat_s,
            leave_timeout_s=self.settings.redis_timeout_s,
            breakers=self._open_breakers,
            sync_threads=self._sync_thread_counts,
        )

    def _sync_thread_counts(self) -> tuple[int, int]:
        """(threads, held by calls past their timeout): (0, 0) without plain-def handlers."""
        health = self.health()
        return health.sync_threads, health.sync_threads_stuck

    def _open_breakers(self) -> dict[str, str]:
        """This worker's breakers that are not closed, for its heartbeat (the console)."""
        return {
            queue: circuit.state.value
            for queue, circuit in self._circuits.items()
            if circuit.state is not CircuitState.CLOSED
        }

    def _state(self) -> str:
        if self._stop.is_set():
            return "stopping"
        return "consuming" if self.ready.is_set() else "connecting"

    async def _say_if_redis_is_away(self) -> None:
        """Once, at start: a Redis that does not answer, and what the worker does meanwhile
        (it consumes, and the log would otherwise look healthy); then once when it answers."""
        wait_s = self.settings.redis_timeout_s + 1.0  # a refused connect fails well before
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.cancels.listening.wait(), wait_s)
            return
        meanwhile = []
        if any(s.idempotent for s in self.specs):
            if self.settings.guard_on_redis_down == "run_unguarded":
                meanwhile.append("guarded tasks run UNGUARDED (GUARD_ON_REDIS_DOWN=run_unguarded)")
            else:
                meanwhile.append("guarded tasks wait in their delay queues, never run unguarded")
        if self.app.results is not None:
            meanwhile.append(
                "results cannot be stored (a finished task goes back to its queue after "
                f"{self.settings.result_store_patience_s:g} s)"
            )
        meanwhile.append("cancel requests go unheard")
        log.warning(
            "Redis at %s does not answer (no reply within %.0f s): the worker consumes, but "
            "until Redis answers %s",
            self.settings.redis_url_redacted(),
            wait_s,
            "; ".join(meanwhile),
        )
        await self.cancels.listening.wait()
        log.info("Redis answers now: guarded tasks run, cancel requests are heard")

    async def _warn_about_broker_load(self) -> None:
        """One line at start when the broker is within 10 % of its file-handle or memory
        limit, where that can be read at all (``broker_load``)."""
        url = self.settings.amqp_urls()[0]
        load = await asyncio.to_thread(read_broker_load, url)
        if load is not None and (warning := load.warning()) is not None:
            log.warning("%s", warning)

    async def _run(self) -> None:
        failures = 0
        conn: AbstractConnection | None = None
        publishing: AbstractConnection | None = None
        if any(s.limits or s.cap is not None for s in self.specs):  # a cap reserves there
            self._limiter = Limiter.open(self.settings)
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
            if self._limiter is not None:
                limiter, self._limiter = self._limiter, None
                await limiter.close()

    async def _session(self, conn: AbstractConnection, publishing: AbstractConnection) -> None:
        """Consume on ``conn`` and publish (retries, dead letters, notifications) on
        ``publishing`` until either dies (raises) or ``stop`` is called (returns)."""
        self._conn, self._publishing = conn, publishing
        try:
            await self._consume(conn, publishing)
        finally:
            self._conn = self._publishing = None
            self._recovering.clear()
            # Its lane schedulers end with it: none starts a task or adopts a delivery of a
            # session that is gone (a stop has already stopped them).
            for scheduler in self._schedulers:
                scheduler.retire()
            self._schedulers = []

    async def _consume(self, conn: AbstractConnection, publishing: AbstractConnection) -> None:
        declare_channel = await conn.channel()
        await declare(declare_channel, [s.queue_spec() for s in self.specs])
        await declare_channel.close()

        version = server_version(conn)
        laned = [s for s in self.specs if len(s.queue_spec().lane_queues(version)) > 1]
        single = [s for s in self.specs if s not in laned]
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

        stop = asyncio.ensure_future(self._stop.wait())
        lost = asyncio.ensure_future(
            # A breaker's watch returns only when it could not change the consumers.
            _first(
                when_lost(conn),
                when_lost(publishing),
                channel.closed(),
                lane_channel.closed(),
                (bulk_channel or channel).closed(),
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
        if spec.queue in self._circuits:
            on_message = self._dispatcher(spec, runtime)
            single_consumer = _SingleConsumer(
                spec, queue, on_message, consumers, self._stop, self._recovering
            )
            pausable[spec.queue] = single_consumer
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
                observed=self.app.middleware.runs,
            ),
            deadlines=self._deadlines,
            threads=self.sync_threads,
            metrics=self.app.metrics,
            store=self.app.store,
            results=self.app.results,
            take_over=self._take_over,
            limiter=self._limiter,
            cancels=self.cancels,
            circuits=self._circuits,
            spans=self._spans,
            hooks=self.app.middleware if self.app.middleware.runs else None,
            ledger=self._ledger,
            health=self._health,
        )

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

    def _take_over(
        self,
        message: AbstractIncomingMessage,
        spec: HandlerSpec,
        rt: Runtime,
        stuck: asyncio.Task[Any],
        ending: Coroutine[Any, Any, None],
    ) -> None:
        """Run ``ending`` (the delivery's failure path) in place of ``stuck``, whose handler
        ignored its cancellation: the slot and the message are freed, the handler left."""
        self._abandoned.add(stuck)
        stuck.add_done_callback(self._abandoned.discard)
        self._in_flight.replace(message, spec, rt, stuck, ending)

    async def _drain(self) -> None:
        """Wait for in-flight handlers up to the grace period, then cancel the rest; they
        give their messages back. Bounded: a handler that ignores its cancellation is left."""
        running = self._in_flight.all()
        if not running:
            return
        log.info(
            "waiting up to %.0f s for %d in-flight task(s)", self.shutdown_grace_s, len(running)
        )
        _, pending = await asyncio.wait(running, timeout=self.shutdown_grace_s)
        if not pending:
            return
        for task in pending:
            task.cancel()
        log.warning(
            "%d task(s) still running after the grace period were cancelled; their messages "
            "go back to the queue",
            len(pending),
        )
        _, stuck = await asyncio.wait(pending, timeout=DRAIN_CANCEL_S)
        if stuck:
            log.error(
                "%d handler(s) ignored their cancellation; leaving them behind (their messages "
                "return to the queue when the connection closes)",
                len(stuck),
            )
            for task in stuck:
                self._in_flight.forget(task)
                self._abandoned.add(task)
                task.add_done_callback(self._abandoned.discard)

    def _check_redis_pool(self) -> None:
        if self.app.store is None:
            return
        if self.settings.redis_max_connections < REDIS_CONNECTIONS_NEEDED:
            raise ConfigurationError(
                f"a worker needs up to {REDIS_CONNECTIONS_NEEDED} Redis connections per pool, "
                f"over WECLAW_MQ_REDIS_MAX_CONNECTIONS={self.settings.redis_max_connections}; "
                "raise it"
            )

    def _warn_about_sync_threads(self) -> None:
        sync = [s.queue for s in self.specs if s.is_sync]
        if len(sync) * self.concurrency > self.sync_threads.size:
            log.warning(
                "plain-def handler(s) of %s may run %d calls at once (concurrency %d each), "
                "over WECLAW_MQ_SYNC_THREADS=%d: the calls beyond it wait for a thread under "
                "their timeout",
                ", ".join(sync),
                len(sync) * self.concurrency,
                self.concurrency,
                self.sync_threads.size,
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

    async def pause(self) -> None:
        self.paused = True
        for tag, (spec, queue) in list(self.consumers.items()):
            if spec is self.spec:
                del self.consumers[tag]
                await queue.cancel(tag)

    async def resume(self) -> None:
        self.paused = False
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


async def _release(schedulers: list[LaneScheduler], message: AbstractIncomingMessage) -> None:
    """Before a settle: the lane scheduler whose consumer delivered ``message`` frees its slot."""
    for scheduler in schedulers:
        if scheduler.owns(message):
            await scheduler.release(message)
            return


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

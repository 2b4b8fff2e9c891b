"""``TestBroker``: run an app's handlers in memory with the worker's own code.

    async with TestBroker(app) as broker:
        task_id = await app.publish("summaries", {"text": "..."})
        await broker.run_until_idle()
        state = await app.status(task_id)

What is the worker's own code here: every delivery goes through
``weclaw_mq.worker.delivery.process`` (decode, guard, call, store, decide, settle), started,
counted and replaced by the worker's own ``worker.in_flight.InFlight`` (with its ``settled``
wrapper), with a ``Settler`` whose moves are the same "publish a copy, then ack" to the same
delay and dead-letter queues; publishes go through
``App.publish`` unchanged. Only what is under them is swapped, while the broker is open:

- the broker: ``queues.MemoryBroker`` keeps RabbitMQ's rules for our topology (delay queues
  that dead-letter back by TTL, the DLQ, x-death, the delivery limit) and is reached through
  the ``Publisher`` seam (``MemoryPublisher``), by the app and the worker alike;
- Redis: a ``MemoryTaskStore`` (guard, records, cancels) and a ``MemoryStreamStore``, shared
  by the apps given (as one Redis would be);
- time: ``VirtualClock`` (see ``clock``). ``run_until_idle`` runs every ready delivery, and
  when only delay queues hold tasks, moves the clock to the next one instead of waiting.

Not modelled (they need Redis or a live consumer): per-key limits (``limit=``) are not
enforced, circuit breakers (``breaker=``) never open, and the local outbox is bypassed.
Workflows (``App.chain``, ``App.group``) run as on a worker; their deadlines are swept each
time the broker goes idle (``advance`` the clock past one to see it end a workflow).
Priority lanes are served highest first (the starvation limit is not modelled).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aio_pika

from weclaw_mq.admin.dlq_message import DeadLetter, read_dead_letter
from weclaw_mq.app import App
from weclaw_mq.contract import lifetime
from weclaw_mq.contract.message import build_message, new_task_id
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.errors import ConfigurationError, PublishNackedError, UnroutableError
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.state import MemoryTaskStore
from weclaw_mq.streaming import MemoryStreamStore
from weclaw_mq.testing.clock import VirtualClock
from weclaw_mq.testing.queues import MemoryBroker, MemoryQueue
from weclaw_mq.wire.producer import Publisher
from weclaw_mq.wire.topology import delay_exchanges, ladder_declarations, queue_declarations
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.deadlines import Deadlines
from weclaw_mq.worker.in_flight import InFlight
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.settle import Settler
from weclaw_mq.worker.sync_threads import SyncThreads
from weclaw_mq.workflows.deadlines import sweep

log = logging.getLogger("weclaw_mq.testing")

# A run that delivers this many messages without going idle is taken for a loop (a task that
# keeps handing itself back, a handler that publishes forever).
MAX_DELIVERIES = 10_000


class MemoryPublisher(Publisher):
    """The ``Publisher`` seam: confirmed publishing, into the test broker's memory."""

    def __init__(self, broker: MemoryBroker, app: App) -> None:
        super().__init__(app.broker, app.metrics, name=f"{app.name}-test-broker")
        self._memory = broker

    async def connect(self) -> None:
        return None

    async def server_version(self) -> ServerVersion | None:
        return None  # unknown: priorities take lanes, as on RabbitMQ 3.x

    async def publish(self, queue: str, message: aio_pika.Message, *, exchange: str = "") -> None:
        counted = exchange or queue  # as Publisher counts it
        try:
            self._memory.publish(queue, message, exchange=exchange)
        except UnroutableError:
            self._count(counted, "unroutable")
            raise
        except PublishNackedError:
            self._count(counted, "nacked")
            raise
        self._count(counted, "confirmed")

    async def close(self) -> None:
        return None


class TestBroker:
    """An in-memory RabbitMQ and Redis for ``apps``, with their handlers run by the worker's
    code; an async context manager. Pass every app of a test that publishes or handles (a
    producer app and a worker app share it, as they would share a broker).

    ``concurrency``: deliveries in flight per handler queue (default: each app's
    ``settings.concurrency``).
    """

    __test__ = False  # not a test class, whatever pytest makes of its name

    def __init__(self, app: App, *more: App, concurrency: int | None = None) -> None:
        self.apps = [app, *more]
        if concurrency is not None and concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
        self._concurrency = concurrency
        # Fair-share lanes: per handler queue, the serial of each lane's latest start.
        self._served: dict[str, dict[str, int]] = {}
        self._serial = 0
        self.clock = VirtualClock()
        self.memory = MemoryBroker(self.clock)
        first = app.settings
        self.store = MemoryTaskStore(
            ttl_s=first.result_ttl_s,
            lease_s=first.guard_lease_s,
            done_ttl_s=first.done_ttl_s,
            clock=self.clock.monotonic,
            task_index=first.task_index,
            task_index_max_entries=first.task_index_max_entries,
            task_index_max_age_s=first.task_index_max_age_s,
        )
        self.streams = MemoryStreamStore(
            inbox_ttl_s=first.inbox_ttl_s,
            inbox_max_entries=first.inbox_max_entries,
            clock=self.clock.time,
        )
        self.cancels = Cancels()
        self._deadlines = Deadlines()
        # Plain-def handlers run in threads, as in a worker: one pool, closed on exit.
        self._threads = SyncThreads(first.sync_threads)
        # Per handler queue: its spec, the runtime of its app, and its deliveries in flight.
        self._handlers: dict[str, tuple[HandlerSpec, Runtime]] = {}
        self._in_flight = InFlight()
        # Per app swapped: (holder, attribute, value before) of each slot, to put back.
        self._saved: list[list[tuple[object, str, Any]]] = []
        self._listener: asyncio.Task[None] | None = None
        # The apps whose lifespan this broker opened, to close on exit (last first).
        self._opened: list[App] = []
        self._previous_clock: Any = None
        self._counted_before: dict[str, dict[str, int]] = {}

    # -- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> TestBroker:
        try:
            for app in self.apps:
                self._attach(app)
            shared = [s.queue_spec() for app in self.apps for s in app.handlers.values()]
            for name, arguments in ladder_declarations(shared):
                self.memory.declare(name, arguments)
            for app in self.apps:
                for spec in app.handlers.values():
                    for name, arguments in queue_declarations(spec.queue_spec()):
                        self.memory.declare(name, arguments)
                    for exchange in delay_exchanges(spec.queue_spec()):
                        self.memory.declare_fanout(exchange, exchange)
            # The apps' counters live as long as the apps (a module's app serves many tests).
            self._counted_before = {
                queue: outcome_counts(runtime.app, queue)
                for queue, (_, runtime) in self._handlers.items()
            }
            self._previous_clock = lifetime.use_wall_clock(self.clock.time)
            self._listener = asyncio.create_task(self.cancels.listen(self.store))
            await self.cancels.listening.wait()
            # Each app's startup hooks and resources, as its worker opens them.
            for app in self.apps:
                await app.lifespan.open()
                self._opened.append(app)
        except BaseException:
            await self.__aexit__()  # the apps given back as they were
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        running = self._running()
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait({self._listener})
        self._threads.shutdown()
        while self._opened:  # after the handlers: none of them uses a resource any more
            await self._opened.pop().lifespan.close()
        if self._previous_clock is not None:
            lifetime.use_wall_clock(self._previous_clock)
        # Those swapped so far, last first: an app given twice ends as it was before the first.
        for saved in reversed(self._saved):
            for holder, name, value in saved:
                setattr(holder, name, value)

    def _attach(self, app: App) -> None:
        """Swap the app's broker, stores and outbox for ours (put back on exit) and build the
        worker runtime its handlers run in."""
        # The slots of App, its publishing engine and its results reader that the test kit
        # swaps: the seam it shares with them, and nothing else uses.
        engine, reader = app._engine, app._reader
        slots = (
            (app, "_store"),
            (app, "_owns_store"),
            (engine, "publisher"),
            (engine, "local"),
            (reader, "_streams"),
            (reader, "_owns_streams"),
            # The LLM layer's state needs Redis: the test kit runs without those features.
            (app._models, "used"),
        )
        self._saved.append([(holder, name, getattr(holder, name)) for holder, name in slots])
        publisher = MemoryPublisher(self.memory, app)
        engine.publisher = publisher
        # As the app would open Redis: only when results are on or a handler is guarded.
        if (
            app._store is not None
            or app.settings.results_enabled
            or any(s.idempotent for s in app.handlers.values())
        ):
            app._store, app._owns_store = self.store, False
        reader._streams, reader._owns_streams = self.streams, False
        app._models.used = False
        engine.local = None
        runtime = Runtime(
            app=app,
            settings=app.settings,
            settler=Settler(
                publisher,
                self._deadlines,
                app.metrics,
                retry_level=logging.getLevelName(app.settings.retry_log_level),
                tracebacks=app.settings.failure_tracebacks,
                observed=app.middleware.afters,
            ),
            deadlines=self._deadlines,
            metrics=app.metrics,
            store=app.store,
            results=app.results,
            # A handler that ignores its cancellation is left running, as in the Worker.
            take_over=self._in_flight.replace,
            cancels=self.cancels,
            threads=self._threads,
            hooks=app.middleware if app.middleware.runs else None,
            # The App's middleware alone: the LLM layer's (limits, caps, costs, fallbacks)
            # needs Redis, which the test kit does without.
            handler_middleware=False,
        )
        for queue, spec in app.handlers.items():
            if queue in self._handlers:
                raise ConfigurationError(
                    f"queue {queue!r} has a handler in two of the apps given to TestBroker"
                )
            self._handlers[queue] = (spec, runtime)
            self._in_flight.add_queue(queue)

    # -- running --------------------------------------------------------------------------
    async def run_until_idle(self, *, advance_clock: bool = True) -> None:
        """Deliver until nothing is ready and no handler runs.

        With ``advance_clock`` (the default), tasks parked in delay queues (retries, deferred
        and delayed tasks) are then brought back by moving the clock to when each is due, so
        a retry policy of 5 s, 10 s, 20 s runs through in milliseconds; without, only what is
        due by now runs (move the clock with ``advance``).
        """
        delivered = 0
        while True:
            delivered += self._start_ready()
            if delivered > MAX_DELIVERIES:
                raise RuntimeError(
                    f"the test broker delivered {MAX_DELIVERIES} messages without going idle: "
                    "a task that keeps coming back, or a handler that publishes without end?"
                )
            running = self._running()
            if running:
                self.memory.arrived.clear()
                arrived = asyncio.ensure_future(self.memory.arrived.wait())
                try:
                    await asyncio.wait({*running, arrived}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    arrived.cancel()
                continue
            # Idle: workflows past their deadline end now, as a worker's sweep ends them
            # (their lost parts are cancelled, which may start nothing, or a copy's ack).
            if await self._sweep_workflows():
                continue
            if not advance_clock:
                return
            due = self.memory.next_delay_due_ms()
            if due is None:
                return
            self.clock.advance_to_ms(due)

    async def _sweep_workflows(self) -> int:
        ended = 0
        for app in self.apps:
            if app.results is self.store:
                ended += await sweep(app)
        return ended

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (then ``run_until_idle`` runs what is due)."""
        self.clock.advance(seconds)

    def _start_ready(self) -> int:
        started = 0
        for queue, (spec, runtime) in self._handlers.items():
            limit = self._concurrency or runtime.settings.concurrency
            in_flight = self._in_flight.of(queue)
            # Highest level first (Q itself is a NORMAL lane); the lanes of one level (fair
            # share) in turn, the one served least recently first.
            levels = spec.queue_spec().lane_levels(None)
            served = self._served.setdefault(queue, {})
            while len(in_flight) < limit:
                message = None
                for rank in sorted({rank for _, rank in levels}):
                    peers = [lane for lane, r in levels if r == rank]
                    for lane in sorted(peers, key=lambda lane: served.get(lane, 0)):
                        message = self.memory.deliver(lane)
                        if message is not None:
                            self._serial += 1
                            served[lane] = self._serial
                            break
                    if message is not None:
                        break
                if message is None:
                    break
                self._in_flight.start(message, spec, runtime)
                started += 1
        return started

    def _running(self) -> set[asyncio.Task[None]]:
        return self._in_flight.all()

    # -- publishing as another producer ---------------------------------------------------
    async def publish_raw(
        self,
        queue: str,
        body: bytes,
        *,
        task_id: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> str:
        """Publish ``body`` as is, as a producer that is not an ``App`` would (no checks):
        for a test of what the handler does with a body its model refuses. Returns the id."""
        task_id = task_id or new_task_id()
        self.memory.publish(queue, build_message(body, task_id=task_id, headers=headers or {}))
        return task_id

    def purge(self, queue: str, *, task_id: str | None = None) -> int:
        """Remove the ready messages of ``queue`` (only ``task_id``'s, if given), as an
        operator's purge would: nothing is recorded and no worker sees them. How many."""
        messages = self._queue(queue).messages
        kept = [m for m in messages if task_id is not None and m.task_id != task_id]
        removed = len(messages) - len(kept)
        messages.clear()
        messages.extend(kept)
        return removed

    # -- looking ----------------------------------------------------------------------------
    def dead_letters(self, queue: str) -> list[DeadLetter]:
        """What ``weclaw-mq dlq list`` would show for handler queue ``queue``, oldest first
        (read as the DLQ tools read it; nothing is taken)."""
        return [
            read_dead_letter(m.task_id, m.headers, m.body)
            for m in self._queue(dlq_name(queue)).messages
        ]

    def outcomes(self, queue: str) -> dict[str, int]:
        """How the worker ended deliveries of handler queue ``queue`` since this broker
        opened, by outcome: ``{"retried": 2, "acked": 1}`` (``outcome_counts``)."""
        if queue not in self._handlers:
            raise ConfigurationError(f"no handler for {queue!r} in the apps of this test broker")
        before = self._counted_before.get(queue, {})
        now = outcome_counts(self._handlers[queue][1].app, queue)
        return {k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)}

    def depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (``Q``, ``Q.dlq``, ``weclaw_mq.delay.5s``, ...)."""
        return len(self._queue(queue).messages)

    def messages(self, queue: str) -> list[aio_pika.Message]:
        """Copies of the messages ready in ``queue`` (a results queue, say), oldest first."""
        return [
            aio_pika.Message(
                m.body,
                headers=dict(m.headers),
                message_id=m.properties.message_id,
                content_type=m.properties.content_type,
            )
            for m in self._queue(queue).messages
        ]

    def waits(self, queue: str) -> list[float]:
        """The delay-queue hops of ``queue``'s tasks so far, in seconds, in order: a task
        retried twice under the default policy shows ``[5.0, 10.0]``."""
        # The ladder is shared: a hop is ``queue``'s when it returns to Q or one of its lanes.
        return [
            ms / 1000
            for lane, ms in self.memory.parked
            if lane == queue or lane.startswith(f"{queue}.lane.")
        ]

    def _queue(self, name: str) -> MemoryQueue:
        queue = self.memory.queues.get(name)
        if queue is None:
            known = ", ".join(sorted(self.memory.queues)) or "none"
            raise ConfigurationError(f"the test broker has no queue {name!r} (it has: {known})")
        return queue


def outcome_counts(app: App, queue: str) -> dict[str, int]:
    """How ``app``'s worker ended deliveries of ``queue`` so far, by outcome
    (``weclaw_mq_messages_total``): ``{"acked": 1, "retried": 2, "dead_lettered": 1}``.
    Works the same for a test broker and a real worker of ``app``."""
    counts: dict[str, int] = {}
    for metric in app.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "weclaw_mq_messages_total" and sample.labels.get("queue") == queue:
                counts[sample.labels["outcome"]] = int(sample.value)
    return {k: v for k, v in counts.items() if v}

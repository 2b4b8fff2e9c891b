"""``App``: the handler registry and the facade users hold.

Its public methods are documented once, here and in the topics it inherits from ``facade``
(registration, reading, workflows and costs, the local outbox), and carried out by the
publishing engine (``publishing.engine``) and the results reader (``results.reader``) it
builds.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import aio_pika
from aio_pika.abc import HeadersType

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.facade.local_outbox import LocalOutbox
from weclaw_mq.facade.reading import Reading
from weclaw_mq.facade.registration import Registration
from weclaw_mq.facade.workflows_and_costs import WorkflowsAndCosts
from weclaw_mq.handlers.lifespan import Lifespan
from weclaw_mq.handlers.middleware import Chain
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.llm.resources import ModelResources
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.observability.otel import Spans, spans_for
from weclaw_mq.policy.costs import Price, check_prices
from weclaw_mq.policy.priority import Priority
from weclaw_mq.policy.schedules import Schedule
from weclaw_mq.publishing.engine import PublishingEngine
from weclaw_mq.publishing.sync_client import SyncClient
from weclaw_mq.results.reader import ResultsReader
from weclaw_mq.settings import Settings
from weclaw_mq.state import TaskStore, open_store
from weclaw_mq.streaming import StreamStore
from weclaw_mq.wire.connection import BrokerEndpoints
from weclaw_mq.wire.topology import DeclaredQueues, declare

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


class App(Registration, Reading, WorkflowsAndCosts, LocalOutbox):
    """The handler registry and the publishing entry point: one per service.

    Args:
        name: The application's name, in the names of its broker connections
            (``<name>-producer``, ``<name>-worker-<host>-<pid>``).
        settings: Its settings; default ``Settings()`` (read from the environment).
        registry: A Prometheus registry to export its metrics in; default a registry of
            its own, made when first read (``Metrics.registry``).
        store: Replaces the default Redis ``TaskStore`` (claims and records). The caller
            closes it.
        result_store: The former name of ``store`` (a ``DeprecationWarning``).
        streams: Replaces the default Redis ``StreamStore`` (task streams and session
            inboxes). The caller closes it.
        declare: Declare this App's queues before its first publish to one of them (once
            per event loop), for a producer that owns its queues; off by default, so a
            least-privilege producer never declares.
        prices: The price of each model, ``{"model": Price(input_per_1k=, output_per_1k=)}``:
            the tokens handlers report (``ctx.usage``) are then costed and recorded per task,
            tenant and model (``weclaw_mq.policy.costs``).

    Raises:
        ConfigurationError: Both ``store`` and ``result_store`` were given.
    """

    def __init__(
        self,
        name: str,
        *,
        settings: Settings | None = None,
        registry: CollectorRegistry | None = None,
        store: TaskStore | None = None,
        result_store: TaskStore | None = None,
        streams: StreamStore | None = None,
        declare: bool = False,
        prices: dict[str, Price] | None = None,
    ) -> None:
        if result_store is not None:
            if store is not None:
                raise ConfigurationError("pass the task store once, as store=")
            warnings.warn(
                "App(result_store=...) is now App(store=...)", DeprecationWarning, stacklevel=2
            )
            store = result_store
        self.name = name
        self.settings = settings if settings is not None else Settings()
        # Model prices (policy.costs): with them, workers record what each task cost.
        self.prices = check_prices(prices)
        self.metrics = Metrics(registry)
        self.broker = BrokerEndpoints(self.settings)
        self._handlers: dict[str, HandlerSpec] = {}
        # Startup and shutdown hooks and resources (``handlers.lifespan``): ``async with
        # app.lifespan`` opens them; a worker does once per process.
        self.lifespan = Lifespan()
        # Middleware around handler runs and publishes (``handlers.middleware``), in order.
        self.middleware = Chain()
        # Schedules by name (``policy.schedules``), fired by a scheduler (``scheduling``).
        self._schedules: dict[str, Schedule] = {}
        self._store = store
        self._owns_store = store is None  # ours to close, not the user's
        # OpenTelemetry spans (weclaw_mq.observability.otel): decided on first use, once; False
        # until then.
        self._spans: Spans | bool | None = False
        self._declares = declare
        self._streams_given = streams
        # The module that made this App, so an UnroutableError can name 'MODULE:APP'.
        self._made_in = sys._getframe(1).f_globals.get("__name__")
        self._sync: SyncClient | None = None
        # What a forked child dropped (``_after_fork``): kept, so no finaliser closes the
        # parent's sockets from the child.
        self._from_parent: list[object] = []
        # The LLM layer's state in Redis, opened with the lifespan as the handlers need it.
        self._models = ModelResources(
            lambda: self.name,
            self.settings,
            lambda: bool(self.prices),
            lambda: self._handlers.values(),
            lambda: self.store,
        )
        self.lifespan.resource(self._models.opened)
        self._open_parts()

    def _open_parts(self) -> None:
        """The publishing engine and the results reader; each opens its connections lazily."""
        self._engine = PublishingEngine(
            self.name,
            self.settings,
            self.metrics,
            self.broker,
            self._handlers,
            results=self._results,
            spans=self._current_spans,
            # Looked up when called: the declare of this App as it is then.
            declare=(lambda: self.declare()) if self._declares else None,
            chain=self.middleware,
            owner=self,
            made_in=self._made_in,
        )
        self._reader = ResultsReader(
            self.settings,
            results=self._results,
            store=lambda: self.store,
            streams=self._streams_given,
            local=lambda: self._engine.local,
        )

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's connections (they are the parent's
        sockets, served by the parent's loop) and open new ones at the next call. A store or
        streams passed in by the caller stay: the caller makes them per process."""
        self._from_parent.extend(
            (self._engine, self._reader, self._store if self._owns_store else None)
        )
        if self._owns_store:
            self._store = None
        self._open_parts()

    @property
    def sync(self) -> SyncClient:
        """This App's API as blocking calls, for code without an event loop.

        For a Django or Flask view or a script: ``app.sync.publish(queue, payload)``,
        ``publish_many``, ``status``, ``result``, ``cancel``, ``stream``. Safe from any
        thread; the calls run on one background event loop per process
        (``weclaw_mq.publishing.sync_client``) and raise what the async methods raise. Use
        an App either this way or with ``await``, not both.
        """
        if self._sync is None:
            self._sync = SyncClient(self)
        return self._sync

    # -- tracing ------------------------------------------------------------------------
    @property
    def spans(self) -> Spans | None:
        """The OpenTelemetry spans this App opens, None for none (``observability.otel``)."""
        return self._current_spans()

    def _current_spans(self) -> Spans | None:
        # A method, not only the property: the engine calls it per publish.
        if self._spans is False:
            self._spans = spans_for(self.settings)
        assert not isinstance(self._spans, bool)
        return self._spans

    def trace_with(self, tracer_provider: Any) -> None:
        """Open spans with this OpenTelemetry ``TracerProvider``, whatever ``settings.otel`` says.

        Call it before publishing or starting a worker.

        Args:
            tracer_provider: An OpenTelemetry ``TracerProvider``.
        """
        self._spans = Spans(tracer_provider)

    # -- publishing ---------------------------------------------------------------------
    def prepare(
        self,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
        ttl_s: float | None = None,
        session_id: str | None = None,
        priority: Priority | str | None = None,
        delay_s: float | None = None,
    ) -> aio_pika.Message:
        """Encode and check a task without sending it: size, and the handler's model if known.

        Args:
            queue: The handler queue the task is for.
            payload: The task, JSON-serialisable (or an instance of the handler's model).
            task_id: The task's id (an idempotency key); default a new one.
            trace_id: The trace id; default the trace of the task being handled, else a new
                one.
            headers: Extra AMQP headers.
            ttl_s: The task's lifetime, counted from now; default its handler's ``ttl_s`` (if
                registered in this App), else ``settings.task_ttl_s`` (see
                ``weclaw_mq.contract.lifetime``).
            session_id: The session (a user or a conversation) the task is for, written in
                the ``x-weclaw-session-id`` header.
            priority: The task's priority; default the handler's. Above NORMAL it is written
                in the ``x-weclaw-priority`` header, by which ``publish`` routes the message.
            delay_s: Written as the task's not-before time (``x-weclaw-not-before``), by which
                ``publish`` parks it in a delay queue (``weclaw_mq.policy.delays``).

        Returns:
            The message, ready for ``publish`` (its ``message_id`` is the task id).

        Raises:
            ConfigurationError: A ``ttl_s`` or ``delay_s`` that is not a valid number of
                seconds, a ``delay_s`` not shorter than the task's lifetime, or an invalid
                ``session_id``.
            PayloadError: The payload is not JSON-serialisable.
            PayloadTooLargeError: The body is over ``settings.max_message_bytes``.
            PayloadValidationError: The payload fails the model of the handler registered
                for ``queue`` in this App.
            MessageEncodingError: AMQP cannot carry the task id, the queue name or a header.
            InvalidPriorityError: An unknown ``priority``, or one above NORMAL for a handler
                registered without ``priorities=True``.
        """
        return self._engine.prepare(
            queue, payload, task_id, trace_id, headers, ttl_s, session_id, priority, delay_s
        )

    def queue_type_of(self, queue: str) -> str:
        """The type of ``queue`` as its handler here declares it.

        Args:
            queue: A handler queue.

        Returns:
            ``"quorum"`` or ``"classic"``; a queue without a handler in this App is taken to
            be a default (quorum) handler queue.
        """
        return self._engine.queue_type_of(queue)

    async def publish(
        self,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
        ttl_s: float | None = None,
        session_id: str | None = None,
        priority: Priority | str | None = None,
        delay_s: float | None = None,
        refuse_other_body: bool = False,
    ) -> str:
        """Publish one task and return its id once the broker confirmed it is stored.

        With a local outbox configured (``WECLAW_MQ_OUTBOX_PATH``), a task the broker did not
        confirm for want of a broker (unavailable, no confirm in time, connection lost) is
        stored in the outbox instead, and its id returned (``weclaw_mq.outbox``).

        Args:
            queue: The handler queue.
            payload: The task, JSON-serialisable (or an instance of the handler's model).
            task_id: An idempotency key of yours: published again, it is the same task (the
                guard runs it once, the first body wins). Default a new id.
            trace_id: The trace id; default the trace of the task being handled, else a new
                one.
            headers: Extra AMQP headers.
            ttl_s: The task's lifetime (see ``prepare``); past it the task ends in ``Q.dlq``
                with reason ``expired`` and ``status()`` answers ``expired``.
            session_id: A user or a conversation (letters, digits, ``_.:@-``): the task's
                streamed chunks and final reply also go to that session's inbox.
            priority: ``Priority.HIGH`` or ``"high"`` and so on; default the handler's, else
                NORMAL (see docs/how-to/priorities.md).
            delay_s: The task is delivered no earlier than that many seconds from now (at
                most ~1 s later; its status meanwhile is ``queued``; see
                docs/how-to/delays.md).
            refuse_other_body: With a ``task_id``, refuse another body than the first one
                published under it (``state.reuse``; needs results on). Off by default: the
                check is one Redis round trip before the publish.

        Returns:
            The task id.

        Raises:
            ConfigurationError: A ``ttl_s`` or ``delay_s`` that is not a valid number of
                seconds, a ``delay_s`` not shorter than the task's lifetime, or an invalid
                ``session_id``.
            PayloadError: The payload is not JSON-serialisable.
            PayloadTooLargeError: The body is over ``settings.max_message_bytes``.
            PayloadValidationError: The payload fails the model of the handler registered
                for ``queue`` in this App.
            MessageEncodingError: AMQP cannot carry the task id, the queue name or a header.
            InvalidPriorityError: An unknown ``priority``, or one above NORMAL for a handler
                registered without ``priorities=True``.
            IdempotencyConflictError: With ``refuse_other_body=True``: the task id was
                published to ``queue`` before with another body; nothing was sent.
            BrokerUnavailableError: No broker answered; nothing was sent.
            UnroutableError: No queue (or delay exchange) for the task: run
                ``weclaw-mq declare`` or start a worker first.
            PublishNackedError: The broker refused the message (a full queue); nothing was
                stored.
            ConfirmTimeoutError: No confirm within ``confirm_timeout_s``: the task may be
                stored; republish with the same ``task_id``.
            ConnectionLostError: The connection or channel died before the confirm: the task
                may be stored; republish with the same ``task_id``.
            OutboxFullError: With a local outbox, for a task it would take: the outbox is
                at its bound; nothing was stored.
            OutboxUnusableError: With a local outbox: its file cannot be opened or written.
        """
        message = self._engine.prepare(
            queue, payload, task_id, trace_id, headers, ttl_s, session_id, priority, delay_s
        )
        return await self._engine.publish(queue, message, task_id is not None and refuse_other_body)

    async def publish_many(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        task_ids: Sequence[str] | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
        ttl_s: float | None = None,
        session_id: str | None = None,
        priority: Priority | str | None = None,
        delay_s: float | None = None,
    ) -> list[str]:
        """Publish a batch over one channel with pipelined confirms.

        Every payload is checked before anything is sent. The options apply to every task of
        the batch, as in ``publish``.

        Args:
            queue: The handler queue.
            payloads: The tasks, each as ``publish`` takes one.
            task_ids: One id per payload, in order; default new ids.
            trace_id: The trace id of every task (see ``publish``).
            headers: Extra AMQP headers of every task.
            ttl_s: The lifetime of every task (see ``prepare``).
            session_id: The session of every task (see ``publish``).
            priority: The priority of every task (see ``publish``).
            delay_s: The delay of every task (see ``publish``).

        Returns:
            The task ids, in the order of ``payloads``.

        Raises:
            ConfigurationError: ``task_ids`` is not as long as ``payloads``; or as in
                ``prepare``.
            BatchPublishError: Some messages were not confirmed: ``.failed`` says which
                (index -> error), ``.confirmed`` which are stored. With a local outbox, only
                those the broker refused outright; the others are stored in it.
            PayloadError: As in ``prepare`` (and its subclasses), before anything is sent.
            InvalidPriorityError: As in ``prepare``, before anything is sent.
            BrokerUnavailableError: No broker answered before the batch; nothing was sent.
        """
        return await self._engine.publish_many(
            queue, payloads, task_ids, trace_id, headers, ttl_s, session_id, priority, delay_s
        )

    # -- results ------------------------------------------------------------------------
    @property
    def store(self) -> TaskStore | None:
        """The task store (claims and records), opened on first use.

        None when nothing needs one: results are off and no handler is guarded.
        """
        if self._store is None and self.needs_store:
            self._store = open_store(self.settings)
        return self._store

    @property
    def needs_store(self) -> bool:
        """Whether ``store`` opens one (nothing is opened to answer)."""
        return self.settings.results_enabled or any(s.idempotent for s in self._handlers.values())

    @property
    def results(self) -> TaskStore | None:
        """The task store when results are on (records are written and read), else None."""
        return self._results()

    def _results(self) -> TaskStore | None:
        # A method, not only the property: the engine calls it per publish.
        return self.store if self.settings.results_enabled else None

    # -- topology and lifecycle ---------------------------------------------------------
    async def declare(self) -> DeclaredQueues:
        """Declare every queue of every handler.

        Returns:
            The names of the app's own queues declared (a list), and in its ``shared`` the
            vhost's delay ladder and parking queue it declared too: those serve every app of
            the vhost, so a teardown deletes the list, never ``shared``.

        Raises:
            BrokerUnavailableError: No broker answered.
            TopologyConflictError: A queue exists with other arguments.
        """
        conn = await self.broker.connect(name=f"{self.name}-declare")
        try:
            channel = await conn.channel()
            return await declare(channel, [s.queue_spec() for s in self._handlers.values()])
        finally:
            await conn.close()

    async def close(self) -> None:
        """Close what this App opened: the outbox relay, the publisher, and the stores.

        Pending "queued" writes get up to ``QUEUED_RECORD_CLOSE_WAIT_S`` (1 s) first; what
        Redis did not answer by then is dropped (logged). Stores passed in by the caller
        are left open.
        """
        await self._engine.finish()  # the relay and pending "queued" writes use the store
        try:
            await self._engine.close()
        finally:
            try:
                await self._reader.close()
            finally:
                if self._store is not None and self._owns_store:
                    store, self._store = self._store, None
                    await store.close()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""``App``: the handler registry and the facade users hold.

Its public methods are documented here and carried out by the publishing engine
(``publishing.engine``) and the results reader (``results.reader``) it builds.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import aio_pika
from aio_pika.abc import HeadersType

from weclaw_mq.contract.message import encode_payload
from weclaw_mq.contract.task_ids import check_task_id
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.handlers.lifespan import HookT, Lifespan, Provider, ProviderT
from weclaw_mq.handlers.middleware import Chain, Middleware
from weclaw_mq.handlers.notifications import notify_target
from weclaw_mq.handlers.spec import HandlerFunc, HandlerSpec, build_spec
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.observability.otel import Spans, spans_for
from weclaw_mq.policy.breaker import Breaker
from weclaw_mq.policy.costs import Cap, Price, check_prices
from weclaw_mq.policy.fair_share import Fair
from weclaw_mq.policy.fallback import Fallback
from weclaw_mq.policy.limits import KeyFunc, Limit, as_limits
from weclaw_mq.policy.priority import QUORUM, Priority
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.policy.schedules import DEFAULT_GRACE_S, MissedPolicy, Payload, Schedule
from weclaw_mq.publishing.engine import PublishingEngine
from weclaw_mq.publishing.sync_client import SyncClient
from weclaw_mq.results.reader import ResultsReader
from weclaw_mq.settings import Settings
from weclaw_mq.state import Cancellation, TaskState, TaskStore, open_store
from weclaw_mq.state.cost_ledger import Call, CostLedger, Totals, ledger_of
from weclaw_mq.state.task_index import TaskPage, TaskQuery, TimelineEvent
from weclaw_mq.streaming import Inbox, StreamEvent, StreamStore
from weclaw_mq.wire.connection import BrokerEndpoints
from weclaw_mq.wire.topology import DeclaredQueues, declare
from weclaw_mq.workflows.plans import Stage
from weclaw_mq.workflows.starting import cancel_workflow, start_chain, start_group

_T = TypeVar("_T")

if TYPE_CHECKING:
    import sqlite3

    import psycopg
    from prometheus_client import CollectorRegistry
    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session

    from weclaw_mq.outbox import Outbox


class App:
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

    # -- registration -------------------------------------------------------------------
    def handler(
        self,
        queue: str,
        *,
        retry: RetryPolicy | None = None,
        timeout_s: float | None = None,
        delivery_limit: int | None = None,
        max_length: int | None = None,
        idempotent: bool = True,
        ttl_s: float | None = None,
        notify: bool | str = False,
        priority: Priority | str = Priority.NORMAL,
        priorities: bool = False,
        queue_type: str = QUORUM,
        limit: Limit | Sequence[Limit] | None = None,
        breaker: Breaker | None = None,
        tenant: KeyFunc | None = None,
        cap: Cap | None = None,
        fallback: Fallback | None = None,
        fair: Fair | bool | None = None,
    ) -> Callable[[HandlerFunc], HandlerFunc]:
        """Register a handler (async or plain def) for ``queue``; unset options come from settings.

        Args:
            queue: The handler queue; one handler per queue.
            retry: The retry policy; default ``settings.retry_policy()``.
            timeout_s: How long one attempt may run before it is cancelled; default
                ``settings.handler_timeout_s``.
            delivery_limit: The quorum queue's ``x-delivery-limit``: a task whose worker died
                on it this often is dead-lettered. Default ``settings.delivery_limit``.
            max_length: The queue's length bound (``x-max-length``), if any: past it,
                publishes are refused (``PublishNackedError``).
            idempotent: Guard the handler with the task store, so a redelivered task runs
                once.
            ttl_s: The lifetime of a task this App publishes to ``queue`` without its own
                ``ttl_s``; default ``settings.task_ttl_s`` (7 days).
            notify: ``True`` publishes each task's final state to ``<queue>.results``, a
                queue name to that queue, before the task is acked or dead-lettered (see
                ``notification``). Needs results on.
            priority: The default priority of tasks published to ``queue`` without one. A
                default above NORMAL implies ``priorities=True``.
            priorities: Let tasks of ``queue`` carry a priority above NORMAL. On a broker
                without usable priorities that costs two lane queues.
            queue_type: ``"quorum"``, or ``"classic"`` for a classic queue with native
                priorities (not replicated: see docs/how-to/priorities.md).
            limit: A ``Limit(key=..., concurrency=..., rate=..., per_s=...)`` or a list of
                them: tasks over a limit are deferred without spending an attempt (see
                ``limits``).
            breaker: A ``Breaker(...)`` pauses the queue in a worker after repeated failures
                (``UpstreamDown`` by default) and probes it after a cool-down (see
                ``breaker``).
            tenant: A function of the task naming whose bill it is on (a ``str`` or ``int``):
                its reported costs are summed per tenant (``weclaw-mq costs``).
            cap: A ``Cap(per_day=..., action=...)``: a tenant whose day's costs reached it
                gets its next tasks parked, shed or run on a cheaper model. Needs ``prices``.
            fallback: A ``Fallback([model, ...])``: each attempt gets ``ctx.model``, the first
                model that is up and that the task has not failed on (see
                ``weclaw_mq.policy.fallback``).
            fair: ``Fair(lanes=4)`` (or ``True``): a tenant's backlog does not hold up another
                tenant's task: each tenant's tasks go to a lane of its own, served in turn
                (``weclaw_mq.policy.fair_share``). The tenant is ``tenant=`` or ``Fair(key=)``.

        Returns:
            The decorator, which registers the function and returns it unchanged.

        Raises:
            ConfigurationError: ``limit`` holds something that is not a ``Limit``; when the
                decorator is applied, also a queue that already has a handler, or an option
                that cannot work (a bad ``notify``, a bad queue name).
            InvalidPriorityError: When the decorator is applied: an unknown ``priority`` or
                ``queue_type``.
        """
        limits = as_limits(limit)
        if cap is not None and not self.prices:
            raise ConfigurationError(
                f"cap for {queue!r} needs the models' prices: App(..., prices={{...}})"
            )

        def register(func: HandlerFunc) -> HandlerFunc:
            if queue in self._handlers:
                raise ConfigurationError(
                    f"queue {queue!r} already has a handler "
                    f"({self._handlers[queue].name}); one queue, one handler"
                )
            s = self.settings
            self._handlers[queue] = build_spec(
                func,
                queue=queue,
                retry=retry or s.retry_policy(),
                timeout_s=timeout_s if timeout_s is not None else s.handler_timeout_s,
                delivery_limit=delivery_limit if delivery_limit is not None else s.delivery_limit,
                max_length=max_length,
                idempotent=idempotent,
                ttl_s=ttl_s if ttl_s is not None else s.task_ttl_s,
                notify=notify_target(queue, notify, s),
                priority=priority,
                queue_type=queue_type,
                limits=limits,
                breaker=breaker,
                priorities=priorities,
                tenant=tenant,
                cap=cap,
                fallback=fallback,
                fair=fair,
            )
            return func

        return register

    # -- lifespan: startup and shutdown hooks, resources -----------------------------------
    def on_startup(self, hook: HookT) -> HookT:
        """Register a function to run once per worker process before its first task.

        An ``async def`` or a plain ``def`` with no parameters; it runs after the hooks and
        resources registered before it. A hook that raises stops the worker from starting
        (``StartupFailedError``: the CLI prints one line with your file and line, exit 3); what had
        started is closed again.

        Args:
            hook: The function.

        Returns:
            ``hook`` unchanged (a decorator).

        Raises:
            ConfigurationError: ``hook`` takes parameters, is a generator, or is registered
                twice.
        """
        return self.lifespan.on_startup(hook)

    def on_shutdown(self, hook: HookT) -> HookT:
        """Register a function to run once per worker process after its last task ended.

        An ``async def`` or a plain ``def`` with no parameters; it runs after the drain, before
        the hooks and resources registered before it. A hook that raises is logged; the others
        still run.

        Args:
            hook: The function.

        Returns:
            ``hook`` unchanged (a decorator).

        Raises:
            ConfigurationError: As ``on_startup``.
        """
        return self.lifespan.on_shutdown(hook)

    def resource(self, provider: ProviderT) -> ProviderT:
        """Register a resource that handlers reach with ``ctx.use(provider)``.

        The provider is a generator function (``async def`` or ``def``, no parameters) that opens
        something, yields it once, and closes it after the ``yield``. It is opened once per worker
        process in registration order, before the first task, and closed after the drain in reverse
        order; handlers reach it with ``ctx.use(provider)``, typed as the provider yields it.

        Args:
            provider: The generator function.

        Returns:
            ``provider`` unchanged (a decorator).

        Raises:
            ConfigurationError: ``provider`` is not a generator function, takes parameters,
                or is registered twice.
        """
        return self.lifespan.resource(provider)

    def use(self, provider: Provider[_T]) -> _T:
        """The open resource of ``provider`` (``ctx.use`` in a handler).

        Args:
            provider: A function registered with ``@app.resource``.

        Returns:
            What it yielded.

        Raises:
            ResourceUnavailableError: ``provider`` is not registered, or the lifespan is not
                open (no worker, ``TestBroker`` or ``async with app.lifespan`` runs it).
        """
        return self.lifespan.use(provider)

    def add_middleware(self, middleware: Middleware) -> None:
        """Run ``middleware``'s hooks around every handler run and every publish of this App.

        ``weclaw_mq.handlers.middleware`` says when each hook runs. Its ``before_*`` hooks run after
        those of middleware added before it, its ``after_*`` hooks before them. Add it at import,
        before a worker starts.

        Args:
            middleware: An instance of a ``Middleware`` subclass.

        Raises:
            ConfigurationError: Not a ``Middleware``, or added twice.
        """
        self.middleware.add(middleware)

    def schedule(
        self,
        name: str,
        *,
        queue: str,
        cron: str | None = None,
        every_s: float | None = None,
        tz: str = "UTC",
        missed: MissedPolicy = "skip",
        grace_s: float = DEFAULT_GRACE_S,
        payload: Payload = None,
    ) -> Schedule:
        """Publish a task to ``queue`` on every tick of a cron expression or an interval.

        A scheduler (``weclaw-mq scheduler MODULE:APP``, or workers run with ``--schedules``)
        fires the ticks; however many replicas run, one holds the lease and each tick is
        published once, under a task id made of the name and the tick, so the handler's guard
        runs it once even when a replica died between the publish and its record.

        Args:
            name: Unique in this App: letters, digits and ``_.:-``, at most 100.
            queue: The handler queue each tick's task goes to.
            cron: A five-field cron expression, evaluated in ``tz``.
            every_s: Or an interval in seconds (ticks at multiples of it since the epoch).
            tz: The IANA time zone of ``cron``.
            missed: What to do with ticks no scheduler fired on time: ``"skip"`` them, or
                ``"catch_up"``: run the latest of them once, late.
            grace_s: How late a tick may fire and still count as on time.
            payload: The task, or a function of the tick's time returning it; default
                ``{"schedule": name, "tick": "<ISO 8601>"}``.

        Returns:
            The schedule.

        Raises:
            ConfigurationError: A name used before or not allowed, neither or both of
                ``cron`` and ``every_s``, a cron expression or time zone that does not parse,
                an unknown ``missed``, or a fixed ``payload`` that the handler of ``queue``
                (registered before this call) refuses.
        """
        if name in self._schedules:
            raise ConfigurationError(f"schedule {name!r} is registered twice")
        planned = Schedule(
            name,
            queue,
            cron=cron,
            every_s=every_s,
            tz=tz,
            missed=missed,
            grace_s=grace_s,
            payload=payload,
        )
        spec = self._handlers.get(queue)
        if spec is not None and not callable(payload):
            try:
                spec.parse(
                    encode_payload(planned.task_for(planned.last_at_or_before(datetime.now(UTC))))
                )
            except Exception as e:
                raise ConfigurationError(
                    f"schedule {name!r}: the handler of {queue!r} refuses its payload: {e}"
                ) from e
        if spec is not None and not spec.idempotent:
            warnings.warn(
                f"schedule {name!r}: the handler of {queue!r} is not guarded (idempotent="
                "False): a tick published twice (a scheduler killed between its publish and its "
                "record) would run twice",
                stacklevel=2,
            )
        self._schedules[name] = planned
        return planned

    @property
    def schedules(self) -> Mapping[str, Schedule]:
        """The schedules registered with ``schedule``, by name (read-only)."""
        return MappingProxyType(self._schedules)

    @property
    def handlers(self) -> Mapping[str, HandlerSpec]:
        """The registered handlers by queue name (read-only)."""
        return MappingProxyType(self._handlers)

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

    async def status(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        """The task's recorded state in ``queue``.

        A task has one record per queue it went through (pipeline stages may share a task
        id).

        Args:
            task_id: The task's id.
            queue: The queue whose record answers; without it, the most recently written
                record of the task id.

        Returns:
            The record, or None if none is known. A stored_locally, queued or retrying record
            past the task's deadline answers ``expired``. With a local outbox, when the store has no
            record or does not answer, a task the outbox holds reads ``stored_locally``.

        Raises:
            ConfigurationError: Results are turned off (``WECLAW_MQ_RESULTS_ENABLED=false``).
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered the read with an error (not an outage).
        """
        return await self._reader.status(task_id, queue)

    async def result(
        self, task_id: str, *, queue: str | None = None, timeout_s: float = 60.0
    ) -> TaskState:
        """Wait until the task's record is final: succeeded, dead_lettered, expired or cancelled.

        It waits without polling in a loop: the store wakes it when the record is written.

        Args:
            task_id: The task's id.
            queue: The queue whose record answers; without it, the task's most recently
                written record. For a pipeline whose stages share a task id, pass the last
                stage's queue: without it, an earlier stage's final record may answer before
                the next stage wrote its own.
            timeout_s: How long to wait, in seconds.

        Returns:
            The final record.

        Raises:
            ResultTimeoutError: No final record within ``timeout_s`` (``.last`` holds the
                last record seen).
            ConfigurationError: Results are turned off (``WECLAW_MQ_RESULTS_ENABLED=false``).
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.result(task_id, queue, timeout_s)

    # -- streams and inboxes ------------------------------------------------------------
    @property
    def streams(self) -> StreamStore:
        """The stream store (task streams, session inboxes), opened on first use."""
        return self._reader.streams

    def stream(
        self, task_id: str, after: str | None = None, *, queue: str | None = None
    ) -> AsyncIterator[StreamEvent]:
        """The task's events, oldest first, then live, ending with its final event.

        Events are "attempt" (a run starts: drop the partial text so far), "chunk"
        (``data``) and "final" (``status``, ``result``, ``reason``). A task that is not known
        yet is waited for; bound it with ``asyncio.timeout``.

        Args:
            task_id: The task's id.
            after: The id of the last event already seen: resume with exactly the events
                after it.
            queue: Whose final state ends the stream, as ``result()`` answers it; without
                it, the task's latest record.

        Returns:
            An async iterator of the events. The final event comes for every terminal status,
            ``expired`` included.

        Raises:
            ConfigurationError: Results are turned off, or ``after`` is not a stream event
                id (raised here, not at the first event).
            StateUnavailableError: While iterating: Redis fails.
        """
        return self._reader.stream(task_id, after, queue)

    def inbox(self, session_id: str, *, after: str | None = None) -> Inbox:
        """The session's inbox.

        ``async for`` its pending events (oldest first, then live), and
        ``await inbox.confirm(event_id)`` to remove what the client received (up to and
        including that id).

        Args:
            session_id: The session (a user or a conversation).
            after: Start after this event id; default the oldest pending event.

        Returns:
            The inbox.

        Raises:
            ConfigurationError: An invalid ``session_id``, or an ``after`` that is not a
                stream event id.
        """
        return self._reader.inbox(session_id, after)

    async def cancel(
        self, task_id: str, *, queue: str | None = None, pending: bool = True
    ) -> Cancellation:
        """Cancel a task that has not finished.

        Queued or retrying, it is acked unrun when next delivered; running, its handler is
        cancelled within about a second on whichever worker runs it, and never retried. Its
        status becomes ``cancelled`` (final). A finished task is left alone. A task with no
        record in ``queue`` but one in another queue keeps that record and its status. See
        ``weclaw_mq.state.cancel_records``.

        Args:
            task_id: The task's id.
            queue: The queue to cancel it in. Without it, the task's latest record decides,
                and every queue of the task id is cancelled (all stages of a pipeline).
            pending: Cancel a task not known yet (in ``queue``, when given) when it
                arrives, for as long as a record is kept (``result_ttl_s``). With
                ``pending=False`` such a task is left alone.

        Returns:
            What happened: ``outcome`` is ``cancelled``; ``finished`` for a finished task
            (``changed`` False, with its record); ``pending`` for a task not known yet;
            ``unknown`` for one left alone with ``pending=False``. ``elsewhere`` is the
            task's record in another queue when ``queue`` holds none.

        Raises:
            ConfigurationError: A task id no task can have, an invalid queue name, or no
                task store (results off and no handler guarded).
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.cancel(task_id, queue, pending)

    # -- workflows: chains and groups (weclaw_mq.workflows) -------------------------------
    async def chain(
        self,
        stages: Sequence[str | Stage],
        payload: Any,
        *,
        chain_id: str | None = None,
        trace_id: str | None = None,
        session_id: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Start a chain: each stage's result becomes the next stage's payload.

        Each stage is a normal handler (its own queue, retries, limits, priority); stage ``i``
        runs as task ``<chain id>.<i>``, with the chain's trace id and session. The chain's
        record (``status``, ``result``, ``stream``: the chain id, no queue) ends with the last
        stage's result, or with the first stage that did not succeed (its status, and a reason
        naming it), or ``expired`` at its deadline.

        Args:
            stages: The stages in order: handler queue names, or
                ``weclaw_mq.workflows.Stage(queue, priority=...)``.
            payload: The first stage's payload.
            chain_id: The chain's id (an idempotency key: starting it again publishes
                nothing new); default a new one.
            trace_id: The trace id of every stage; default a new one.
            session_id: The session of every stage (their chunks and finals go to its inbox).
            deadline_s: How long the chain may take before it is ended ``expired``; default
                ``settings.workflow_deadline_s``.

        Returns:
            The chain id, once its first stage is confirmed.

        Raises:
            ConfigurationError: No stages, a bad queue name, id, session id or deadline, an
                id used before for another workflow, or results off.
            PayloadError: As ``publish`` raises it, for the first stage.
            PublishFailedError: As ``publish`` raises it (start it again with the same id).
        """
        return await start_chain(
            self,
            stages,
            payload,
            chain_id=chain_id,
            trace_id=trace_id,
            session_id=session_id,
            deadline_s=deadline_s,
        )

    async def group(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        then: str | Stage | None = None,
        on_failure: str = "fail",
        group_id: str | None = None,
        trace_id: str | None = None,
        session_id: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Start a group: one part per payload, then one callback with their results in order.

        Part ``i`` runs as task ``<group id>.<i>``; once every part has ended (succeeded,
        dead-lettered, expired or cancelled) the callback runs once, as task ``<group
        id>.then``. The group's record (``result(group id)``) ends with the callback's end
        (without a callback: the parts' results), with the first failed part under
        ``on_failure="fail"``, or ``expired`` at its deadline, naming the parts missing.

        Args:
            queue: The handler queue of the parts.
            payloads: One payload per part (published in batches of 1,000).
            then: The callback's handler queue (or a ``Stage``); None for no callback.
            on_failure: ``"fail"``: a part that does not succeed ends the group (the
                callback does not run) and the callback receives the parts' results;
                ``"pass"``: the callback receives every part's end as a
                ``weclaw_mq.workflows.PartResult``.
            group_id: The group's id (an idempotency key); default a new one.
            trace_id: The trace id of every part and the callback; default a new one.
            session_id: The session of every part and the callback.
            deadline_s: How long the group may take; default
                ``settings.workflow_deadline_s``.

        Returns:
            The group id, once every part is confirmed.

        Raises:
            ConfigurationError: No parts, an unknown policy, a bad name, id or deadline, an
                id used before for another workflow, or results off.
            PayloadError: As ``publish_many`` raises it, before anything is sent.
            BatchPublishError: Some parts were not confirmed (start it again with the same
                id).
        """
        return await start_group(
            self,
            queue,
            payloads,
            then=then,
            on_failure=on_failure,
            group_id=group_id,
            trace_id=trace_id,
            session_id=session_id,
            deadline_s=deadline_s,
        )

    async def cancel_workflow(self, workflow_id: str) -> Cancellation:
        """Cancel a chain or group and its tasks still to come.

        The workflow's record becomes ``cancelled``; a chain's current and later stages, and a
        group's parts that have not ended and its callback, are cancelled as ``cancel`` does
        (a running one within about a second; one not published yet when it comes).

        Args:
            workflow_id: The chain or group id.

        Returns:
            ``cancelled``; ``finished`` when it had ended (its record unchanged); ``unknown``.

        Raises:
            ConfigurationError: Results are off.
            StateUnavailableError: The store fails or does not answer.
        """
        return await cancel_workflow(self, workflow_id)

    # -- costs (weclaw_mq.policy.costs) ----------------------------------------------------
    def _ledger(self) -> CostLedger:
        return ledger_of(
            self.store,
            self.name,
            usage_ttl_s=self.settings.result_ttl_s,
            days_kept=self.settings.cost_days_kept,
        )

    async def costs(self, *, days: int = 1, by: str = "tenant") -> list[Totals]:
        """What the reported model usage cost over the last ``days`` UTC days.

        Args:
            days: How many days back, today included.
            by: ``"tenant"`` or ``"model"``.

        Returns:
            One ``Totals`` (cost, input and output tokens) per tenant or model, the most
            expensive first.

        Raises:
            ConfigurationError: ``by`` is neither, or the App keeps no Redis task store.
            StateUnavailableError: Redis does not answer.
        """
        return await self._ledger().totals(days, by=by)

    async def calls(self, task_id: str) -> list[Call]:
        """Every model call recorded on a task (each attempt's), with its tokens and cost.

        Args:
            task_id: The task's id.

        Returns:
            The calls, oldest first; none when it reported none (or its record expired).

        Raises:
            ConfigurationError: A task id no task can have, or the App keeps no Redis task
                store.
            StateUnavailableError: Redis does not answer.
        """
        check_task_id(task_id)  # as cancel and result: '' is a mistake, not a task of no calls
        return await self._ledger().calls_of(task_id)

    # -- the task index (weclaw_mq.state.task_index) --------------------------------------
    async def tasks(self, query: TaskQuery | None = None) -> TaskPage:
        """One page of the tasks the store knows, newest first (the task index).

        A task is listed from its first record in a queue (published, stored in the local
        outbox, or first run) until the index's bounds drop it (``task_index_max_age_s``,
        ``task_index_max_entries``). One call examines at most a bounded number of entries:
        a filter that matches few tasks may answer a short page with a ``next_cursor`` to
        go on from.

        Args:
            query: The filters, page size and cursor; None: the newest 50 tasks.

        Returns:
            The page: its tasks with their records now, and the cursor of the next page
            (None when nothing older matches).

        Raises:
            ConfigurationError: Results are off, the task index is off
                (``WECLAW_MQ_TASK_INDEX=false``), or the store keeps none.
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.tasks(query if query is not None else TaskQuery())

    async def timeline(self, task_id: str, *, queue: str | None = None) -> list[TimelineEvent]:
        """What happened to a task: one event per record write, oldest first.

        Queued, running, retrying (with its error), succeeded, dead_lettered or expired
        (with the reason), cancelled; a task requeued from the DLQ reads queued again. Kept
        as long as its records, the last 100 events.

        Args:
            task_id: The task's id.
            queue: Only the events of this queue; without it, those of every queue.

        Returns:
            The events ([] when none are kept).

        Raises:
            ConfigurationError: A task id no task can have, an invalid queue name, results
                off or the task index off.
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.timeline(task_id, queue)

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

    # -- the local outbox (weclaw_mq.outbox) ----------------------------------------------
    async def start_outbox(self) -> Outbox:
        """Open the outbox file and start its relay now (otherwise: at the first publish).

        Returns:
            The open outbox.

        Raises:
            OutboxUnusableError: The file is corrupt or cannot be written.
            ConfigurationError: No outbox is configured (``WECLAW_MQ_OUTBOX_PATH``).
        """
        return await self._engine.start_outbox()

    @overload
    def add_to_outbox(
        self,
        conn: psycopg.AsyncConnection[Any] | AsyncSession | AsyncConnection,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> Awaitable[str]: ...

    @overload
    def add_to_outbox(
        self,
        conn: sqlite3.Connection | psycopg.Connection[Any] | Session | Connection | Any,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> str: ...

    def add_to_outbox(
        self,
        conn: Any,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> str | Awaitable[str]:
        """Add a task inside the caller's own database transaction on ``conn``.

        The relay sends it once the caller commits, and never if the caller rolls back. On
        PostgreSQL the table comes from ``weclaw-mq outbox migrate --postgres URL`` and the
        relay is ``weclaw-mq outbox relay --postgres URL`` (docs/how-to/outbox.md).

        Args:
            conn: The caller's connection, inside its transaction: a ``sqlite3`` connection
                to the outbox file; a psycopg 3 ``Connection`` or ``AsyncConnection``; an
                SQLAlchemy ``Session`` or ``Connection`` (or their async forms) on
                PostgreSQL; or Django's ``connection`` inside ``transaction.atomic()``.
            queue: The handler queue.
            payload: The task, checked like ``publish`` checks it (``prepare``).
            task_id: The task's id; default a new one.
            trace_id: The trace id (see ``publish``).
            headers: Extra AMQP headers.

        Returns:
            The task id; for an async connection, an awaitable of it.

        Raises:
            PayloadError: As in ``prepare`` (and its subclasses).
            ConfigurationError: As in ``prepare``; or ``conn`` is none of the connections
                above (a Django one outside ``transaction.atomic()`` or not on PostgreSQL).
            OutboxUnusableError: The database holds no outbox table (or file).
        """
        return self._engine.add_to_outbox(conn, queue, payload, task_id, trace_id, headers)

    async def stored_locally(self, task_id: str) -> bool:
        """Whether the outbox holds the task now, i.e. it is not on the broker yet.

        Args:
            task_id: The task's id.

        Returns:
            True while the outbox holds it; False when no outbox is configured.
        """
        return await self._engine.stored_locally(task_id)

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

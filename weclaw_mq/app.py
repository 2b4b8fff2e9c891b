"""``App``: the handler registry and the publishing entry point users hold."""

from __future__ import annotations

import asyncio
import logging
import sys
import warnings
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import aio_pika
from aio_pika.abc import HeadersType

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.header_values import new_trace_id
from weclaw_mq.contract.lifetime import as_datetime, check_ttl, deadline_ms, now_ms, stamp
from weclaw_mq.contract.message import (
    build_message,
    check_encodable,
    encode_payload,
    new_task_id,
    publish_headers,
)
from weclaw_mq.contract.naming import ladder_queue_name, validate_queue_name, validate_session_id
from weclaw_mq.contract.task_ids import check_task_id
from weclaw_mq.errors import (
    STORED_NOTHING,
    BatchPublishError,
    BrokerUnavailableError,
    ConfigurationError,
    ConnectionLostError,
    IdempotencyConflictError,
    InvalidPayload,
    InvalidPriorityError,
    PayloadTooLargeError,
    PayloadValidationError,
    ResultTimeoutError,
    UndecodableBody,
    UnroutableError,
)
from weclaw_mq.handlers.notifications import notify_target
from weclaw_mq.handlers.spec import HandlerFunc, HandlerSpec, build_spec
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.observability.otel import Spans, spans_for
from weclaw_mq.observability.tracing import current
from weclaw_mq.policy.breaker import Breaker
from weclaw_mq.policy.delays import STEP_DELAYS_MS, check_delay, next_hop_ms, not_before_ms
from weclaw_mq.policy.limits import Limit, as_limits
from weclaw_mq.policy.priority import QUORUM, Priority, parse_priority, priority_from_header, route
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.settings import Settings
from weclaw_mq.state import (
    Cancellation,
    CancelOutcome,
    RecordsSoon,
    TaskState,
    TaskStatus,
    TaskStore,
    is_state_failure,
    open_store,
    state_unavailable,
)
from weclaw_mq.state.expiry import as_seen_at, record_ttl_s, until_deadline_s
from weclaw_mq.state.reuse import FingerprintStore, payload_fingerprint
from weclaw_mq.streaming import Inbox, StreamEvent, StreamStore
from weclaw_mq.streaming.events import check_event_id
from weclaw_mq.streaming.reading import task_events
from weclaw_mq.wire.connection import BrokerEndpoints
from weclaw_mq.wire.producer import Publisher
from weclaw_mq.wire.topology import declare

if TYPE_CHECKING:
    # Imported where used: only an app with an outbox loads sqlite3 (an idle worker's RSS).
    import sqlite3

    from prometheus_client import CollectorRegistry

    from weclaw_mq.outbox import Outbox
    from weclaw_mq.outbox.fallback import LocalFallback

log = logging.getLogger("weclaw_mq.producer")

# How long publish waits, after the broker's confirm, for the task's "queued" record. Redis
# usually answers in well under a millisecond, so status() right after publish sees the
# record; a Redis that hangs costs a publish at most this, never its socket timeout: the
# write goes on in the background (and only_if_new keeps it from hiding a later status).
QUEUED_RECORD_WAIT_S = 0.25
# On close, how long pending "queued" writes may still take before they are dropped.
QUEUED_RECORD_CLOSE_WAIT_S = 1.0
# result() re-reads a waiting task this long after its deadline, to answer "expired".
_DEADLINE_SLACK_S = 0.01


def _queued(message: aio_pika.Message, queue: str) -> TaskState:
    """The "queued" record of a task about to be published, with its deadline."""
    assert message.message_id is not None
    return TaskState(
        task_id=message.message_id,
        queue=queue,
        status=TaskStatus.QUEUED,
        expires_at=as_datetime(deadline_ms(message.headers)),
    )


def _state_of(last: object) -> TaskState | None:
    return last if isinstance(last, TaskState) else None


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
        self.metrics = Metrics(registry)
        self.broker = BrokerEndpoints(self.settings)
        self._handlers: dict[str, HandlerSpec] = {}
        self._publisher: Publisher | None = None
        self._declare_first = declare
        self._declaring: asyncio.Future[list[str]] | None = None
        # The module that made this App, so an UnroutableError can name 'MODULE:APP'.
        self._made_in: str | None = sys._getframe(1).f_globals.get("__name__")
        self._store = store
        self._owns_store = store is None  # ours to close, not the user's
        self._streams = streams
        self._owns_streams = streams is None
        # Queued-record writes that outlived their publish: held here so they are not
        # garbage-collected mid-write, and awaited (briefly) on close.
        self._record_writes: set[asyncio.Future[Any]] = set()
        # The store the queued records are written to, and whether it is RecordsSoon.
        self._soon: tuple[TaskStore, bool] | None = None
        # OpenTelemetry spans (weclaw_mq.observability.otel): decided on first use, once; False
        # until then.
        self._spans: Spans | bool | None = False
        # The local outbox and its relay, when WECLAW_MQ_OUTBOX_PATH names a file.
        self._local: LocalFallback | None = None
        if self.settings.outbox_path:
            from weclaw_mq.outbox.fallback import LocalFallback

            self._local = LocalFallback(
                self.settings,
                self.metrics,
                results=lambda: self.results,
                background=self._record_in_background,
                name=name,
                queue_type_of=self.queue_type_of,
                unavailable=lambda: self._get_publisher().unavailable(),
                # Only a publisher that exists can be backing off: none is made for it.
                reached=lambda: self._publisher.broker_reached() if self._publisher else None,
            )

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
            )
            return func

        return register

    @property
    def handlers(self) -> Mapping[str, HandlerSpec]:
        """The registered handlers by queue name (read-only)."""
        return MappingProxyType(self._handlers)

    # -- tracing ------------------------------------------------------------------------
    @property
    def spans(self) -> Spans | None:
        """The OpenTelemetry spans this App opens, None for none (``observability.otel``)."""
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
    def _get_publisher(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(self.broker, self.metrics, name=f"{self.name}-producer")
        return self._publisher

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
        ttl_ms = self._ttl_ms(queue, ttl_s)
        delay_ms = 0 if delay_s is None else check_delay(delay_s, "delay_s")
        if delay_ms >= ttl_ms:
            raise ConfigurationError(
                f"delay_s={delay_s!r} is not shorter than the task's lifetime of "
                f"{ttl_ms / 1000:.3g} s: it would expire before it could run"
            )
        if session_id is not None:
            headers = {**(headers or {}), h.SESSION_ID: validate_session_id(session_id)}
        body = encode_payload(payload)
        limit = self.settings.max_message_bytes
        if len(body) > limit:
            raise PayloadTooLargeError(queue, len(body), limit)
        spec = self._handlers.get(queue)
        # An instance of the handler's own model was validated when it was built.
        if spec is not None and not (spec.model is not None and type(payload) is spec.model):
            try:
                spec.parse(body)
            except (InvalidPayload, UndecodableBody) as e:
                raise PayloadValidationError(
                    f"payload for {queue!r} fails the handler's model: {e}"
                ) from e
        ctx = current()
        ours = publish_headers(
            trace_id=trace_id or (ctx.trace_id if ctx else None) or new_trace_id(),
            attempt=1,
            traceparent=ctx.traceparent if ctx else None,
            extra=headers,
        )
        at_ms = now_ms()
        stamp(ours, ttl_ms, at_ms)
        if delay_ms > 0:
            ours[h.NOT_BEFORE] = at_ms + delay_ms
        message = build_message(body, task_id=task_id or new_task_id(), headers=ours)
        # The broker's copy of the deadline: it dead-letters the task from Q past it.
        message.expiration = ttl_ms / 1000
        # Before anything is sent or recorded: aiormq would raise a bare TypeError/ValueError
        # mid-publish, or silently truncate a long header name.
        check_encodable(queue, message.message_id, headers)
        level = self._priority_of(queue, priority)
        if level is not Priority.NORMAL:  # no header is NORMAL: nothing to carry
            message.headers[h.PRIORITY] = level.value
        return message

    def _ttl_ms(self, queue: str, ttl_s: float | None) -> int:
        if ttl_s is not None:
            ttl = check_ttl(ttl_s, "ttl_s")
        else:
            spec = self._handlers.get(queue)
            ttl = spec.ttl_s if spec is not None else self.settings.task_ttl_s
        return max(1, round(ttl * 1000))

    def _priority_of(self, queue: str, priority: Priority | str | None) -> Priority:
        spec = self._handlers.get(queue)
        if priority is None:
            return spec.priority if spec is not None else Priority.NORMAL
        level = parse_priority(priority)
        if level is not Priority.NORMAL and spec is not None and not spec.priorities:
            # Its lanes do not exist: refused here, before anything is sent or recorded.
            raise InvalidPriorityError(
                f"handler {queue!r} takes no priorities: register it with priorities=True "
                f"to publish {level.value.upper()} tasks to it"
            )
        return level

    async def _route(self, queue: str, message: aio_pika.Message) -> tuple[str, str]:
        """Where ``message`` goes, as (exchange, routing key): its lane (``_lane``) through
        the default exchange, or, before its not-before time, one of the vhost's step delay
        queues through its exchange, with the lane as routing key: the delay queue dead-letters it
        back by that key (``delays``, ``topology``). They are declared with the handler's
        queues; where they are not (no worker of this version declared them yet), the
        publish is refused as unroutable and nothing is sent."""
        lane = await self._lane(queue, message)
        due = not_before_ms(message.headers)
        left = None if due is None else due - now_ms()
        if left is None or left <= 0:  # no delay, or a delay that passed in the outbox
            return "", lane
        return ladder_queue_name(next_hop_ms(left, STEP_DELAYS_MS)), lane

    async def _lane(self, queue: str, message: aio_pika.Message) -> str:
        """The lane of ``message`` (or Q with the AMQP priority property where the broker,
        or a classic queue, has native priorities); the version is asked only for a priority
        above NORMAL."""
        level = priority_from_header(message.headers.get(h.PRIORITY))
        if level is Priority.NORMAL:
            return queue
        try:
            version = await self._get_publisher().server_version()
        except BrokerUnavailableError as e:  # raised by the connect, which knows no task
            raise BrokerUnavailableError(str(e), queue=queue, task_id=message.message_id) from e
        target, amqp_priority = route(queue, level, version, self.queue_type_of(queue))
        if amqp_priority is not None:
            message.priority = amqp_priority
        return target

    def queue_type_of(self, queue: str) -> str:
        """The type of ``queue`` as its handler here declares it.

        Args:
            queue: A handler queue.

        Returns:
            ``"quorum"`` or ``"classic"``; a queue without a handler in this App is taken to
            be a default (quorum) handler queue.
        """
        spec = self._handlers.get(queue)
        return spec.queue_type if spec is not None else QUORUM

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
        message = self.prepare(
            queue,
            payload,
            task_id=task_id,
            trace_id=trace_id,
            headers=headers,
            ttl_s=ttl_s,
            session_id=session_id,
            priority=priority,
            delay_s=delay_s,
        )
        if task_id is not None and refuse_other_body:
            await self._check_key_reuse(queue, message)
        spans = self.spans
        if spans is not None:
            with spans.publishing(queue, [message]):
                return await self._send_or_store(queue, message)
        return await self._send_or_store(queue, message)

    async def _send_or_store(self, queue: str, message: aio_pika.Message) -> str:
        if self._declare_first and queue in self._handlers:
            await self._declared()
        try:
            if self._local is not None:
                return await self._local.publish(queue, message, self._send)
            return await self._send(queue, message)
        except UnroutableError as e:
            raise self._unroutable(e) from e

    async def _declared(self) -> None:
        """Declare this App's queues once per event loop (``App(declare=True)``); a declare
        that failed is tried again by the next publish. With an outbox, a broker that does
        not answer is no error here: the task goes to the outbox."""
        task = self._declaring
        loop = asyncio.get_running_loop()
        failed = task is not None and task.done() and (task.cancelled() or task.exception())
        if task is None or task.get_loop() is not loop or failed:
            task = self._declaring = loop.create_task(self.declare())
        elif task.done():
            return  # declared
        try:
            await asyncio.shield(task)
        except (BrokerUnavailableError, ConnectionLostError):
            if self._local is None:
                raise

    def _unroutable(self, error: UnroutableError) -> UnroutableError:
        """``error`` with its hint naming this App's ``MODULE:APP`` where it can be found."""
        where = self._module_path()
        text = str(error)
        if where is not None:
            text = text.replace("'weclaw-mq declare'", f"'weclaw-mq declare {where}'")
        text += "; or App(..., declare=True) to declare them at the first publish"
        return UnroutableError(text, queue=error.queue, task_id=error.task_id)

    def _module_path(self) -> str | None:
        """``MODULE:NAME`` of this App in the module that made it, if it is held there."""
        module = sys.modules.get(self._made_in or "")
        if module is None or self._made_in == "__main__":
            return None
        name = next((n for n, v in vars(module).items() if v is self), None)
        return None if name is None else f"{self._made_in}:{name}"

    async def _check_key_reuse(self, queue: str, message: aio_pika.Message) -> None:
        """``IdempotencyConflictError`` if the task id was published to ``queue`` with another
        body. Skipped (logged) when the store cannot tell within ``QUEUED_RECORD_WAIT_S``: the
        publish then goes on as it would without the check (``state.reuse``)."""
        store = self.results
        if not isinstance(store, FingerprintStore):
            return
        assert message.message_id is not None
        ours = payload_fingerprint(message.body)
        ttl_s = record_ttl_s(_queued(message, queue), self.settings.result_ttl_s, datetime.now(UTC))
        task_id = message.message_id

        async def kept() -> str | None:
            try:
                return await store.keep_fingerprint(queue, task_id, ours, ttl_s)
            except Exception as e:  # the store failing: publish as if there were no check
                log.warning("task %s: body not compared (%s: %s)", task_id, type(e).__name__, e)
                return None

        keeping = self._record_in_background(kept())
        done, _ = await asyncio.wait({keeping}, timeout=QUEUED_RECORD_WAIT_S)
        if not done:  # it goes on in the background; this publish does not wait for it
            log.warning("task %s: body not compared (the store did not answer in time)", task_id)
            return
        first = keeping.result()
        if first is not None and first != ours:
            raise IdempotencyConflictError(queue, task_id)

    async def _send(self, queue: str, message: aio_pika.Message) -> str:
        """Publish a prepared message, with its "queued" record; the broker's word or an error.

        ``queue`` is the handler queue; the message goes to its priority's lane (``_route``)."""
        assert message.message_id is not None
        exchange, target = await self._route(queue, message)
        store = self.results
        if store is None:
            await self._get_publisher().publish(target, message, exchange=exchange)
            return message.message_id
        # The "queued" record is written beside the confirm, not after it (no added latency),
        # and only if the task has no record yet, so it can never hide a later status.
        queued = self._write_queued(store, _queued(message, queue))
        refused: list[str] = []
        try:
            await self._get_publisher().publish(target, message, exchange=exchange)
        except STORED_NOTHING:
            refused.append(message.message_id)
            raise
        finally:
            await self._settle_queued(queued, queue, refused)
        return message.message_id

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
        items = list(payloads)
        if task_ids is not None and len(task_ids) != len(items):
            raise ConfigurationError(
                f"publish_many got {len(items)} payloads but {len(task_ids)} task ids"
            )
        messages = [
            self.prepare(
                queue,
                payload,
                task_id=task_ids[i] if task_ids is not None else None,
                trace_id=trace_id,
                headers=headers,
                ttl_s=ttl_s,
                session_id=session_id,
                priority=priority,
                delay_s=delay_s,
            )
            for i, payload in enumerate(items)
        ]
        spans = self.spans
        if spans is not None and messages:
            with spans.publishing(queue, messages):  # one span for the batch
                return await self._send_many_or_store(queue, messages)
        return await self._send_many_or_store(queue, messages)

    async def _send_many_or_store(self, queue: str, messages: list[aio_pika.Message]) -> list[str]:
        if self._declare_first and queue in self._handlers and messages:
            await self._declared()
        try:
            if self._local is not None and messages:
                return await self._local.publish_many(queue, messages, self._send_many)
            return await self._send_many(queue, messages)
        except UnroutableError as e:
            raise self._unroutable(e) from e
        except BatchPublishError as e:
            if not any(isinstance(f, UnroutableError) for f in e.failed.values()):
                raise
            failed: dict[int, Exception] = {
                i: self._unroutable(f) if isinstance(f, UnroutableError) else f
                for i, f in e.failed.items()
            }
            raise BatchPublishError(queue, e.task_ids, failed) from e

    async def _send_many(self, queue: str, messages: list[aio_pika.Message]) -> list[str]:
        ids = [m.message_id or "" for m in messages]
        if not messages:
            return ids
        publisher = self._get_publisher()
        await publisher.connect()
        targets = [await self._route(queue, m) for m in messages]
        store = self.results
        queued = (
            self._record_in_background(
                store.record_many(
                    [_queued(m, queue) for m in messages],
                    only_if_new=True,
                )
            )
            if store is not None
            else None
        )
        refused: list[str] = []
        try:
            outcomes = await asyncio.gather(
                *(
                    publisher.publish(t, m, exchange=x)
                    for (x, t), m in zip(targets, messages, strict=True)
                ),
                return_exceptions=True,
            )
            refused = [
                ids[i] for i, outcome in enumerate(outcomes) if isinstance(outcome, STORED_NOTHING)
            ]
        finally:
            if queued is not None:
                await self._settle_queued(queued, queue, refused)
        failed: dict[int, Exception] = {}
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                failed[i] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome  # cancellation: not a publish outcome
        if failed:
            raise BatchPublishError(queue, ids, failed)
        return ids

    def _write_queued(self, store: TaskStore, state: TaskState) -> asyncio.Future[Any]:
        """The "queued" record's write, started: at once where the store can (``RecordsSoon``:
        it leaves before the publish's frame, with no task to schedule), else as a task."""
        soon = self._soon
        if soon is None or soon[0] is not store:  # decided once per store
            soon = self._soon = (store, isinstance(store, RecordsSoon))
        if not soon[1]:
            return self._record_in_background(store.record(state, only_if_new=True))
        write = asyncio.ensure_future(cast(RecordsSoon, store).record_soon(state, only_if_new=True))
        self._record_writes.add(write)
        write.add_done_callback(self._record_write_ended)
        return write

    def _record_in_background(self, write: Coroutine[Any, Any, object]) -> asyncio.Task[Any]:
        """Run a best-effort state write as a task we hold until it ends (the loop itself
        keeps only a weak reference), and log its failure whoever waited for it."""
        task = asyncio.create_task(write)
        self._record_writes.add(task)
        task.add_done_callback(self._record_write_ended)
        return task

    def _record_write_ended(self, task: asyncio.Future[Any]) -> None:
        self._record_writes.discard(task)
        # The task is safe in the broker whatever happens here: a missing "queued" record only
        # means status() answers None until a worker picks the task up.
        if not task.cancelled() and (e := task.exception()) is not None:
            log.warning("could not record the queued status (%s: %s)", type(e).__name__, e)

    async def _settle_queued(
        self, queued: asyncio.Future[Any], queue: str, refused: list[str]
    ) -> None:
        """Wait for the "queued" write, then drop the records of ``refused`` tasks, both within
        ``QUEUED_RECORD_WAIT_S`` in all; what is left goes on in the background."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + QUEUED_RECORD_WAIT_S
        if not queued.done():
            # asyncio.wait never cancels what it waits for: a slow write goes on after we return.
            await asyncio.wait({queued}, timeout=QUEUED_RECORD_WAIT_S)
        if not refused:
            return
        forgetting = self._record_in_background(self._forget_after(queued, queue, refused))
        left = deadline - loop.time()
        if left > 0:
            await asyncio.wait({forgetting}, timeout=left)

    async def _forget_after(
        self, queued: asyncio.Future[Any], queue: str, refused: list[str]
    ) -> None:
        # Only once the write ended: a forget that overtook it would leave a "queued" record
        # for a task the broker does not hold.
        await asyncio.wait({queued})
        store = self.results
        if store is None:
            return
        for task_id in refused:
            try:
                await store.forget_queued(queue, task_id)
            except Exception as e:  # a stale "queued" record expires with its TTL
                log.warning("could not drop the queued status of %s (%s)", task_id, e)

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
        return self.store if self.settings.results_enabled else None

    def _require_results(self) -> TaskStore:
        store = self.results
        if store is None:
            raise ConfigurationError(
                "results are turned off (WECLAW_MQ_RESULTS_ENABLED=false): no status to read"
            )
        return store

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
        if self._local is not None:
            return await self._local.status(
                task_id, queue, lambda: self._stored_status(task_id, queue)
            )
        return await self._stored_status(task_id, queue)

    async def _stored_status(self, task_id: str, queue: str | None) -> TaskState | None:
        store = self._require_results()
        try:
            state = await store.get(task_id, queue=queue)
        except Exception as e:  # a custom store on redis-py, unwrapped
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise
        # Past its deadline, a task nobody ran reads as expired (see state.expiry).
        return as_seen_at(state, datetime.now(UTC))

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
        store = self._require_results()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s
        try:
            while True:
                state = await self.status(task_id, queue=queue)
                if state is not None and state.status.terminal:
                    return state
                # No worker may ever write again once the deadline passed (the broker
                # expired the task): wake up then too, to answer "expired".
                left = give_up - loop.time()
                until = until_deadline_s(state, datetime.now(UTC))
                if until is not None:
                    left = min(left, until + _DEADLINE_SLACK_S)
                try:
                    return await store.wait(task_id, max(left, 0.0), queue=queue)
                except ResultTimeoutError as e:
                    if loop.time() >= give_up:
                        final = as_seen_at(_state_of(e.last), datetime.now(UTC))
                        if final is not None and final.status.terminal:
                            return final
                        raise ResultTimeoutError(task_id, timeout_s, e.last) from None
        except Exception as e:
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise

    # -- streams and inboxes ------------------------------------------------------------
    @property
    def streams(self) -> StreamStore:
        """The stream store (task streams, session inboxes), opened on first use."""
        if self._streams is None:
            from weclaw_mq.streaming.redis import (
                open_redis_streams,  # loads redis-py: only when used
            )

            self._streams = open_redis_streams(self.settings)
        return self._streams

    def _read_block_s(self) -> float:
        # How long one read waits (woken by a write) before the reader's loop takes its turn.
        return self.settings.redis_timeout_s / 2

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
        self._require_results()
        if after is not None:
            check_event_id(after)  # here, not at the first event: the caller's mistake

        def final_state(timeout_s: float) -> Awaitable[TaskState]:
            # The final state exactly as result() answers it (expired included).
            return self.result(task_id, queue=queue, timeout_s=timeout_s)

        return task_events(
            self.streams,
            task_id,
            after,
            final_state=final_state,
            queue=queue,
            block_s=self._read_block_s(),
        )

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
        return Inbox(
            self.streams,
            validate_session_id(session_id),
            after=after,
            block_s=self._read_block_s(),
        )

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
        check_task_id(task_id)
        if queue is not None:
            validate_queue_name(queue)
        store = self.store
        if store is None:
            raise ConfigurationError(
                "cancelling needs the task store: turn results on (WECLAW_MQ_RESULTS_ENABLED) "
                "or guard a handler (idempotent=True)"
            )
        try:
            if not pending and await store.get(task_id, queue=queue) is None:
                latest = await store.get(task_id) if queue is not None else None
                return Cancellation(task_id, CancelOutcome.UNKNOWN, None, latest)
            return await store.cancel(task_id, queue=queue)
        except Exception as e:  # a custom store on redis-py, unwrapped
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise

    # -- topology and lifecycle ---------------------------------------------------------
    async def declare(self) -> list[str]:
        """Declare every queue of every handler.

        Returns:
            The names of the queues declared.

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
        return await self._require_outbox().open()

    def add_to_outbox(
        self,
        conn: sqlite3.Connection,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> str:
        """Add a task to the outbox inside the caller's own SQLite transaction on ``conn``.

        The relay sends it once the caller commits, and never if the caller rolls back.

        Args:
            conn: A connection to the outbox file, inside the caller's transaction.
            queue: The handler queue.
            payload: The task, checked like ``publish`` checks it (``prepare``).
            task_id: The task's id; default a new one.
            trace_id: The trace id (see ``publish``).
            headers: Extra AMQP headers.

        Returns:
            The task id.

        Raises:
            PayloadError: As in ``prepare`` (and its subclasses).
            ConfigurationError: As in ``prepare``.
        """
        from weclaw_mq.outbox import add_message

        message = self.prepare(queue, payload, task_id=task_id, trace_id=trace_id, headers=headers)
        add_message(conn, queue, message)
        return message.message_id or ""

    async def stored_locally(self, task_id: str) -> bool:
        """Whether the outbox holds the task now, i.e. it is not on the broker yet.

        Args:
            task_id: The task's id.

        Returns:
            True while the outbox holds it; False when no outbox is configured.
        """
        return self._local is not None and await self._local.holds(task_id)

    def _require_outbox(self) -> LocalFallback:
        if self._local is None:
            raise ConfigurationError("no outbox configured: set WECLAW_MQ_OUTBOX_PATH")
        return self._local

    async def close(self) -> None:
        """Close what this App opened: the outbox relay, the publisher, and the stores.

        Pending "queued" writes get up to ``QUEUED_RECORD_CLOSE_WAIT_S`` (1 s) first; what
        Redis did not answer by then is dropped (logged). Stores passed in by the caller
        are left open.
        """
        if self._local is not None:
            await self._local.close()  # the relay first: its status writes use the store
        if self._record_writes:
            # Before the store closes: a healthy Redis finishes them in milliseconds.
            _, late = await asyncio.wait(self._record_writes, timeout=QUEUED_RECORD_CLOSE_WAIT_S)
            for write in late:
                write.cancel()
            if late:
                log.warning("dropped %d queued-status write(s) Redis did not answer", len(late))
                await asyncio.wait(late)
        try:
            if self._publisher is not None:
                publisher, self._publisher = self._publisher, None
                await publisher.close()  # bounded, never raises
        finally:
            try:
                if self._streams is not None and self._owns_streams:
                    streams, self._streams = self._streams, None
                    await streams.close()
            finally:
                if self._store is not None and self._owns_store:
                    store, self._store = self._store, None
                    await store.close()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

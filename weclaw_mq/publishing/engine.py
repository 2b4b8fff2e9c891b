"""``PublishingEngine``: everything about getting an App's task onto the broker.

Encoding and checking a task (``prepare``, from ``publishing.preparing``), routing it to its
lane or a delay queue, the App(declare=True) declare, confirmed publishing with its "queued"
record (``publishing.queued_records``), batches, and the local outbox a publish falls back to.
``App`` holds one and documents its public methods; this class knows the App only through what
its constructor is given.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import aio_pika
from aio_pika.abc import HeadersType

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.contract.naming import ladder_queue_name
from weclaw_mq.errors import (
    STORED_NOTHING,
    BatchPublishError,
    BrokerUnavailableError,
    ConfigurationError,
    ConnectionLostError,
    IdempotencyConflictError,
    UnroutableError,
)
from weclaw_mq.handlers.middleware import Chain, Publish
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.observability.otel import Spans
from weclaw_mq.policy.delays import STEP_DELAYS_MS, next_hop_ms, not_before_ms
from weclaw_mq.policy.priority import QUORUM, Priority, priority_from_header, route
from weclaw_mq.publishing.fair_lanes import FairLanes, lane_name
from weclaw_mq.publishing.preparing import Preparer
from weclaw_mq.publishing.queued_records import QUEUED_RECORD_WAIT_S, QueuedRecords, queued_state
from weclaw_mq.settings import Settings
from weclaw_mq.state import TaskStore
from weclaw_mq.state.expiry import record_ttl_s
from weclaw_mq.state.reuse import FingerprintStore, payload_fingerprint
from weclaw_mq.wire.connection import BrokerEndpoints
from weclaw_mq.wire.producer import Publisher

if TYPE_CHECKING:
    from weclaw_mq.outbox import Outbox
    from weclaw_mq.outbox.fallback import LocalFallback

log = logging.getLogger("weclaw_mq.producer")


class PublishingEngine:
    """The publishing side of one App.

    Args:
        name: The App's name (its publisher's connection is ``<name>-producer``).
        settings: The App's settings.
        metrics: The App's metrics.
        broker: The App's broker endpoints.
        handlers: The App's handlers by queue, read as they are registered.
        results: The task store when results are on, else None (called per publish).
        spans: The App's OpenTelemetry spans, None for none (called per publish).
        declare: Declares the App's queues (``App(declare=True)``); None not to.
        chain: The App's middleware (``handlers.middleware``), read per publish.
        owner: The App, looked up by identity in the module that made it.
        made_in: The name of that module.
    """

    def __init__(
        self,
        name: str,
        settings: Settings,
        metrics: Metrics,
        broker: BrokerEndpoints,
        handlers: Mapping[str, HandlerSpec],
        *,
        results: Callable[[], TaskStore | None],
        spans: Callable[[], Spans | None],
        declare: Callable[[], Coroutine[Any, Any, list[str]]] | None,
        chain: Chain,
        owner: object,
        made_in: str | None,
    ) -> None:
        self.settings = settings
        self._handlers = handlers
        # The preparer's own bound method: no frame of the engine's per message.
        self.prepare = Preparer(settings, handlers).prepare
        self._results = results
        self._spans = spans
        self._records = QueuedRecords()
        self._fair = FairLanes(results, self._records.in_background)
        self._declare = declare
        self._chain = chain
        self._declaring: asyncio.Future[list[str]] | None = None
        # So an UnroutableError can name 'MODULE:APP'.
        self._owner = owner
        self._made_in = made_in
        # What the publisher is made of, on first use.
        self._broker, self._metrics, self._name = broker, metrics, name
        self.publisher: Publisher | None = None
        # The local outbox and its relay, when WECLAW_MQ_OUTBOX_PATH names a file.
        self.local: LocalFallback | None = None
        if settings.outbox_path:
            from weclaw_mq.outbox.fallback import LocalFallback

            self.local = LocalFallback(
                settings,
                metrics,
                results=results,
                background=self._records.in_background,
                name=name,
                queue_type_of=self.queue_type_of,
                fair_of=self.fair_of,
                unavailable=lambda: self.get_publisher().unavailable(),
                # Only a publisher that exists can be backing off: none is made for it.
                reached=lambda: self.publisher.broker_reached() if self.publisher else None,
            )

    def get_publisher(self) -> Publisher:
        """The App's publisher, made on first use."""
        if self.publisher is None:
            self.publisher = Publisher(self._broker, self._metrics, name=f"{self._name}-producer")
        return self.publisher

    # -- where a task goes ----------------------------------------------------------------
    async def _route(
        self, queue: str, message: aio_pika.Message, fair_lane: str | None = None
    ) -> tuple[str, str]:
        """Where ``message`` goes, as (exchange, routing key): its lane (``_lane``) through
        the default exchange, or, before its not-before time, one of the vhost's step delay
        queues through its exchange, with the lane as routing key: the delay queue dead-letters it
        back by that key (``delays``, ``topology``). They are declared with the handler's
        queues; where they are not (no worker of this version declared them yet), the
        publish is refused as unroutable and nothing is sent. ``fair_lane``: the tenant's
        lane a fair handler's NORMAL task was placed in (``publishing.fair_lanes``)."""
        lane = fair_lane or await self._lane(queue, message)
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
            version = await self.get_publisher().server_version()
        except BrokerUnavailableError as e:  # raised by the connect, which knows no task
            raise BrokerUnavailableError(str(e), queue=queue, task_id=message.message_id) from e
        target, amqp_priority = route(
            queue, level, version, self.queue_type_of(queue), fair=self.fair_of(queue)
        )
        if amqp_priority is not None:
            message.priority = amqp_priority
        return target

    def fair_of(self, queue: str) -> bool:
        """Whether the App's handler of ``queue`` shares it fairly between tenants (``fair=``):
        its priorities then take lanes on every broker (``plan_priorities``)."""
        spec = self._handlers.get(queue)
        return spec is not None and spec.fair is not None

    def queue_type_of(self, queue: str) -> str:
        """``"quorum"`` or ``"classic"``, as the App's handler declares ``queue``; quorum for a
        queue without one (``App.queue_type_of``)."""
        spec = self._handlers.get(queue)
        return spec.queue_type if spec is not None else QUORUM

    # -- one task, sent -------------------------------------------------------------------
    def publish(
        self, queue: str, message: aio_pika.Message, check_reuse: bool
    ) -> Coroutine[Any, Any, str]:
        """The publish of a prepared message, to await (``App.publish``).

        Without a body check or spans it is ``_send_or_store`` itself: no coroutine of its own
        per message between App.publish's await and the send.
        """
        if check_reuse or self._chain.publishes or self._spans() is not None:
            return self._publish_around(queue, message, check_reuse)
        return self._send_or_store(queue, message)

    async def _publish_around(
        self, queue: str, message: aio_pika.Message, check_reuse: bool
    ) -> str:
        if not self._chain.publishes:
            return await self._checked_send(queue, message, check_reuse)
        publishes = [Publish(queue, message.message_id or "", message)]
        await self._chain.before_publish(publishes)
        try:
            task_id = await self._checked_send(queue, message, check_reuse)
        except BaseException as e:
            await self._chain.after_publish(publishes, {0: e})
            raise
        await self._chain.after_publish(publishes, {})
        return task_id

    async def _checked_send(self, queue: str, message: aio_pika.Message, check_reuse: bool) -> str:
        if check_reuse:
            await self._check_key_reuse(queue, message)
        spans = self._spans()
        if spans is not None:
            with spans.publishing(queue, [message]):
                return await self._send_or_store(queue, message)
        return await self._send_or_store(queue, message)

    async def _send_or_store(self, queue: str, message: aio_pika.Message) -> str:
        if self._declare is not None and queue in self._handlers:
            await self._declared()
        try:
            if self.local is not None:
                return await self.local.publish(queue, message, self._send)
            return await self._send(queue, message)
        except UnroutableError as e:
            raise self._unroutable(e) from e

    async def _declared(self) -> None:
        """Declare this App's queues once per event loop (``App(declare=True)``); a declare
        that failed is tried again by the next publish. With an outbox, a broker that does
        not answer is no error here: the task goes to the outbox."""
        assert self._declare is not None
        task = self._declaring
        loop = asyncio.get_running_loop()
        failed = task is not None and task.done() and (task.cancelled() or task.exception())
        if task is None or task.get_loop() is not loop or failed:
            task = self._declaring = loop.create_task(self._declare())
        elif task.done():
            return  # declared
        try:
            await asyncio.shield(task)
        except (BrokerUnavailableError, ConnectionLostError):
            if self.local is None:
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
        name = next((n for n, v in vars(module).items() if v is self._owner), None)
        return None if name is None else f"{self._made_in}:{name}"

    async def _check_key_reuse(self, queue: str, message: aio_pika.Message) -> None:
        """``IdempotencyConflictError`` if the task id was published to ``queue`` with another
        body. Skipped (logged) when the store cannot tell within ``QUEUED_RECORD_WAIT_S``: the
        publish then goes on as it would without the check (``state.reuse``)."""
        store = self._results()
        if not isinstance(store, FingerprintStore):
            return
        assert message.message_id is not None
        ours = payload_fingerprint(message.body)
        ttl_s = record_ttl_s(
            queued_state(message, queue), self.settings.result_ttl_s, datetime.now(UTC)
        )
        task_id = message.message_id

        async def kept() -> str | None:
            try:
                return await store.keep_fingerprint(queue, task_id, ours, ttl_s)
            except Exception as e:  # the store failing: publish as if there were no check
                log.warning("task %s: body not compared (%s: %s)", task_id, type(e).__name__, e)
                return None

        keeping = self._records.in_background(kept())
        done, _ = await asyncio.wait({keeping}, timeout=QUEUED_RECORD_WAIT_S)
        if not done:  # it goes on in the background; this publish does not wait for it
            log.warning("task %s: body not compared (the store did not answer in time)", task_id)
            return
        first = keeping.result()
        if first is not None and first != ours:
            raise IdempotencyConflictError(queue, task_id)

    async def _send(self, queue: str, message: aio_pika.Message) -> str:
        """Publish a prepared message, with its "queued" record; the broker's word or an error.

        ``queue`` is the handler queue; the message goes to its priority's lane (``_route``).
        One coroutine, inline: a helper's frame would be paid by every publish, fair or not."""
        assert message.message_id is not None
        spec = self._handlers.get(queue)
        fair = spec if spec is not None and spec.fair is not None else None
        placed = fair_lane = None
        if fair is not None:  # to its tenant's lane (fair_lanes)
            (placed,) = await self._fair.place(fair, [message])
            fair_lane = lane_name(queue, placed)
        exchange, target = await self._route(queue, message, fair_lane)
        try:
            store = self._results()
            if store is None:
                await self.get_publisher().publish(target, message, exchange=exchange)
            else:
                # The "queued" record is written beside the confirm, not after it (no added
                # latency), and only if the task has no record yet, so it can never hide a
                # later status.
                queued = self._records.write(store, queued_state(message, queue))
                refused: list[str] = []
                try:
                    await self.get_publisher().publish(target, message, exchange=exchange)
                except STORED_NOTHING:
                    refused.append(message.message_id)
                    raise
                finally:
                    await self._records.settle(queued, store, queue, refused)
        except Exception:
            if fair is not None:  # the book's count of the lane, after the broker's answer
                self._fair.settled(fair, [placed], [False])
            raise
        if fair is not None:
            self._fair.settled(fair, [placed], [True])
        return message.message_id

    # -- a batch --------------------------------------------------------------------------
    async def publish_many(
        self,
        queue: str,
        payloads: Iterable[Any],
        task_ids: Sequence[str] | None,
        trace_id: str | None,
        headers: HeadersType | None,
        ttl_s: float | None,
        session_id: str | None,
        priority: Priority | str | None,
        delay_s: float | None,
    ) -> list[str]:
        """Every payload prepared, then the batch sent over one channel (``App.publish_many``)."""
        items = list(payloads)
        if task_ids is not None and len(task_ids) != len(items):
            raise ConfigurationError(
                f"publish_many got {len(items)} payloads but {len(task_ids)} task ids"
            )
        messages = [
            self.prepare(
                queue,
                payload,
                task_ids[i] if task_ids is not None else None,
                trace_id,
                headers,
                ttl_s,
                session_id,
                priority,
                delay_s,
            )
            for i, payload in enumerate(items)
        ]
        if not self._chain.publishes or not messages:
            return await self._traced_send_many(queue, messages)
        publishes = [Publish(queue, m.message_id or "", m) for m in messages]
        await self._chain.before_publish(publishes)
        try:
            task_ids = await self._traced_send_many(queue, messages)
        except BatchPublishError as e:
            await self._chain.after_publish(publishes, dict(e.failed))
            raise
        except BaseException as e:
            await self._chain.after_publish(publishes, dict.fromkeys(range(len(publishes)), e))
            raise
        await self._chain.after_publish(publishes, {})
        return task_ids

    async def _traced_send_many(self, queue: str, messages: list[aio_pika.Message]) -> list[str]:
        spans = self._spans()
        if spans is not None and messages:
            with spans.publishing(queue, messages):  # one span for the batch
                return await self._send_many_or_store(queue, messages)
        return await self._send_many_or_store(queue, messages)

    async def _send_many_or_store(self, queue: str, messages: list[aio_pika.Message]) -> list[str]:
        if self._declare is not None and queue in self._handlers and messages:
            await self._declared()
        try:
            if self.local is not None and messages:
                return await self.local.publish_many(queue, messages, self._send_many)
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
        publisher = self.get_publisher()
        await publisher.connect()
        spec = self._handlers.get(queue)
        fair = spec if spec is not None and spec.fair is not None else None
        placed = await self._fair.place(fair, messages) if fair else [None] * len(messages)
        targets = [
            await self._route(queue, m, lane_name(queue, p))
            for m, p in zip(messages, placed, strict=True)
        ]
        store = self._results()
        queued = (
            self._records.in_background(
                store.record_many(
                    [queued_state(m, queue) for m in messages],
                    only_if_new=True,
                )
            )
            if store is not None
            else None
        )
        refused: list[str] = []
        outcomes: Sequence[object] = ()
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
                assert store is not None
                await self._records.settle(queued, store, queue, refused)
            if fair is not None and outcomes:  # the book's counts, after the broker's answers
                landed = [not isinstance(o, BaseException) for o in outcomes]
                self._fair.settled(fair, placed, landed)
        failed: dict[int, Exception] = {}
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                failed[i] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome  # cancellation: not a publish outcome
        if failed:
            raise BatchPublishError(queue, ids, failed)
        return ids

    # -- the local outbox (weclaw_mq.outbox) ----------------------------------------------
    async def start_outbox(self) -> Outbox:
        """The outbox, opened and its relay started (``App.start_outbox``)."""
        return await self._require_outbox().open()

    def add_to_outbox(
        self,
        conn: Any,
        queue: str,
        payload: Any,
        task_id: str | None,
        trace_id: str | None,
        headers: HeadersType | None,
    ) -> str | Awaitable[str]:
        """The task prepared and added in the caller's transaction on ``conn``
        (``App.add_to_outbox``); an awaitable for an async connection."""
        from weclaw_mq.outbox.in_transaction import add_in_transaction

        message = self.prepare(
            queue,
            payload,
            task_id,
            trace_id,
            headers,
            ttl_s=None,
            session_id=None,
            priority=None,
            delay_s=None,
        )
        added = message.message_id or ""
        pending = add_in_transaction(conn, queue, message)
        if pending is None:
            return added

        async def inserted() -> str:
            await pending
            return added

        return inserted()

    async def stored_locally(self, task_id: str) -> bool:
        """Whether the outbox holds the task now (``App.stored_locally``)."""
        return self.local is not None and await self.local.holds(task_id)

    def _require_outbox(self) -> LocalFallback:
        if self.local is None:
            raise ConfigurationError("no outbox configured: set WECLAW_MQ_OUTBOX_PATH")
        return self.local

    # -- closing --------------------------------------------------------------------------
    async def finish(self) -> None:
        """Stop the outbox relay, then end the pending "queued" writes: both write to the
        store, so this comes before it closes."""
        if self.local is not None:
            await self.local.close()
        await self._records.close()

    async def close(self) -> None:
        """Close the publisher, if one was made (bounded, never raises)."""
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            await publisher.close()

"""``App``: the handler registry and the publishing entry point users hold."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import aio_pika
import redis.asyncio as aioredis
from aio_pika.abc import HeadersType
from prometheus_client import CollectorRegistry

from .connection import BrokerEndpoints
from .errors import (
    BatchPublishError,
    BrokerUnavailableError,
    ConfigurationError,
    PayloadTooLargeError,
    PayloadValidationError,
    PublishNackedError,
    UnroutableError,
)
from .guard import IdempotencyGuard
from .handler import HandlerFunc, HandlerSpec, InvalidPayload, UndecodableBody, build_spec
from .message import build_message, encode_payload, new_task_id, publish_headers
from .metrics import Metrics
from .producer import Publisher
from .results import RedisResultStore, ResultStore, TaskState, TaskStatus
from .retry import RetryPolicy
from .settings import Settings
from .topology import declare
from .tracing import current, new_trace_id

log = logging.getLogger("weclaw_mq.producer")

# Publish failures that certainly stored nothing (refused, or no broker to send to); a
# ConfirmTimeoutError or ConnectionLostError may have stored the task.
NOT_STORED = (PublishNackedError, UnroutableError, BrokerUnavailableError)


class App:
    def __init__(
        self,
        name: str,
        *,
        settings: Settings | None = None,
        registry: CollectorRegistry | None = None,
        result_store: ResultStore | None = None,
    ) -> None:
        """``result_store`` replaces the default Redis store (``results_enabled`` turns it off)."""
        self.name = name
        self.settings = settings if settings is not None else Settings()
        self.metrics = Metrics(registry)
        self.broker = BrokerEndpoints(self.settings)
        self._handlers: dict[str, HandlerSpec] = {}
        self._publisher: Publisher | None = None
        self._redis: aioredis.Redis | None = None
        self._results = result_store
        self._owns_results = result_store is None  # ours to drop on close, not the user's
        self._guard: IdempotencyGuard | None = None

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
    ) -> Callable[[HandlerFunc], HandlerFunc]:
        """Register an async handler for ``queue``; options left out come from settings."""

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
                retry=retry
                or RetryPolicy(
                    max_retries=s.max_retries,
                    delay_s=s.retry_delay_s,
                    multiplier=s.retry_multiplier,
                    max_delay_s=s.retry_max_delay_s,
                ),
                timeout_s=timeout_s if timeout_s is not None else s.handler_timeout_s,
                delivery_limit=delivery_limit if delivery_limit is not None else s.delivery_limit,
                max_length=max_length,
                idempotent=idempotent,
            )
            return func

        return register

    @property
    def handlers(self) -> Mapping[str, HandlerSpec]:
        return MappingProxyType(self._handlers)

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
    ) -> aio_pika.Message:
        """Encode and check a task without sending it: size, and the handler's model if known."""
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
        return build_message(
            body,
            task_id=task_id or new_task_id(),
            headers=publish_headers(
                trace_id=trace_id or (ctx.trace_id if ctx else None) or new_trace_id(),
                attempt=1,
                traceparent=ctx.traceparent if ctx else None,
                extra=headers,
            ),
        )

    async def publish(
        self,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> str:
        """Publish one task and return its id once the broker confirmed it is stored.

        The trace id is, in order: ``trace_id``, the trace of the task being handled (or of
        ``tracing.bind``), a new one.
        """
        message = self.prepare(queue, payload, task_id=task_id, trace_id=trace_id, headers=headers)
        assert message.message_id is not None
        store = self.results
        if store is None:
            await self._get_publisher().publish(queue, message)
            return message.message_id
        # The "queued" record is written beside the confirm, not after it (no added latency),
        # and only if the task has no record yet, so it can never hide a later status.
        queued = asyncio.create_task(
            store.put(
                TaskState(task_id=message.message_id, queue=queue, status=TaskStatus.QUEUED),
                only_if_new=True,
            )
        )
        refused = False
        try:
            await self._get_publisher().publish(queue, message)
        except NOT_STORED:
            refused = True
            raise
        finally:
            await self._settle_queued(queued)
            if refused:
                await self._forget([message.message_id])
        return message.message_id

    async def publish_many(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        task_ids: Sequence[str] | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> list[str]:
        """Publish a batch over one channel with pipelined confirms; the task ids, in order.

        Every payload is checked before anything is sent. If some messages are not confirmed,
        ``BatchPublishError`` says which (``.failed``) and which are stored (``.confirmed``).
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
            )
            for i, payload in enumerate(items)
        ]
        ids = [m.message_id or "" for m in messages]
        if not messages:
            return ids
        publisher = self._get_publisher()
        await publisher.connect()
        store = self.results
        queued = (
            asyncio.create_task(
                store.put_many(
                    [TaskState(task_id=t, queue=queue, status=TaskStatus.QUEUED) for t in ids],
                    only_if_new=True,
                )
            )
            if store is not None
            else None
        )
        try:
            outcomes = await asyncio.gather(
                *(publisher.publish(queue, m) for m in messages), return_exceptions=True
            )
        finally:
            if queued is not None:
                await self._settle_queued(queued)
        failed: dict[int, Exception] = {}
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                failed[i] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome  # cancellation: not a publish outcome
        if failed:
            await self._forget([ids[i] for i, e in failed.items() if isinstance(e, NOT_STORED)])
            raise BatchPublishError(queue, ids, failed)
        return ids

    async def _forget(self, task_ids: list[str]) -> None:
        """Drop the queued records of tasks that were certainly not stored (refused, or no
        broker answered): a status must never claim a task the broker does not hold."""
        store = self.results
        if store is None:
            return
        for task_id in task_ids:
            try:
                await store.forget_queued(task_id)
            except Exception as e:  # a stale "queued" record expires with its TTL
                log.warning("could not drop the queued status of %s (%s)", task_id, e)

    @staticmethod
    async def _settle_queued(queued: asyncio.Task[Any]) -> None:
        # The task is safe in the broker whatever happens here: a missing "queued" record only
        # means status() answers None until a worker picks the task up.
        try:
            await queued
        except Exception as e:
            log.warning("could not record the queued status (%s: %s)", type(e).__name__, e)

    # -- results ------------------------------------------------------------------------
    def _redis_client(self) -> aioredis.Redis:
        if self._redis is None:
            s = self.settings
            # Not redis-py's BlockingConnectionPool: its condition and timeout cost 12-25 us
            # per command (measured). The worker sizes its concurrency to fit this pool.
            pool = aioredis.ConnectionPool.from_url(
                s.redis_url_plain(),
                max_connections=s.redis_max_connections,
                socket_connect_timeout=s.redis_timeout_s,
                socket_timeout=s.redis_timeout_s,
                health_check_interval=30,
            )
            self._redis = aioredis.Redis(connection_pool=pool)
        return self._redis

    @property
    def results(self) -> ResultStore | None:
        """The result store, or None when results are turned off."""
        if self._results is None and self.settings.results_enabled:
            self._results = RedisResultStore(self._redis_client(), ttl_s=self.settings.result_ttl_s)
        return self._results

    @property
    def guard(self) -> IdempotencyGuard | None:
        """The idempotency guard, or None when no handler asks for it."""
        if self._guard is None and any(s.idempotent for s in self._handlers.values()):
            self._guard = IdempotencyGuard(
                self._redis_client(),
                lease_s=self.settings.guard_lease_s,
                done_ttl_s=self.settings.done_ttl_s,
            )
        return self._guard

    def _require_results(self) -> ResultStore:
        store = self.results
        if store is None:
            raise ConfigurationError(
                "results are turned off (WECLAW_MQ_RESULTS_ENABLED=false): no status to read"
            )
        return store

    async def status(self, task_id: str) -> TaskState | None:
        """The task's latest recorded state, or None if none is known."""
        return await self._require_results().get(task_id)

    async def result(self, task_id: str, *, timeout_s: float = 60.0) -> TaskState:
        """Wait (without polling in a loop) until the task succeeded or was dead-lettered."""
        return await self._require_results().wait(task_id, timeout_s)

    # -- topology and lifecycle ---------------------------------------------------------
    async def declare(self) -> list[str]:
        """Declare every queue of every handler; returns their names."""
        conn = await self.broker.connect(name=f"{self.name}-declare")
        try:
            channel = await conn.channel()
            return await declare(channel, [s.queue_spec() for s in self._handlers.values()])
        finally:
            await conn.close()

    async def close(self) -> None:
        if self._publisher is not None:
            publisher, self._publisher = self._publisher, None
            await publisher.close()
        if self._guard is not None:
            guard, self._guard = self._guard, None
            await guard.close()
        if self._redis is not None:
            client, self._redis = self._redis, None
            if self._owns_results:
                self._results = None
            await client.aclose()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

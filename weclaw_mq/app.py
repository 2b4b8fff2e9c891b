"""``App``: the handler registry and the publishing entry point users hold."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import aio_pika
from aio_pika.abc import HeadersType
from prometheus_client import CollectorRegistry

from .connection import connect
from .errors import ConfigurationError, PayloadTooLargeError, PayloadValidationError
from .handler import HandlerFunc, HandlerSpec, InvalidPayload, UndecodableBody, build_spec
from .message import build_message, encode_payload, new_task_id, publish_headers
from .metrics import Metrics
from .producer import Publisher
from .retry import RetryPolicy
from .settings import Settings
from .topology import declare
from .tracing import current, new_trace_id


class App:
    def __init__(
        self,
        name: str,
        *,
        settings: Settings | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.settings = settings if settings is not None else Settings()
        self.metrics = Metrics(registry)
        self._handlers: dict[str, HandlerSpec] = {}
        self._publisher: Publisher | None = None

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
            self._publisher = Publisher(self.settings, self.metrics, name=f"{self.name}-producer")
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
        if spec is not None:
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
        await self._get_publisher().publish(queue, message)
        assert message.message_id is not None
        return message.message_id

    # -- topology and lifecycle ---------------------------------------------------------
    async def declare(self) -> list[str]:
        """Declare every queue of every handler; returns their names."""
        conn = await connect(self.settings, name=f"{self.name}-declare")
        try:
            channel = await conn.channel()
            return await declare(channel, [s.queue_spec() for s in self._handlers.values()])
        finally:
            await conn.close()

    async def close(self) -> None:
        if self._publisher is not None:
            publisher, self._publisher = self._publisher, None
            await publisher.close()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""``Preparer``: a task encoded and checked into the message a publish sends.

The checks that refuse a task before anything is sent or recorded: its lifetime and delay,
its session id, its size, the model of the handler registered for its queue, what AMQP can
carry, and its priority; then the headers of a first attempt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aio_pika
from aio_pika.abc import HeadersType

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.header_values import new_trace_id
from weclaw_mq.contract.lifetime import check_ttl, now_ms, stamp
from weclaw_mq.contract.message import (
    build_message,
    check_encodable,
    encode_payload,
    new_task_id,
    publish_headers,
)
from weclaw_mq.contract.naming import validate_session_id
from weclaw_mq.errors import (
    ConfigurationError,
    InvalidPayload,
    InvalidPriorityError,
    PayloadTooLargeError,
    PayloadValidationError,
    UndecodableBody,
)
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.tracing import current
from weclaw_mq.policy.delays import check_delay
from weclaw_mq.policy.priority import Priority, parse_priority
from weclaw_mq.settings import Settings


class Preparer:
    """One App's tasks prepared by its settings and its handlers.

    Args:
        settings: The App's settings.
        handlers: The App's handlers by queue, read as they are registered.
    """

    def __init__(self, settings: Settings, handlers: Mapping[str, HandlerSpec]) -> None:
        self.settings = settings
        self._handlers = handlers

    def prepare(
        self,
        queue: str,
        payload: Any,
        task_id: str | None,
        trace_id: str | None,
        headers: HeadersType | None,
        ttl_s: float | None,
        session_id: str | None,
        priority: Priority | str | None,
        delay_s: float | None,
    ) -> aio_pika.Message:
        """The task encoded and checked, ready to send (``App.prepare``)."""
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
        task = payload
        # An instance of the handler's own model was validated when it was built.
        if spec is not None and not (spec.model is not None and type(payload) is spec.model):
            try:
                task = spec.parse(body)
            except (InvalidPayload, UndecodableBody) as e:
                raise PayloadValidationError(
                    f"payload for {queue!r} fails the handler's model: {e}"
                ) from e
        if spec is not None and spec.fair_key is not None:
            # Computed here, where the task is validated: the producer picks its lane by it.
            headers = {**(headers or {}), h.TENANT: spec.tenant_of(task)}
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

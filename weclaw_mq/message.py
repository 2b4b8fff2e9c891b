"""The message contract: how a task becomes an AMQP message and how a delivery is read back.

body: UTF-8 JSON; ``message_id`` = task id; persistent; ``content_type=application/json``;
headers from ``weclaw_mq.headers``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pydantic_core
from aio_pika.abc import AbstractIncomingMessage, HeadersType
from pydantic import BaseModel

from . import headers as h
from .errors import PayloadError
from .tracing import trace_from_headers

CONTENT_TYPE = "application/json"


def new_task_id() -> str:
    return str(uuid.uuid4())


def encode_payload(payload: Any) -> bytes:
    if isinstance(payload, BaseModel):
        return payload.model_dump_json().encode()
    try:
        return pydantic_core.to_json(payload)
    except pydantic_core.PydanticSerializationError as e:
        raise PayloadError(f"payload is not JSON-serialisable: {e}") from e


def build_message(
    body: bytes,
    *,
    task_id: str,
    headers: HeadersType,
    timestamp: datetime | None = None,
) -> aio_pika.Message:
    return aio_pika.Message(
        body,
        message_id=task_id,
        content_type=CONTENT_TYPE,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=timestamp or datetime.now(UTC),
        headers=headers,
    )


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the worker knows about one incoming message before running its handler."""

    task_id: str
    trace_id: str
    traceparent: str | None
    attempt: int
    returns: int  # unsettled returns so far, across hops (see headers.RETURNS)
    headers: dict[str, Any]
    body: bytes
    redelivered: bool
    timestamp: datetime | None


def read_delivery(message: AbstractIncomingMessage) -> Delivery:
    headers: dict[str, Any] = dict(message.headers or {})
    trace_id, traceparent = trace_from_headers(headers)
    attempt = headers.get(h.ATTEMPT)
    return Delivery(
        # A message from a foreign publisher may lack an id; it still gets processed.
        task_id=message.message_id or new_task_id(),
        trace_id=trace_id,
        traceparent=traceparent,
        attempt=attempt if isinstance(attempt, int) and attempt >= 1 else 1,
        returns=_count(headers.get(h.RETURNS)) + _count(headers.get(h.X_DELIVERY_COUNT)),
        headers=headers,
        body=message.body,
        redelivered=bool(message.redelivered),
        timestamp=message.timestamp,
    )


def _count(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 0


def publish_headers(
    *, trace_id: str, attempt: int, traceparent: str | None, extra: HeadersType | None = None
) -> HeadersType:
    out: HeadersType = dict(extra or {})
    out[h.TRACE_ID] = trace_id
    out[h.ATTEMPT] = attempt
    if traceparent:
        out[h.TRACEPARENT] = traceparent
    return out

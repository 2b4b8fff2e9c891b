"""The message contract: how a task becomes an AMQP message and how a delivery is read back.

body: UTF-8 JSON; ``message_id`` = task id; persistent; ``content_type=application/json``;
headers from ``weclaw_mq.contract.headers``.
"""

from __future__ import annotations

import math
import struct
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pamqp.encode
import pydantic_core
from aio_pika.abc import AbstractIncomingMessage, HeadersType
from pydantic import BaseModel

from weclaw_mq.contract import header_values
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.header_values import new_trace_id
from weclaw_mq.errors import MessageEncodingError, PayloadError

CONTENT_TYPE = "application/json"


def new_task_id() -> str:
    return str(uuid.uuid4())


def strict_json(value: Any) -> bytes:
    """``value`` as JSON, the one rule for task bodies and streamed chunks: ``ValueError``
    for what JSON cannot hold (NaN or an infinity, a lone surrogate, an unknown type)."""
    try:
        data = pydantic_core.to_json(value)
    except (pydantic_core.PydanticSerializationError, UnicodeError) as e:
        raise ValueError(str(e)) from e
    # pydantic_core writes NaN/Infinity as bare words (invalid JSON); a string holding such a
    # word encodes the same in "null" mode, a real NaN does not. A str (most chunks) is
    # never a number: no scan at all.
    if (
        type(value) is not str
        and (b"NaN" in data or b"Infinity" in data)
        and data != pydantic_core.to_json(value, inf_nan_mode="null")
    ):
        raise ValueError("NaN and infinities have no JSON form; send null or a string")
    return data


def encode_payload(payload: Any) -> bytes:
    try:
        if isinstance(payload, BaseModel):
            return payload.model_dump_json().encode()
        return strict_json(payload)
    except (pydantic_core.PydanticSerializationError, UnicodeError, ValueError) as e:
        raise PayloadError(f"payload is not JSON-serialisable: {e}") from e


# AMQP 0-9-1 short strings (message_id, the routing key, table field names) hold at most 255
# bytes, and RabbitMQ's field names at most 128. Past these, aiormq/pamqp raise a bare
# TypeError or ValueError from inside publish, or (a long header name) truncate it with only
# a log warning: we refuse such a message before anything is sent or recorded.
SHORTSTR_MAX_BYTES = 255
HEADER_NAME_MAX_BYTES = 128
# pamqp's own message names the value with its repr, which can be as long as the value.
_MAX_DETAIL = 200


def check_encodable(queue: str, task_id: object, extra: HeadersType | None) -> None:
    """``MessageEncodingError`` unless AMQP can carry a message with this task id and the
    caller's ``extra`` headers to ``queue`` unchanged.

    Only the caller's headers are encoded as a trial: ours (trace id, attempt, traceparent)
    always encode, and encoding every header table twice per publish would be paid on the
    hot path for nothing.
    """
    _check_short_string("queue name", queue)
    check_task_id_encodable(task_id)
    if not extra:
        return
    _check_field_names(extra, "headers")
    try:
        pamqp.encode.field_table(extra)
    except (TypeError, ValueError, OverflowError, struct.error) as e:
        detail = str(e)
        if len(detail) > _MAX_DETAIL:
            detail = detail[:_MAX_DETAIL] + "..."
        raise MessageEncodingError(
            f"a header cannot be encoded in AMQP ({detail}); header values may be str, int, "
            "float, bool, None, Decimal, datetime, bytearray, and lists or dicts of those"
        ) from e


def check_task_id_encodable(task_id: object) -> None:
    """``MessageEncodingError`` unless ``task_id`` can be a message id: what ``publish`` takes."""
    _check_short_string("task id", task_id)
    if isinstance(task_id, str) and not task_id.isprintable():
        # It goes into log lines and Redis keys: a newline there forges the next log line.
        raise MessageEncodingError(
            f"the task id {task_id[:40]!r} holds control or line characters; use printable text"
        )


def _check_short_string(what: str, value: object) -> None:
    if not isinstance(value, str):
        raise MessageEncodingError(f"the {what} must be a str, not {type(value).__name__}")
    _check_utf8_size(f"the {what}", value, SHORTSTR_MAX_BYTES)


def _check_utf8_size(what: str, value: str, limit: int) -> None:
    """``value`` encodes as UTF-8 in at most ``limit`` bytes (AMQP counts bytes, not chars)."""
    try:
        size = len(value.encode())
    except UnicodeError as e:
        raise MessageEncodingError(f"{what} {value[:40]!r} is not valid UTF-8 ({e})") from e
    if size > limit:
        raise MessageEncodingError(
            f"{what} is {size} bytes long; AMQP carries at most {limit} (starts {value[:40]!r})"
        )


def _check_field_names(value: object, path: str) -> None:
    """Every table field name, at any depth, is a str of at most 128 UTF-8 bytes, and no
    float is NaN or infinite (pamqp encodes those; RabbitMQ's parser then closes the whole
    connection)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise MessageEncodingError(
            f"{path}: {value!r} is not a value RabbitMQ accepts in a header; send a string"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise MessageEncodingError(
                    f"{path}: field name {key!r} must be a str, not {type(key).__name__}"
                )
            _check_utf8_size(f"{path}: field name", key, HEADER_NAME_MAX_BYTES)
            _check_field_names(item, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_field_names(item, f"{path}[{i}]")


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


@dataclass(slots=True)
class Delivery:
    """What the worker knows about one incoming message before running its handler; also the
    delivery's trace context (``tracing.Traced``: trace id, task id, queue, attempt,
    traceparent), so its log lines need no second object.

    Not frozen: a frozen dataclass sets each field through ``object.__setattr__``, which
    tripled the cost of making one, for every delivery. Nothing changes it once read but
    ``model``, set once the attempt's model is chosen (a fallback chain, a tenant's cap)."""

    task_id: str
    trace_id: str
    traceparent: str | None
    attempt: int
    returns: int  # unsettled returns so far, across hops (see headers.RETURNS)
    headers: dict[str, Any]
    body: bytes
    redelivered: bool
    timestamp: datetime | None
    queue: str  # the handler queue it was delivered from
    # The model this attempt calls (``ctx.model``), written on its records; None: not chosen.
    model: str | None = None

    @property
    def deferrals(self) -> int:
        """How often the task was parked without an attempt before this delivery (its
        header)."""
        value = self.headers.get(h.DEFERRALS)
        return value if type(value) is int and value > 0 else 0


def read_delivery(message: AbstractIncomingMessage, queue: str) -> Delivery:
    raw = message.headers
    # Checked (header_values), so what is left of ours is valid: a trace id or traceparent is
    # a non-empty str, the counts ints in range; a missing value takes its default here.
    headers = header_values.checked(dict(raw)) if raw else {}
    message_id = message.message_id
    if not message_id:
        task_id = new_task_id()  # a message from a foreign publisher may lack an id
    elif message_id.isprintable():
        task_id = message_id
    else:
        task_id = header_values.task_id(message_id)
    # Positional: keywords cost a dataclass's __init__ about twice as much, per delivery.
    return Delivery(
        task_id,
        headers.get(h.TRACE_ID) or new_trace_id(),  # trace_id
        headers.get(h.TRACEPARENT),  # traceparent
        headers.get(h.ATTEMPT, 1),  # attempt
        headers.get(h.RETURNS, 0) + headers.get(h.X_DELIVERY_COUNT, 0),  # returns
        headers,
        message.body,
        bool(message.redelivered),
        message.timestamp,
        queue,
    )


def publish_headers(
    *, trace_id: str, attempt: int, traceparent: str | None, extra: HeadersType | None = None
) -> HeadersType:
    out: HeadersType = dict(extra or {})
    out[h.TRACE_ID] = trace_id
    out[h.ATTEMPT] = attempt
    if traceparent:
        out[h.TRACEPARENT] = traceparent
    return out

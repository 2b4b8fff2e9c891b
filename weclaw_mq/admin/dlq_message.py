"""A message in ``Q.dlq``: what it says, and the copies made of it. Pure: no broker I/O.

``weclaw_mq.dlq`` is the broker side (look, export, requeue, purge); this is what it reads
and writes.

For a handler queue ``Q`` the dead letters sit in ``Q.dlq``. Two kinds arrive there:

- moved by our worker (``Settler.dead_letter``): our headers say why (reason, error type and
  message, traceback, attempt, first and last failure times);
- dead-lettered by RabbitMQ itself: the delivery limit was reached (a worker died on the
  message again and again: reason ``delivery_limit``) or it expired (``expired``). Only the
  broker's ``x-death`` headers say why; the error headers, if any, are from an earlier retry.

``DeadLetter`` reads both into one shape.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from pamqp import encode
from pamqp.commands import Basic

from weclaw_mq.admin.dlq_properties import check_properties
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import renewed
from weclaw_mq.contract.message import CONTENT_TYPE
from weclaw_mq.contract.undecodable import raw_properties, undecodable
from weclaw_mq.policy.failures import stable_error_type
from weclaw_mq.policy.retry import DeadLetterReason

# Our record of a failure: dropped from a requeued copy, so its next failure is told afresh.
# The carried return count goes too: an operator requeues a crash-looping task after fixing
# the crash, and a copy that still carried it would be dead-lettered again without running.
_FAILURE_HEADERS = frozenset(
    {
        h.RETURNS,
        h.DEAD_LETTER_REASON,
        h.ERROR_TYPE,
        h.ERROR_CLASS,
        h.ERROR_MESSAGE,
        h.ERROR_TRACEBACK,
        h.ORIGINAL_QUEUE,
        h.FIRST_FAILURE_AT,
        h.LAST_FAILURE_AT,
        h.X_DEATH,
        h.X_DELIVERY_COUNT,
    }
)

UNKNOWN_REASON = "unknown"
# A message whose properties the client cannot decode (see weclaw_mq.contract.undecodable).
UNDECODABLE_PROPERTIES_REASON = "undecodable_properties"
# Every reason the DLQ tools show: the worker's (DeadLetterReason; for what RabbitMQ itself
# dead-letters here, delivery_limit and expired, its x-death uses the same words) and the tools'
# own two, for a message whose reason or properties they cannot read.
DEAD_LETTER_REASONS = frozenset(
    {*(reason.value for reason in DeadLetterReason), UNKNOWN_REASON, UNDECODABLE_PROPERTIES_REASON}
)


@dataclass(frozen=True)
class DeadLetter:
    """One message in ``Q.dlq``, whoever put it there."""

    task_id: str  # "" for a foreign message without a message_id
    reason: str
    error_type: str | None
    error_message: str | None
    attempts: int | None
    original_queue: str | None
    first_failure_at: datetime | None
    last_failure_at: datetime | None
    trace_id: str | None
    body: bytes
    headers: dict[str, Any]
    # The body's whole size when ``body`` holds only its first bytes (a look's preview);
    # None when ``body`` is whole.
    body_size: int | None = None

    @property
    def traceback(self) -> str | None:
        return _text(self.headers.get(h.ERROR_TRACEBACK))

    @property
    def requeued(self) -> int:
        """How often ops re-drove this task from its DLQ before (0: never)."""
        return _requeued(self.headers)

    @property
    def last_requeued_at(self) -> datetime | None:
        """When the last re-drive was (None: never, or before weclaw_mq recorded it)."""
        return _time(self.headers.get(h.REQUEUED_AT))

    @property
    def by_broker(self) -> bool:
        """Dead-lettered by RabbitMQ (delivery limit, expiry), not by our worker."""
        return h.DEAD_LETTER_REASON not in self.headers


def read_dead_letter(task_id: object, headers: object, body: bytes) -> DeadLetter:
    """Our headers when the worker dead-lettered it, else the broker's most recent death.

    Never raises for what another producer may have written: a header of an unexpected type
    reads as absent (and is still shown among the headers), so one odd message never stops a
    look at the whole DLQ.
    """
    hdrs = dict(headers) if isinstance(headers, Mapping) else {}
    if undecodable(hdrs) is not None:
        return DeadLetter(
            task_id="",
            reason=UNDECODABLE_PROPERTIES_REASON,
            error_type=None,
            error_message=_text(hdrs.get(h.UNDECODABLE_ERROR)),
            attempts=None,
            original_queue=None,
            first_failure_at=None,
            last_failure_at=None,
            trace_id=None,
            body=body,
            headers=hdrs,
        )
    died = hdrs.get(h.X_DEATH)
    deaths = [d for d in died if isinstance(d, Mapping)] if isinstance(died, list) else []
    # x-death is most recent first; the latest death is what put it in the DLQ (earlier ones
    # are usually our delay queues' TTL expiries, reason "expired", on the way back to Q).
    latest = deaths[0] if deaths else {}
    attempt = hdrs.get(h.ATTEMPT)
    ours = _text(hdrs.get(h.DEAD_LETTER_REASON))
    if ours is not None:
        reason = ours
        original = _text(hdrs.get(h.ORIGINAL_QUEUE))
        first = _time(hdrs.get(h.FIRST_FAILURE_AT))
        last = _time(hdrs.get(h.LAST_FAILURE_AT))
    else:
        reason = (
            _text(latest.get("reason")) or _text(hdrs.get(h.X_FIRST_DEATH_REASON)) or UNKNOWN_REASON
        )
        original = _text(latest.get("queue")) or _text(hdrs.get(h.X_FIRST_DEATH_QUEUE))
        died_at = _time(latest.get("time"))
        first = _time(hdrs.get(h.FIRST_FAILURE_AT)) or _time(
            deaths[-1].get("time") if deaths else None
        )
        last = died_at or _time(hdrs.get(h.LAST_FAILURE_AT))
    return DeadLetter(
        task_id=_text(task_id) or "",
        reason=reason,
        error_type=_error_type(hdrs.get(h.ERROR_TYPE)),
        error_message=_text(hdrs.get(h.ERROR_MESSAGE)),
        # Our attempt number: for a crash loop, the attempt whose deliveries kept dying.
        attempts=attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None,
        original_queue=original,
        first_failure_at=first,
        last_failure_at=last,
        trace_id=_text(hdrs.get(h.TRACE_ID)),
        body=body,
        headers=hdrs,
    )


def requeue_headers(headers: Mapping[str, Any], *, at_ms: int | None = None) -> dict[str, Any]:
    """The headers of a copy sent back to work: a fresh first attempt that remembers the trip
    (how many re-drives, and the time of this one when ``at_ms`` is given)."""
    out = {
        k: v
        for k, v in headers.items()
        if k not in _FAILURE_HEADERS and not k.startswith(h.BROKER_DEATH_PREFIXES)
    }
    out[h.ATTEMPT] = 1
    out[h.REQUEUED] = _requeued(headers) + 1
    if at_ms is not None:
        out[h.REQUEUED_AT] = datetime.fromtimestamp(at_ms / 1000, UTC).isoformat()
    return out


def _requeued(headers: Mapping[str, Any]) -> int:
    before = headers.get(h.REQUEUED)
    return before if isinstance(before, int) and not isinstance(before, bool) and before > 0 else 0


class _ExactProperties(Basic.Properties):
    """Properties whose headers are written back with the value a reader decoded: pamqp's
    own encoder would write a 64-bit float as a 32-bit one (changing 0.1), refuse bytes (what
    it decodes a non-UTF-8 long string to) and reorder the keys."""

    # No __slots__ of its own: pamqp's marshal() walks self.__slots__, which must stay the
    # parent's list of properties.

    def encode_property(self, name: str, value: Any) -> bytes:
        if name == "headers" and isinstance(value, dict):
            return _field_table(value)
        return super().encode_property(name, value)


def _field_table(table: Mapping[str, Any]) -> bytes:
    body = b"".join(encode.short_string(k) + _field_value(v) for k, v in table.items())
    return struct.pack(">I", len(body)) + body


def _field_value(value: Any) -> bytes:
    if isinstance(value, float):
        return b"d" + encode.double(value)
    if isinstance(value, bytes):
        return b"S" + struct.pack(">I", len(value)) + value
    if isinstance(value, Mapping):
        return b"F" + _field_table(value)
    if isinstance(value, list):
        items = b"".join(_field_value(v) for v in value)
        return b"A" + struct.pack(">I", len(items)) + items
    return encode.encode_table_value(value)


def _with(properties: Basic.Properties, **changes: Any) -> Basic.Properties:
    values = {name: getattr(properties, name) for name in properties.attributes()}
    values.update(changes)
    return _ExactProperties(**values)


def kept_properties(properties: Basic.Properties) -> Basic.Properties:
    """The properties of the copy that takes a dead letter's place when a look rotates the
    DLQ: every property and header exactly as read, minus the broker's ``x-delivery-count``
    (its count of returns in this queue: the copy was never returned). Properties the client
    could not decode are copied back as the bytes they were read from."""
    raw = undecodable(properties.headers)
    if raw is not None:
        return raw_properties(raw)
    headers = properties.headers
    if isinstance(headers, dict) and h.X_DELIVERY_COUNT in headers:
        headers = {k: v for k, v in headers.items() if k != h.X_DELIVERY_COUNT}
    return _with(properties, headers=headers)


def requeued_properties(properties: Basic.Properties, *, at_ms: int) -> Basic.Properties:
    """Same body, task id, trace id and properties as the dead letter; new headers.

    A task published with a lifetime gets a fresh one of the same length from ``at_ms``
    (header and ``expiration``): its old deadline has passed or soon will, and the copy
    would only expire again."""
    headers = properties.headers if isinstance(properties.headers, Mapping) else {}
    fresh, ttl_ms = renewed(requeue_headers(headers, at_ms=at_ms), at_ms)
    return _with(
        properties,
        headers=fresh,
        content_type=properties.content_type or CONTENT_TYPE,
        delivery_mode=2,  # persistent
        # The old expiration is never copied (the broker strips it on dead-lettering anyway).
        expiration=str(ttl_ms) if ttl_ms is not None else None,
        # The broker refuses a user_id that is not this connection's user.
        user_id=None,
    )


# How ``body`` is written in an export record (``body_encoding``): a JSON body as the JSON
# value itself (jq reads it as an object), other UTF-8 text as a string, anything else as
# base64. A JSON body whose compact re-encoding is not its exact bytes (spaces, key order
# kept by the parser but number spellings like 1e3 changed) also gets ``body_bytes``, the
# exact bytes in base64, so an import restores the body byte for byte.
BODY_JSON = "json"
BODY_TEXT = "utf-8"
BODY_BASE64 = "base64"


def export_record(dead: DeadLetter, raw_properties: bytes | None = None) -> dict[str, Any]:
    """One JSON-able object: the DeadLetter fields, the body (see ``BODY_JSON``), the headers
    readable, and when ``raw_properties`` is given (an export) the message's AMQP properties
    exactly as encoded (base64), which ``dlq import`` restores."""
    record: dict[str, Any] = {
        "task_id": dead.task_id,
        "reason": dead.reason,
        "error_type": dead.error_type,
        "error_message": dead.error_message,
        "attempts": dead.attempts,
        "original_queue": dead.original_queue,
        "first_failure_at": _iso(dead.first_failure_at),
        "last_failure_at": _iso(dead.last_failure_at),
        "trace_id": dead.trace_id,
        "requeued": dead.requeued,
        "last_requeued_at": _iso(dead.last_requeued_at),
        **_body_fields(dead.body),
        "headers": _jsonable(dead.headers),
    }
    if raw_properties is not None:
        record["amqp_properties"] = base64.b64encode(raw_properties).decode("ascii")
    return record


def _body_fields(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode("ascii"), "body_encoding": BODY_BASE64}
    try:
        value = json.loads(text)
    except ValueError:
        return {"body": text, "body_encoding": BODY_TEXT}
    fields: dict[str, Any] = {"body": value, "body_encoding": BODY_JSON}
    if _compact_json(value) != body:
        fields["body_bytes"] = base64.b64encode(body).decode("ascii")
    return fields


def _compact_json(value: Any) -> bytes:
    # How our producer writes a body (pydantic_core.to_json): no spaces, UTF-8 as is.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def record_body(record: Mapping[str, Any]) -> bytes:
    """The exact body an export record was written from; ``ValueError`` if it cannot be."""
    encoding = record.get("body_encoding")
    body = record.get("body")
    exact = record.get("body_bytes")
    if isinstance(exact, str):
        return base64.b64decode(exact, validate=True)
    if encoding == BODY_JSON:
        return _compact_json(body)
    if encoding == BODY_TEXT and isinstance(body, str):
        return body.encode("utf-8")
    if encoding == BODY_BASE64 and isinstance(body, str):
        return base64.b64decode(body, validate=True)
    raise ValueError(f"body_encoding {encoding!r} with a body of type {type(body).__name__}")


def record_properties(record: Mapping[str, Any], *, user: str | None = None) -> Basic.Properties:
    """The AMQP properties an export record was written from, to be published byte for byte
    by ``user`` (None: not checked); ``ValueError`` if the record has none (a record from
    before ``amqp_properties``) or the broker would refuse them (``dlq_properties``)."""
    encoded = record.get("amqp_properties")
    if not isinstance(encoded, str):
        raise ValueError("no amqp_properties (only exports of this version can be imported)")
    raw = base64.b64decode(encoded, validate=True)
    # Published as the same bytes: a dead letter whose properties no client decodes
    # (undecodable_properties) is exported and imported unchanged, like every look keeps it.
    decodable = record.get("reason") != UNDECODABLE_PROPERTIES_REASON
    check_properties(raw, decodable=decodable, user=user)
    return raw_properties(raw)


def encoded_properties(properties: Basic.Properties) -> bytes:
    """``properties`` as a copy would be published (``kept_properties``): flags and fields."""
    return kept_properties(properties).marshal()


# -- header values -------------------------------------------------------------------------


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return None


def _error_type(value: object) -> str | None:
    # Read through stable_error_type: a dead letter from before stable names says
    # "builtins.RuntimeError" and is shown, exported and matched as "RuntimeError".
    text = _text(value)
    return stable_error_type(text) if text else text


def _time(value: object) -> datetime | None:
    if isinstance(value, datetime):
        return value
    text = _text(value)
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _jsonable(value: object) -> Any:
    """AMQP field values as JSON: times as ISO text, bytes as text (or base64), decimals as
    strings so no precision is lost."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)

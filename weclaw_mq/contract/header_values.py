"""The values of an incoming message that we carry on, checked before anything uses them.

A delivery's task id, trace id and our own headers go into log lines, Redis keys, status
records and every copy we publish (retry, DLQ). Any producer can write them, so each is
checked here once, where a delivery is read (``message.read_delivery``): a value of the wrong
type, out of range, too long, or holding control characters (a newline in a log line forges
the next one) is replaced by a safe one (or dropped, so its default applies) and the
replacement logged with a short, escaped view of what came in. Nothing is refused for it:
the task itself runs (or is dead-lettered) on its merits.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import validate_session_id
from weclaw_mq.errors import ConfigurationError

log = logging.getLogger("weclaw_mq.worker")

TRACE_ID_MAX_CHARS = 128
# W3C trace context, version 00 and later versions' leading fields.
TRACEPARENT_RE = re.compile(
    r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[0-9a-zA-Z.=-]{0,64})?"
)
# Counters: a task cannot have been tried more often than this (RabbitMQ's own limits and ours
# are far below); anything larger is nonsense, not a count.
COUNT_MAX = 1_000_000
# Epoch ms a datetime can hold (years 1 to 9999): a deadline outside cannot be written down.
_MS_MIN = int(datetime(1970, 1, 2, tzinfo=UTC).timestamp() * 1000)
_MS_MAX = int(datetime(9999, 12, 30, tzinfo=UTC).timestamp() * 1000)
_SHOWN_CHARS = 40  # of a replaced value, in the warning


def new_trace_id() -> str:
    """A new trace id (``x-weclaw-trace-id``): 32 hex digits."""
    return uuid.uuid4().hex


def printable_text(value: object, max_chars: int) -> bool:
    """Printable text (no control, line or format characters) of 1 to ``max_chars`` chars."""
    return isinstance(value, str) and 0 < len(value) <= max_chars and value.isprintable()


def shown(value: object) -> str:
    """A short, escaped view of a bad value for a log line (never the whole of it)."""
    text = ascii(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} chars)"


def task_id(message_id: str) -> str:
    """The message id, or a stable stand-in for one we cannot put in a log line or key.

    Derived from the raw id, so every copy of the message gets the same stand-in and the
    idempotency guard still recognises it."""
    if message_id.isprintable():
        return message_id
    digest = hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    replacement = f"unsafe-{digest}"
    log.warning("task id %s is not printable text; using %s", shown(message_id), replacement)
    return replacement


def _count(low: int) -> Callable[[object], bool]:
    def ok(value: object) -> bool:
        return type(value) is int and low <= value <= COUNT_MAX

    return ok


def _epoch_ms(value: object) -> bool:
    return type(value) is int and _MS_MIN <= value <= _MS_MAX


def _positive_ms(value: object) -> bool:
    return type(value) is int and 0 < value <= _MS_MAX


def _trace_id(value: object) -> bool:
    # printable_text, spelled out (it runs for every delivery); no spaces either: the log
    # format separates fields with them.
    return (
        isinstance(value, str)
        and 0 < len(value) <= TRACE_ID_MAX_CHARS
        and value.isprintable()
        and " " not in value
    )


def _session_id(value: object) -> bool:
    try:
        validate_session_id(value)
    except ConfigurationError:
        return False
    return True


def _traceparent(value: object) -> bool:
    return isinstance(value, str) and TRACEPARENT_RE.fullmatch(value) is not None


# Our headers whose values the worker reads, and what a valid one is. One that fails is
# dropped, and the reader's default applies (attempt 1, no deadline...); a trace id is
# replaced by a new one.
_VALID: dict[str, Callable[[object], bool]] = {
    h.ATTEMPT: _count(1),
    h.RETURNS: _count(0),
    h.REQUEUED: _count(0),
    h.EXPIRES_AT: _epoch_ms,
    h.TTL_MS: _positive_ms,
    h.TRACE_ID: _trace_id,
    h.TRACEPARENT: _traceparent,
    h.X_DELIVERY_COUNT: _count(0),
    h.SESSION_ID: _session_id,
}


def checked(headers: dict[str, Any]) -> dict[str, Any]:
    """``headers`` without the values of ours that fail their check (logged, once each)."""
    # One pass over the message's headers (a task carries a handful), not over ours: this
    # runs for every delivery.
    bad: list[str] | None = None
    for name, value in headers.items():
        valid = _VALID.get(name)
        if valid is not None and not valid(value):
            if bad is None:
                bad = []
            bad.append(name)
    if bad is None:
        return headers
    out = dict(headers)
    for name in bad:
        log.warning("header %s %s is not valid; ignored", name, shown(out.pop(name)))
    if h.TRACE_ID in bad:
        # Replaced rather than dropped, so every later hop of the task shares one trace id.
        out[h.TRACE_ID] = new_trace_id()
    return out

"""Trace ids that follow a task from the API through the worker into every log line.

A ``ContextVar`` holds the identifiers of the task being handled; asyncio copies it into each
task, so concurrent handlers never see each other's ids (``threading.local`` would).
"""

from __future__ import annotations

import json
import logging
import re
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.header_values import new_trace_id
from weclaw_mq.settings import redact_url


@dataclass(frozen=True, slots=True)
class TraceContext:
    trace_id: str
    task_id: str | None = None
    queue: str | None = None
    attempt: int | None = None
    traceparent: str | None = None


class Traced(Protocol):
    """What a trace context holds: a ``TraceContext``, or the worker's own record of the
    delivery it is processing (``message.Delivery``), which carries the same fields, so a
    delivery makes no second object for its trace."""

    @property
    def trace_id(self) -> str: ...
    @property
    def task_id(self) -> str | None: ...
    @property
    def queue(self) -> str | None: ...
    @property
    def attempt(self) -> int | None: ...
    @property
    def traceparent(self) -> str | None: ...


_current: ContextVar[Traced | None] = ContextVar("weclaw_mq_trace", default=None)


def current() -> TraceContext | None:
    """The identifiers of the task being handled, or None outside one."""
    ctx = _current.get()
    if ctx is None or isinstance(ctx, TraceContext):
        return ctx
    return TraceContext(
        trace_id=ctx.trace_id,
        task_id=ctx.task_id,
        queue=ctx.queue,
        attempt=ctx.attempt,
        traceparent=ctx.traceparent,
    )


# ``enter(ctx)`` makes ``ctx`` current and returns the token to hand to ``leave``. The
# ContextVar's own methods, not wrappers around them: the worker calls both for every delivery.
enter = _current.set
leave = _current.reset


def trace_from_headers(headers: dict[str, object]) -> tuple[str, str | None]:
    trace_id = headers.get(h.TRACE_ID)
    parent = headers.get(h.TRACEPARENT)
    return (
        trace_id if isinstance(trace_id, str) and trace_id else new_trace_id(),
        parent if isinstance(parent, str) else None,
    )


class TraceLogFilter(logging.Filter):
    """Adds ``trace_id``, ``task_id``, ``queue`` and ``attempt`` to every record ('-' outside)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        record.trace_id = ctx.trace_id if ctx else "-"
        record.task_id = (ctx.task_id if ctx else None) or "-"
        record.queue = (ctx.queue if ctx else None) or "-"
        record.attempt = ctx.attempt if ctx and ctx.attempt is not None else "-"
        return True


LOG_FORMAT = (
    "%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s task=%(task_id)s "
    "queue=%(queue)s attempt=%(attempt)s] %(message)s"
)
LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

# A URL with a user-info part (scheme://user:password@host...): its password is replaced by
# redact_url before any line is written, whoever logged it (an aiormq exception quoting the
# broker URL, a user's own log call).
_URL_WITH_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@]*:[^\s@]*@[^\s'\"<>]*")


def redact_secrets(text: str) -> str:
    """``text`` with every URL password in it replaced by ``***``."""
    if "://" not in text:  # the common line pays one substring test
        return text
    return _URL_WITH_PASSWORD.sub(lambda m: redact_url(m.group(0)), text)


class TextFormatter(logging.Formatter):
    """The human format: one line per record, the task identifiers in brackets."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return redact_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``; ``task_id``, ``trace_id``, ``queue`` and ``attempt`` when known (from
    ``TraceLogFilter``); an exception as ``exc_type``, ``exc_message`` and ``exc_traceback``
    (one string: its newlines are escaped, so a traceback never spans lines)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact_secrets(record.getMessage()),
        }
        for key in ("task_id", "trace_id", "queue", "attempt"):
            value = getattr(record, key, None)
            if value is not None and value != "-":
                line[key] = value
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line["exc_type"] = type(error).__name__
            line["exc_message"] = redact_secrets(str(error))
            line["exc_traceback"] = redact_secrets(self.formatException(record.exc_info))
        elif record.exc_text:
            line["exc_traceback"] = redact_secrets(record.exc_text)
        if record.stack_info:
            line["stack"] = redact_secrets(self.formatStack(record.stack_info))
        return json.dumps(line, ensure_ascii=False)


def formatter(log_format: LogFormat) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    return TextFormatter()


def configure_logging(level: int | str = logging.INFO, log_format: LogFormat = "text") -> None:
    """Log to stderr with the task identifiers on every record (used by the CLI): ``text``
    lines for people, or ``json`` objects, one per line, for log collectors."""
    handler = logging.StreamHandler()
    handler.addFilter(TraceLogFilter())
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Python's warnings go through the same handler: in json, every line stays an object.
    logging.captureWarnings(True)
    # aiormq/aio-pika log connection failures themselves, some with the broker URL; ours say
    # the same with the password redacted, so theirs stay silent.
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    logging.getLogger("aio_pika").setLevel(logging.CRITICAL)

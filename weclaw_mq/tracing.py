"""Trace ids that follow a task from the API through the worker into every log line.

A ``ContextVar`` holds the identifiers of the task being handled; asyncio copies it into each
task, so concurrent handlers never see each other's ids (``threading.local`` would).
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar, Token
from dataclasses import dataclass

from . import headers as h


@dataclass(frozen=True, slots=True)
class TraceContext:
    trace_id: str
    task_id: str | None = None
    queue: str | None = None
    attempt: int | None = None
    traceparent: str | None = None


_current: ContextVar[TraceContext | None] = ContextVar("weclaw_mq_trace", default=None)


def new_trace_id() -> str:
    return uuid.uuid4().hex


def current() -> TraceContext | None:
    return _current.get()


def enter(ctx: TraceContext) -> Token[TraceContext | None]:
    """Make ``ctx`` current; hand the token to ``leave``."""
    return _current.set(ctx)


def leave(token: Token[TraceContext | None]) -> None:
    _current.reset(token)


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


def configure_logging(level: int | str = logging.INFO) -> None:
    """Log to stderr with the task identifiers on every line (used by the CLI)."""
    handler = logging.StreamHandler()
    handler.addFilter(TraceLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiormq/aio-pika log connection failures themselves, some with the broker URL; ours say
    # the same with the password redacted, so theirs stay silent.
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    logging.getLogger("aio_pika").setLevel(logging.CRITICAL)

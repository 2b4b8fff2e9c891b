"""OpenTelemetry spans: one per publish (PRODUCER), one per handled delivery (CONSUMER).

The publish span's context travels in the message's W3C ``traceparent`` header; the worker
extracts it, so the handler's span is a child of the publish span, in the same trace. A retry
carries the task's headers to its next attempt unchanged: every attempt's span is a child of
the one publish span, and a task's whole story is one trace.

When spans are opened (``Settings.otel``, ``WECLAW_MQ_OTEL``):

- ``auto`` (default): when the process has set a TracerProvider
  (``opentelemetry.trace.set_tracer_provider``, or ``opentelemetry-instrument``) by the time
  the App first publishes or the worker starts; else never.
- ``on``: always, with the global provider; an error if opentelemetry-api is not installed.
- ``off``: never.
- ``App.trace_with(provider)``: with that provider, whatever the setting (tests, or a
  provider that is not the global one).

Nothing here imports opentelemetry at module level: a process without it, or with spans
off, never loads it, and pays one ``None`` check per publish and per delivery.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from weclaw_mq.contract import headers as h
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.settings import Settings

if TYPE_CHECKING:
    from aio_pika import Message
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from weclaw_mq.contract.message import Delivery

INSTRUMENTATION_NAME = "weclaw_mq"
MESSAGING_SYSTEM = "rabbitmq"
# Our own attributes, beside the semantic conventions' messaging.* ones.
ATTEMPT = "weclaw_mq.attempt"
TASK_ID = "weclaw_mq.task_id"
TRACE_ID = "weclaw_mq.trace_id"  # the x-trace-id header, which log lines carry


class _Failure:
    """The error recorded on the current handler span, so that one failure seen twice (the
    handler's error, then the dead-letter it leads to) is recorded once."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: BaseException | None = None


_failure: ContextVar[_Failure | None] = ContextVar("weclaw_mq_otel_failure", default=None)


class Spans:
    """Opens the spans of one App (its publishes, and its worker's deliveries)."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        # Only the W3C header: the message carries traceparent (headers.TRACEPARENT), whatever
        # propagators the application configured globally for its HTTP calls.
        self._propagator = TraceContextTextMapPropagator()
        self._tracer: Tracer = trace.get_tracer(
            INSTRUMENTATION_NAME, tracer_provider=tracer_provider
        )

    @contextlib.contextmanager
    def publishing(self, queue: str, messages: Sequence[Message]) -> Iterator[None]:
        """A PRODUCER span around sending ``messages`` (one publish, or one batch), whose
        context each of them carries in its ``traceparent`` header. An error raised inside
        is recorded on the span, which ends with status ERROR."""
        attributes = _attributes(queue, messages)
        with self._tracer.start_as_current_span(
            f"publish {queue}", kind=self._trace.SpanKind.PRODUCER, attributes=attributes
        ):
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier)
            traceparent = carrier.get(h.TRACEPARENT)  # absent when the provider does not sample
            if traceparent is not None:
                for message in messages:
                    message.headers[h.TRACEPARENT] = traceparent
            yield

    @contextlib.contextmanager
    def handling(self, queue: str, delivery: Delivery) -> Iterator[None]:
        """A CONSUMER span around one delivery, the child of the span its traceparent names."""
        carrier = {h.TRACEPARENT: delivery.traceparent} if delivery.traceparent else {}
        parent = self._propagator.extract(carrier)
        attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "process",
            "messaging.destination.name": queue,
            "messaging.message.id": delivery.task_id,
            TASK_ID: delivery.task_id,
            TRACE_ID: delivery.trace_id,
            ATTEMPT: delivery.attempt,
        }
        token = _failure.set(_Failure())
        try:
            with self._tracer.start_as_current_span(
                f"process {queue}",
                context=parent,
                kind=self._trace.SpanKind.CONSUMER,
                attributes=attributes,
            ):
                yield
        finally:
            _failure.reset(token)

    def failed(self, error: BaseException) -> None:
        """Mark the current handler span as failed by ``error`` (once per error)."""
        failure = _failure.get()
        if failure is None or failure.error is error:
            return
        failure.error = error
        span: Span = self._trace.get_current_span()
        span.record_exception(error)
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, type(error).__name__))


def _attributes(queue: str, messages: Sequence[Message]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": "publish",
        "messaging.destination.name": queue,
    }
    if len(messages) != 1:
        out["messaging.batch.message_count"] = len(messages)
        return out
    message = messages[0]
    out[ATTEMPT] = 1
    if message.message_id:
        out["messaging.message.id"] = message.message_id
        out[TASK_ID] = message.message_id
    trace_id = message.headers.get(h.TRACE_ID)
    if isinstance(trace_id, str):
        out[TRACE_ID] = trace_id
    return out


def spans_for(settings: Settings) -> Spans | None:
    """The spans ``settings.otel`` asks for, with the global TracerProvider; None for none."""
    if settings.otel == "off":
        return None
    if settings.otel == "on":
        try:
            return Spans()
        except ImportError as e:
            raise ConfigurationError(
                "WECLAW_MQ_OTEL=on but opentelemetry-api is not installed: "
                "pip install 'weclaw_mq[otel]' (or set WECLAW_MQ_OTEL=auto or off)"
            ) from e
    # auto: a process that set a provider has imported opentelemetry.trace already; one that
    # has not is left without it (nothing is imported to find out).
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None or not _provider_is_set(trace):
        return None
    return Spans()


def _provider_is_set(trace: Any) -> bool:
    # Until set_tracer_provider is called, the API hands out a proxy (or, with
    # OTEL_SDK_DISABLED, a no-op provider): spans from either would go nowhere.
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))

"""OpenTelemetry spans on the real broker: a PRODUCER span per publish and a CONSUMER span per
handled delivery, linked through the message's ``traceparent`` header; a retry keeps the trace.

Spans are recorded with the SDK's in-memory exporter through ``App.trace_with``: the global
TracerProvider of this test process is never set, so no other test opens spans."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import BaseModel

from tests.conftest import wait_until
from weclaw_mq import App, Context, RetryPolicy
from weclaw_mq.contract import headers as h
from weclaw_mq.observability.otel import ATTEMPT, TASK_ID, TRACE_ID, spans_for
from weclaw_mq.settings import Settings


class Job(BaseModel):
    text: str


def _recording_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _of_task(spans: Sequence[ReadableSpan], task_id: str, kind: SpanKind) -> list[ReadableSpan]:
    return sorted(
        (s for s in spans if s.kind is kind and (s.attributes or {}).get(TASK_ID) == task_id),
        key=lambda s: int((s.attributes or {}).get(ATTEMPT, 0)),  # type: ignore[arg-type]
    )


async def test_publish_and_handler_spans_share_the_trace_and_a_failure_is_an_error_span(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    provider, exporter = _recording_provider()
    app = make_app()
    app.trace_with(provider)
    headers_seen: dict[str, dict[str, Any]] = {}

    # One retry: the failing task runs twice, and both runs must stay in its trace.
    @app.handler(qname, retry=RetryPolicy(max_retries=1, delay_s=0.05, multiplier=1))
    async def work(task: Job, ctx: Context) -> str:
        headers_seen[f"{task.text}-{ctx.attempt}"] = dict(ctx.headers)
        if task.text == "fail":
            raise RuntimeError("the model said no")
        return "ok"

    await start_worker(app)
    ok_id = await app.publish(qname, {"text": "ok"})
    fail_id = await app.publish(qname, {"text": "fail"})
    # A producer that does not know the handler's model sends a task that fails it: it is
    # dead-lettered without running, and its span says so too.
    producer = make_app("producer")
    producer.trace_with(provider)
    invalid_id = await producer.publish(qname, {"prompt": "no text field"})

    def finished() -> bool:
        spans = exporter.get_finished_spans()
        return (
            len(_of_task(spans, ok_id, SpanKind.CONSUMER)) == 1
            and len(_of_task(spans, fail_id, SpanKind.CONSUMER)) == 2
            and len(_of_task(spans, invalid_id, SpanKind.CONSUMER)) == 1
        )

    await wait_until(finished, 20, "the handler spans of the three tasks (four runs)")
    spans = exporter.get_finished_spans()

    for task_id in (ok_id, fail_id):
        (publish,) = _of_task(spans, task_id, SpanKind.PRODUCER)
        runs = _of_task(spans, task_id, SpanKind.CONSUMER)
        assert publish.name == f"publish {qname}"
        assert publish.attributes is not None
        assert publish.attributes["messaging.system"] == "rabbitmq"
        assert publish.attributes["messaging.destination.name"] == qname
        assert publish.attributes["messaging.message.id"] == task_id
        assert publish.status.status_code is StatusCode.UNSET
        assert publish.context is not None
        for attempt, run in enumerate(runs, start=1):
            assert run.name == f"process {qname}"
            assert run.context is not None and run.parent is not None
            # The same trace, and the handler's span is the publish span's child.
            assert run.context.trace_id == publish.context.trace_id
            assert run.parent.span_id == publish.context.span_id
            assert run.parent.is_remote  # it came through the message, not this process
            assert run.attributes is not None
            assert run.attributes["messaging.system"] == "rabbitmq"
            assert run.attributes["messaging.destination.name"] == qname
            assert run.attributes["messaging.message.id"] == task_id
            assert run.attributes[ATTEMPT] == attempt
            # The weclaw trace id, as log lines carry it, joins logs to spans.
            assert run.attributes[TRACE_ID] == publish.attributes[TRACE_ID]

    (ok_run,) = _of_task(spans, ok_id, SpanKind.CONSUMER)
    assert ok_run.status.status_code is StatusCode.UNSET
    for run in _of_task(spans, fail_id, SpanKind.CONSUMER):
        assert run.status.status_code is StatusCode.ERROR
        # One exception event per run: the failure is recorded once, though it is both the
        # handler's error and, on the last attempt, the dead-letter's cause.
        events = [e for e in run.events if e.name == "exception"]
        assert len(events) == 1
        assert events[0].attributes is not None
        assert events[0].attributes["exception.type"] == "RuntimeError"

    (invalid_run,) = _of_task(spans, invalid_id, SpanKind.CONSUMER)
    assert invalid_run.status.status_code is StatusCode.ERROR
    (event,) = [e for e in invalid_run.events if e.name == "exception"]
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "weclaw_mq.errors.InvalidPayload"
    assert sorted(headers_seen) == ["fail-1", "fail-2", "ok-1"]  # it never reached the handler

    # The header the worker read is the W3C form of the publish span's context.
    (publish,) = _of_task(spans, ok_id, SpanKind.PRODUCER)
    assert publish.context is not None
    version, trace_id, span_id, _flags = headers_seen["ok-1"][h.TRACEPARENT].split("-")
    assert (version, trace_id, span_id) == (
        "00",
        f"{publish.context.trace_id:032x}",
        f"{publish.context.span_id:016x}",
    )
    # The retry carried the first publish's traceparent, not a new one.
    assert headers_seen["fail-2"][h.TRACEPARENT] == headers_seen["fail-1"][h.TRACEPARENT]


async def test_a_task_published_by_a_handler_is_a_child_of_that_handler_span(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    provider, exporter = _recording_provider()
    app = make_app()
    app.trace_with(provider)
    second = f"{qname}-next"

    @app.handler(qname)
    async def first(task: Job, ctx: Context) -> None:
        await ctx.app.publish(second, {"text": task.text})

    @app.handler(second)
    async def then(task: Job) -> None:
        return None

    await start_worker(app)
    task_id = await app.publish(qname, {"text": "chain"})

    def both_ran() -> bool:
        return any(
            s.kind is SpanKind.CONSUMER
            and s.name == f"process {second}"
            and s.context is not None
            and s.context.trace_id == _trace_of(exporter, task_id)
            for s in exporter.get_finished_spans()
        )

    await wait_until(both_ran, 20, "the second handler's span")
    spans = exporter.get_finished_spans()
    (handler_span,) = _of_task(spans, task_id, SpanKind.CONSUMER)
    (inner_publish,) = [s for s in spans if s.name == f"publish {second}"]
    (second_run,) = [s for s in spans if s.name == f"process {second}"]
    assert handler_span.context is not None and inner_publish.context is not None
    assert inner_publish.parent is not None and second_run.parent is not None
    assert inner_publish.parent.span_id == handler_span.context.span_id
    assert second_run.parent.span_id == inner_publish.context.span_id


def _trace_of(exporter: InMemorySpanExporter, task_id: str) -> int | None:
    for span in exporter.get_finished_spans():
        if span.kind is SpanKind.PRODUCER and (span.attributes or {}).get(TASK_ID) == task_id:
            return span.context.trace_id if span.context is not None else None
    return None


def test_spans_are_off_without_a_tracer_provider_and_when_turned_off() -> None:
    # This process imported opentelemetry (above) but set no global provider: "auto" opens
    # nothing, and "off" never does.
    assert spans_for(Settings(otel="auto", _env_file=None)) is None  # type: ignore[call-arg]
    assert spans_for(Settings(otel="off", _env_file=None)) is None  # type: ignore[call-arg]
    assert spans_for(Settings(otel="on", _env_file=None)) is not None  # type: ignore[call-arg]

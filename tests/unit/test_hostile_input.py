"""Hostile input at the decoder: whatever bytes and properties arrive, reading the delivery,
validating its body and building every copy the worker may publish of it never fails in a
way the worker does not turn into a dead letter; the values we carry on are safe."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import aio_pika
import pamqp.encode
import pytest
from aiormq.abc import DeliveredMessage
from hypothesis import example, given
from hypothesis import strategies as st
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from pydantic import BaseModel

from tests.hostile import bodies, fuzz_settings, nested, properties
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.header_values import TRACE_ID_MAX_CHARS
from weclaw_mq.contract.message import read_delivery
from weclaw_mq.contract.undecodable import raw_properties, tolerant_properties, undecodable
from weclaw_mq.errors import InvalidPayload, UndecodableBody
from weclaw_mq.handlers.spec import HandlerSpec, build_spec
from weclaw_mq.observability import tracing
from weclaw_mq.policy.priority import priority_from_header
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.state import TaskStatus
from weclaw_mq.worker.records import task_state
from weclaw_mq.worker.settle import failure_headers


class Prompt(BaseModel):
    text: str


async def _handler(task: Prompt) -> None:
    return None


def spec_of(func: Any) -> HandlerSpec:
    return build_spec(
        func,
        queue="fuzz",
        retry=RetryPolicy(),
        timeout_s=1,
        delivery_limit=10,
        max_length=None,
        idempotent=True,
    )


SPEC = spec_of(_handler)


def delivered(props: Basic.Properties, body: bytes) -> aio_pika.IncomingMessage:
    """What the worker's consumer gets for these properties, read from their wire bytes."""
    wire = props.marshal()
    flags = struct.unpack(">H", wire[:2])[0]
    with tolerant_properties():
        read = Basic.Properties()
        read.unmarshal(flags, wire[2:])
    deliver = Basic.Deliver(consumer_tag="c", delivery_tag=1, routing_key="fuzz")
    header = ContentHeader(body_size=len(body), properties=read)
    return aio_pika.IncomingMessage(DeliveredMessage(deliver, header, body, None))  # type: ignore[arg-type]


@fuzz_settings(200)
@given(props=properties(), body=bodies(1024))
@example(props={"headers": {h.ATTEMPT: "3"}, "message_id": "a\nb"}, body=b'{"text":"x"}')
@example(props={"headers": {h.ATTEMPT: -5, h.TRACE_ID: "t" * 10_000}}, body=b"{}")
@example(props={"headers": {h.TRACE_ID: "a\x00b\nc", h.EXPIRES_AT: 2**62}}, body=nested(10**4))
@example(props={"headers": {h.TTL_MS: -1, h.RETURNS: "many", h.TRACEPARENT: "x\n"}}, body=b"\xff")
def test_any_delivery_reads_into_safe_values_and_publishable_copies(
    props: dict[str, Any], body: bytes
) -> None:
    props = {("message_type" if k == "type" else k): v for k, v in props.items()}
    message = delivered(Basic.Properties(**props), body)
    delivery = read_delivery(message, "fuzz")

    assert delivery.task_id.isprintable() and len(delivery.task_id.encode()) <= 255
    trace = delivery.trace_id
    assert trace.isprintable() and " " not in trace and len(trace) <= TRACE_ID_MAX_CHARS
    assert delivery.traceparent is None or delivery.traceparent.isprintable()
    assert delivery.attempt >= 1 and delivery.returns >= 0
    token = tracing.enter(delivery)  # the delivery is its own trace context
    assert tracing.current() == tracing.TraceContext(
        trace_id=trace,
        task_id=delivery.task_id,
        queue="fuzz",
        attempt=delivery.attempt,
        traceparent=delivery.traceparent,
    )
    tracing.leave(token)
    priority_from_header(delivery.headers.get(h.PRIORITY))  # the lane its retries go back to
    task_state(delivery, SPEC, TaskStatus.RUNNING).model_dump_json()  # a record Redis can hold
    # The copy a retry or dead letter publishes encodes (else the task would stay unsettled).
    copy = failure_headers(delivery, "fuzz", RuntimeError("boom"))
    copy[h.ATTEMPT] = delivery.attempt + 1
    pamqp.encode.field_table(copy)
    with contextlib.suppress(UndecodableBody, InvalidPayload):  # a dead letter with its reason
        SPEC.parse(delivery.body)


@fuzz_settings(300)
@given(flags=st.integers(0, 0xFFFF), data=st.binary(max_size=300))
def test_random_property_bytes_never_break_the_reader(flags: int, data: bytes) -> None:
    with tolerant_properties():
        props = Basic.Properties()
        props.unmarshal(flags, data)
    raw = undecodable(props.headers)
    if raw is not None:  # kept byte for byte, so the DLQ tools can show and keep it
        assert raw_properties(raw).marshal() == struct.pack(">H", flags) + data


@pytest.mark.parametrize("depth", [202, 5_000, 100_000])
def test_json_nested_past_about_200_levels_is_undecodable(depth: int) -> None:
    # pydantic-core's parser stops at about 200 levels (an array at 202, an object at 201),
    # without Python recursion: the bound SECURITY.md states. An upgrade that moves it fails
    # here.
    spec = spec_of(_any)
    spec.parse(b"[" * 200 + b"]" * 200)
    with pytest.raises(UndecodableBody, match="recursion limit"):
        spec.parse(b"[" * depth + b"]" * depth)


async def _any(task: Any) -> None:
    return None

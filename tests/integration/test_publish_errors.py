"""What publish raises and how long it takes when its input, the broker or Redis is wrong:
always an error of ours, nothing sent or recorded for a refused task, and Redis never on the
confirmed path."""

from __future__ import annotations

import datetime
import decimal
import time
from collections.abc import Callable
from typing import Any

import aio_pika
import pytest
from pydantic import BaseModel

from tests.conftest import delete_queues, get_message, queue_depth, settings_for
from tests.integration.dead_endpoints import closed_port, silent_server
from weclaw_mq import (
    App,
    BrokerUnavailableError,
    MessageEncodingError,
    PayloadError,
    PublishFailedError,
    TaskStatus,
)
from weclaw_mq.contract.message import build_message
from weclaw_mq.wire.producer import Publisher
from weclaw_mq.wire.topology import queue_declarations


class Prompt(BaseModel):
    text: str


async def _declared_app(make_app: Callable[..., App], qname: str, **settings: Any) -> App:
    app = make_app(**settings)

    @app.handler(qname)
    async def summarise(task: Prompt) -> None:
        return None

    await app.declare()
    return app


BAD_HEADERS: dict[str, dict[Any, Any]] = {
    "an object": {"x-thing": object()},
    "a set": {"x-tags": {"a", "b"}},
    "bytes": {"x-raw": b"ab"},
    "a tuple": {"x-pair": (1, 2)},
    "an int past 64 bits": {"x-big": 2**70},
    "a nested object": {"x-outer": {"inner": [1, {"deep": object()}]}},
    "a name over 128 bytes": {"x-" + "k" * 200: 1},
    "a nested name over 128 bytes": {"x-outer": {"k" * 200: 1}},
    "a name that is not a str": {7: "seven"},
    "names of mixed types": {7: "seven", "x-eight": 8},
    "a lone surrogate": {"x-text": "\udc80"},
    "a NaN decimal": {"x-d": decimal.Decimal("NaN")},
    # pamqp encodes these; RabbitMQ then closes the whole connection (INTERNAL_ERROR).
    "a NaN float": {"x-f": float("nan")},
    "an infinite float, nested": {"x-outer": [1.0, {"x-inf": float("-inf")}]},
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
async def test_a_header_amqp_cannot_carry_is_refused_before_anything_is_sent_or_recorded(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel, case: str
) -> None:
    app = await _declared_app(make_app, qname)
    task_id = f"bad-header-{qname}"
    with pytest.raises(MessageEncodingError) as raised:
        await app.publish(qname, Prompt(text="hi"), task_id=task_id, headers=BAD_HEADERS[case])
    assert isinstance(raised.value, PayloadError)
    assert len(str(raised.value)) < 600, "the message must stay readable"
    assert await queue_depth(amqp, qname) == 0
    assert await app.status(task_id, queue=qname) is None, "a queued record survived"
    # The App is unharmed: the next good publish goes through.
    await app.publish(qname, Prompt(text="fine"))
    assert await queue_depth(amqp, qname) == 1


@pytest.mark.parametrize(
    "headers",
    [
        {"x-ok": None, "x-f": 1.5, "x-d": decimal.Decimal("1.5"), "x-b": bytearray(b"ab")},
        {"x-when": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC), "x-list": [1, "a"]},
        {"x-" + "k" * 126: "a name of exactly 128 bytes", "x-long-value": "v" * 100_000},
    ],
)
async def test_headers_amqp_can_carry_are_sent(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel, headers: Any
) -> None:
    app = await _declared_app(make_app, qname)
    await app.publish(qname, Prompt(text="hi"), headers=headers)
    assert await queue_depth(amqp, qname) == 1


@pytest.mark.parametrize(
    ("what", "queue_suffix", "task_id"),
    [
        ("task id", "", "t" * 256),
        ("task id", "", "é" * 128),  # 256 bytes in UTF-8
        ("task id", "", "\udc80"),
        ("task id", "", "a\nforged log line"),  # printable text only (SECURITY.md)
        ("queue name", "-" + "q" * 256, None),
    ],
)
async def test_a_task_id_or_queue_name_over_amqps_limits_is_refused_before_sending(
    make_app: Callable[..., App],
    qname: str,
    amqp: aio_pika.abc.AbstractChannel,
    what: str,
    queue_suffix: str,
    task_id: str | None,
) -> None:
    app = await _declared_app(make_app, qname)
    with pytest.raises(MessageEncodingError, match=what):
        await app.publish(qname + queue_suffix, Prompt(text="hi"), task_id=task_id)
    with pytest.raises(MessageEncodingError, match=what):
        await app.publish_many(
            qname + queue_suffix,
            [Prompt(text="a"), Prompt(text="b")],
            task_ids=["ok", task_id or "ok2"],
        )
    assert await queue_depth(amqp, qname) == 0


async def test_one_bad_header_refuses_a_whole_batch_before_sending(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _declared_app(make_app, qname)
    with pytest.raises(MessageEncodingError):
        await app.publish_many(qname, [Prompt(text="a")] * 3, headers={"x-thing": object()})
    assert await queue_depth(amqp, qname) == 0


async def test_a_message_built_elsewhere_that_amqp_cannot_encode_fails_as_ours_and_harms_nothing(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    # The publisher under the worker's moves and the DLQ tools, without App.prepare's check.
    app = await _declared_app(make_app, qname)
    publisher = Publisher(app.broker, app.metrics, name="t-publisher")
    try:
        bad = build_message(b"{}", task_id="bad", headers={"x-thing": object()})
        with pytest.raises(MessageEncodingError, match="nothing was sent"):
            await publisher.publish(qname, bad)
        with pytest.raises(MessageEncodingError):
            await publisher.publish("q" * 256, build_message(b"{}", task_id="long", headers={}))
        await publisher.publish(qname, build_message(b"{}", task_id="good", headers={}))
    finally:
        await publisher.close()
    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == "good"
    assert await queue_depth(amqp, qname) == 0


def _published(app: App, queue: str, outcome: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_published_total", {"queue": queue, "outcome": outcome}
    )
    return value or 0.0


async def test_a_refused_broker_connection_counts_as_an_unavailable_publish(
    redis_url: str, qname: str
) -> None:
    url = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    async with App("t", settings=settings_for(url, redis_url)) as app:
        started = time.monotonic()
        with pytest.raises(BrokerUnavailableError) as refused:
            await app.publish(qname, {"text": "hi"}, task_id="refused-1")
        assert time.monotonic() - started < 5, "a refused connection should fail fast"
        # One except for "not confirmed, for any reason", naming the publish that failed.
        assert isinstance(refused.value, PublishFailedError)
        assert (refused.value.queue, refused.value.task_id) == (qname, "refused-1")
        assert _published(app, qname, "unavailable") == 1
        with pytest.raises(BrokerUnavailableError):
            await app.publish(qname, {"text": "again"})
        assert _published(app, qname, "unavailable") == 2


async def test_the_relay_reaching_the_broker_ends_the_publishers_backoff_step(
    redis_url: str, qname: str
) -> None:
    # The outbox relay connected while the app's publisher still backed off: without the
    # word, the next publish went to the outbox instead of to the broker that answers.
    url = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    settings = settings_for(url, redis_url).model_copy(update={"reconnect_max_delay_s": 60.0})
    async with App("t", settings=settings) as app:
        with pytest.raises(BrokerUnavailableError):
            await app.publish(qname, {"text": "hi"}, task_id="refused-2")
        publisher = app._engine.get_publisher()
        assert publisher.unavailable() is not None, "a connect just failed: the next waits"
        publisher.broker_reached()
        assert publisher.unavailable() is None


# Far below the Redis socket timeout (5 s) that a publish waited out before, and generous
# for a loaded 2-core machine: a publish to the real broker takes milliseconds.
PUBLISH_BOUND_S = 2.5


async def test_a_redis_that_never_answers_does_not_slow_down_confirmed_publishing(
    broker_url: str, redis_url: str, qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    async with silent_server() as port:
        settings = settings_for(broker_url, f"redis://127.0.0.1:{port}/0", redis_timeout_s=5)
        app = App("t", settings=settings)

        @app.handler(qname)
        async def summarise(task: Prompt) -> None:
            return None

        try:
            await app.declare()
            await app.publish(qname, Prompt(text="warm-up"))  # connection and channel open

            started = time.monotonic()
            await app.publish(qname, Prompt(text="one"))
            one_s = time.monotonic() - started
            started = time.monotonic()
            await app.publish_many(qname, [Prompt(text="a"), Prompt(text="b")])
            many_s = time.monotonic() - started

            assert one_s < PUBLISH_BOUND_S, f"publish took {one_s:.2f} s"
            assert many_s < PUBLISH_BOUND_S, f"publish_many took {many_s:.2f} s"
            assert await queue_depth(amqp, qname) == 4
        finally:
            started = time.monotonic()
            await app.close()
            # Pending record writes get a short grace on close, not the socket timeout.
            assert time.monotonic() - started < PUBLISH_BOUND_S
            spec = app.handlers[qname].queue_spec()
            await delete_queues(broker_url, [name for name, _ in queue_declarations(spec)])


async def test_the_queued_record_is_there_right_after_publish_with_a_healthy_redis(
    make_app: Callable[..., App], qname: str
) -> None:
    app = await _declared_app(make_app, qname)
    task_id = await app.publish(qname, Prompt(text="hi"))
    state = await app.status(task_id, queue=qname)
    assert state is not None and state.status is TaskStatus.QUEUED
    ids = await app.publish_many(qname, [Prompt(text="a"), Prompt(text="b")])
    states = [await app.status(t) for t in ids]
    assert [s.status if s else None for s in states] == [TaskStatus.QUEUED] * 2

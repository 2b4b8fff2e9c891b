"""``weclaw_mq.worker.incoming``: the worker's message, built without aio-pika's per-attribute
checks, equals aio-pika's own ``IncomingMessage`` of the same delivery in every slot, for real
deliveries with every property set, none set, no property flag at all, and the edge values
aio-pika normalises (empty strings, delivery mode 0, priority 0); it acks, rejects and reports
``processed`` as aio-pika's does; and its consumer is cancelled by aio-pika's ``Queue.cancel``."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from aio_pika.message import IncomingMessage, Message
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from tests.conftest import queue_depth, wait_until
from weclaw_mq.worker import incoming

_MISSING = object()

PROPERTY_SETS: dict[str, dict[str, Any]] = {
    "every property": {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": {
            "x-weclaw-attempt": 3,
            "nested": {"a": [1, "b"]},
            "raw": bytearray(b"\x00\xff"),
        },
        "delivery_mode": aio_pika.DeliveryMode.PERSISTENT,
        "priority": 7,
        "correlation_id": "corr-1",
        "reply_to": "replies",
        "expiration": 60,  # seconds: the broker sees "60000"
        "message_id": "task-1",
        "timestamp": datetime(2026, 12, 1, 21, 30, 5, tzinfo=UTC),
        "type": "kind",
        "user_id": "guest",  # the broker checks it against the connection's user
        "app_id": "weclaw",
    },
    "no property": {},  # as aio-pika publishes it: priority 0, delivery mode 1, empty headers
    "normalised values": {
        "correlation_id": "",
        "reply_to": "",
        "message_id": "",
        "type": "",
        "app_id": "",
        "priority": 0,
        "delivery_mode": aio_pika.DeliveryMode.NOT_PERSISTENT,
        "headers": {},
    },
}


def _slots() -> list[str]:
    names: list[str] = []
    for cls in (Message, IncomingMessage):
        for name in cls.__dict__["__slots__"]:
            names.append(f"_{cls.__name__}{name}" if name.startswith("__") else name)
    return names


def _state(message: object) -> dict[str, object]:
    return {name: getattr(message, name, _MISSING) for name in _slots()}


async def _deliveries(channel: AbstractChannel, queue: str, count: int) -> list[DeliveredMessage]:
    """``count`` deliveries of ``queue`` as aiormq hands them to a consumer (left unacked)."""
    got: list[DeliveredMessage] = []
    underlay = await channel.get_underlay_channel()

    async def collect(message: DeliveredMessage) -> None:
        got.append(message)

    ok = await underlay.basic_consume(queue, collect)
    await wait_until(lambda: len(got) >= count, what=f"{count} deliveries")
    assert ok.consumer_tag is not None
    await underlay.basic_cancel(ok.consumer_tag)
    return got


def test_the_fast_path_is_on_for_the_aio_pika_we_install() -> None:
    # If a new aio-pika changes the slots, the worker falls back to aio-pika's constructor:
    # correct, but the speed this module exists for is gone. This says so.
    assert incoming.FAST, f"aio_pika {aio_pika.__version__} changed IncomingMessage's slots"


@pytest.mark.parametrize("properties", [*PROPERTY_SETS, "bare"])
async def test_incoming_equals_aio_pikas_message_in_every_slot(
    amqp: AbstractChannel, qname: str, properties: str
) -> None:
    await amqp.declare_queue(qname, auto_delete=True)
    try:
        if properties == "bare":  # not a single property flag set: only aiormq sends that
            underlay = await amqp.get_underlay_channel()
            await underlay.basic_publish(b"", routing_key=qname, properties=Basic.Properties())
        else:
            await amqp.default_exchange.publish(
                aio_pika.Message(b'{"n": 1}', **PROPERTY_SETS[properties]), routing_key=qname
            )
        (delivered,) = await _deliveries(amqp, qname, 1)
        ours, theirs = incoming.Incoming(delivered), IncomingMessage(delivered)
        assert _state(ours) == _state(theirs)
        assert isinstance(ours, IncomingMessage)
        assert ours.info() == theirs.info()
        assert ours.locked is False and ours.processed is False
        await ours.ack()
        assert ours.processed and ours.locked
    finally:
        await amqp.queue_delete(qname)


async def test_consume_delivers_incoming_messages_that_settle_and_is_cancelled_by_aio_pika(
    amqp: AbstractChannel, qname: str
) -> None:
    queue = await amqp.declare_queue(qname, auto_delete=False)
    try:
        await amqp.set_qos(prefetch_count=10)
        for n in range(4):
            await amqp.default_exchange.publish(
                aio_pika.Message(str(n).encode(), message_id=f"m{n}"), routing_key=qname
            )
        got: list[AbstractIncomingMessage] = []
        in_task: list[bool] = []

        async def on_message(message: AbstractIncomingMessage) -> None:
            in_task.append(asyncio.current_task() is not None)
            got.append(message)
            if message.message_id in ("m0", "m1"):
                await message.ack()
            elif message.message_id == "m2":
                await message.reject(requeue=False)  # dropped: no dead-letter target

        tag = await incoming.consume(queue, on_message, consumer_tag=f"{qname}-tag")
        assert tag == f"{qname}-tag"
        await wait_until(lambda: len(got) == 4, what="4 deliveries")
        assert [m.message_id for m in got] == ["m0", "m1", "m2", "m3"]
        assert all(type(m) is incoming.Incoming for m in got) and all(in_task)
        assert [m.processed for m in got] == [True, True, True, False]
        await queue.cancel(tag)
        # m3 was neither acked nor rejected: cancelling the consumer does not return it, but
        # closing the channel does; nothing else is left.
        await got[3].nack(requeue=True)
        await wait_until(lambda: queue_depth(amqp, qname), what="m3 back in the queue")
        assert await queue_depth(amqp, qname) == 1
    finally:
        await amqp.queue_delete(qname)

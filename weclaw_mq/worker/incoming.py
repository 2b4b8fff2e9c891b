"""The worker's consumers, subscribed through aiormq directly: what aio-pika's
``Queue.consume`` does per delivery, for less.

For every delivery aiormq runs the consumer callback in a task of its own. aio-pika's callback
then builds an ``IncomingMessage`` through ``Message``'s checked ``__setattr__`` (28
Python-level calls, each asking ``locked``) and runs the user's callback in one more task.
Here the message is the same class (a subclass of aio-pika's ``IncomingMessage``: ack, nack,
reject, ``processed`` and every attribute behave as aio-pika's) filled in directly, and the
callback runs in aiormq's task, which costs a delivery one task (and its two callbacks) less.
Our callbacks only start our own task for the work (``Worker._dispatcher``,
``LaneScheduler``), so nothing waits longer for it. One consequence: a callback can now run
before the ``consume`` call that subscribed it has returned (its consume-ok and first
delivery read in one go), which ``LaneScheduler`` counts for (its ``_opening_tags``).

Measured (guard off, concurrency 100, in-process, 8 alternating rounds of 6,000 deliveries):
CPU per delivery about 0.82x of the same worker on ``Queue.consume`` (0.73-1.01); the message
alone, with aio-pika's extra task kept, about 0.94x (0.90-1.10).

The filling mirrors ``aio_pika.message.IncomingMessage.__init__`` attribute by attribute;
``tests/integration/test_incoming.py`` compares every slot of both for real deliveries. If
an aio-pika release renames the slots this relies on, ``FAST`` is False and aio-pika's own
constructor is used (same behaviour, its cost).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from aio_pika import DeliveryMode
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
from aio_pika.message import (
    IncomingMessage,
    Message,
    decode_expiration,
    decode_timestamp,
    encode_timestamp,
)
from aiormq.abc import DeliveredMessage

# The private slots IncomingMessage.__init__ fills (name-mangled by Python).
_LOCK = "_Message__lock"
_CHANNEL = "_IncomingMessage__channel"
_NO_ACK = "_IncomingMessage__no_ack"
_PROCESSED = "_IncomingMessage__processed"


def _slots(cls: type) -> set[str]:
    return set(cls.__dict__.get("__slots__", ()))


# Every slot of each class, as declared (Python names "__lock" _Message__lock, and so on);
# "_headers" and "_loop" are declared but left unset by aio-pika's constructor, and by ours.
_MESSAGE_SLOTS = {
    "__lock", "_headers", "app_id", "body", "body_size", "content_encoding", "content_type",
    "correlation_id", "delivery_mode", "expiration", "headers", "message_id", "priority",
    "reply_to", "timestamp", "type", "user_id",
}  # fmt: skip
_INCOMING_SLOTS = {
    "__channel", "__no_ack", "__processed", "_loop", "cluster_id", "consumer_tag",
    "delivery_tag", "exchange", "message_count", "redelivered", "routing_key",
}  # fmt: skip
# Our filling is exact only for the slots it knows: any added, removed, renamed or moved slot
# in a later aio-pika turns it off (aio-pika's constructor is used then).
FAST = _slots(Message) == _MESSAGE_SLOTS and _slots(IncomingMessage) == _INCOMING_SLOTS

_set = object.__setattr__  # Message.__setattr__ only refuses a locked message: this one is new
_MODES = {None: DeliveryMode.NOT_PERSISTENT, 0: DeliveryMode.NOT_PERSISTENT}
_MODES.update({int(mode): mode for mode in DeliveryMode})


class Incoming(IncomingMessage):
    """An ``IncomingMessage`` built without per-attribute checks (see the module doc)."""

    __slots__ = ()

    def __init__(self, message: DeliveredMessage, no_ack: bool = False) -> None:
        # Not calling super().__init__ is the point; what it would set is set here.
        props = message.header.properties
        body = message.body
        mode = props.delivery_mode
        delivery_tag = message.delivery_tag
        timestamp: Any = props.timestamp
        if timestamp is not None and type(timestamp) is not datetime:
            timestamp = encode_timestamp(decode_timestamp(timestamp))  # raises as aio-pika's
        expiration = props.expiration
        priority = props.priority
        correlation_id = props.correlation_id
        reply_to = props.reply_to
        message_id = props.message_id
        kind = props.message_type
        user_id = props.user_id
        app_id = props.app_id
        s = _set
        s(self, _CHANNEL, message.channel)
        s(self, _NO_ACK, no_ack)
        s(self, _PROCESSED, False)
        s(self, _LOCK, False)
        s(self, "body", body)
        s(self, "body_size", len(body) if body else 0)
        s(self, "headers", props.headers or {})
        s(self, "content_type", props.content_type)
        s(self, "content_encoding", props.content_encoding)
        s(self, "delivery_mode", _MODES[mode] if mode in _MODES else DeliveryMode(int(mode or 0)))
        s(self, "priority", int(priority) if priority else 0)
        s(self, "correlation_id", str(correlation_id) if correlation_id else None)
        s(self, "reply_to", str(reply_to) if reply_to else None)
        s(self, "expiration", None if expiration is None else decode_expiration(expiration))
        s(self, "message_id", str(message_id) if message_id else None)
        s(self, "timestamp", timestamp)
        s(self, "type", str(kind) if kind else None)
        s(self, "user_id", str(user_id) if user_id else None)
        s(self, "app_id", str(app_id) if app_id else None)
        s(self, "cluster_id", props.cluster_id)
        s(self, "consumer_tag", message.consumer_tag)
        s(self, "delivery_tag", delivery_tag)
        s(self, "exchange", message.exchange)
        s(self, "message_count", message.message_count)
        s(self, "redelivered", message.redelivered)
        s(self, "routing_key", message.routing_key)
        if no_ack or not delivery_tag:
            self.lock()
            s(self, _PROCESSED, True)


_build: Callable[[DeliveredMessage], IncomingMessage] = Incoming if FAST else IncomingMessage


async def consume(
    queue: AbstractQueue,
    callback: Callable[[AbstractIncomingMessage], Awaitable[None]],
    *,
    consumer_tag: str | None = None,
) -> str:
    """``queue.consume(callback, consumer_tag=...)`` (manual acks), with ``callback`` run in
    aiormq's task for the delivery. ``queue.cancel(tag)`` cancels it as usual."""

    async def deliver(message: DeliveredMessage) -> None:
        await callback(_build(message))

    channel = await queue.channel.get_underlay_channel()
    ok = await channel.basic_consume(
        queue=queue.name, consumer_callback=deliver, consumer_tag=consumer_tag
    )
    if ok.consumer_tag is None:  # as aio-pika: pamqp types it Optional
        raise RuntimeError("Consumer tag is None")
    return ok.consumer_tag

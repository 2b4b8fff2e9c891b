"""The broker side of the test broker: queues in memory that keep RabbitMQ's rules for the
arguments weclaw_mq declares (``weclaw_mq.wire.topology``), and nothing else.

What is modelled, because the worker's behaviour depends on it:

- the default exchange: a message goes to the queue its routing key names; no such queue is
  an unroutable publish (``UnroutableError``, as a mandatory publish is returned);
- ``x-message-ttl`` (the delay queues) and the ``expiration`` property (a task's lifetime):
  a message past its time at the head of its queue is dead-lettered with reason
  ``expired``, and RabbitMQ's rule that a dead-lettered message loses its ``expiration``;
- a fanout exchange bound to one queue (a delay queue's, ``topology.delay_exchanges``): a
  message published there goes to that queue whatever its routing key, and keeps the key;
- the shared ladder's return exchange (``topology``): a delay queue dead-letters by the
  message's routing key, and a message whose queue is gone goes to the parking queue;
- ``x-dead-letter-routing-key``: expired, rejected (``nack(requeue=False)``) and over-limit
  messages move there (without it, to the queue the message's own routing key names, as
  RabbitMQ dead-letters to the default exchange by the key it was published with) with an
  ``x-death`` entry (most recent first, counted per queue and
  reason) and ``x-first-death-*`` headers, as RabbitMQ writes them;
- quorum queues' ``x-delivery-count`` on a message handed back (``nack(requeue=True)``), and
  ``x-delivery-limit``: returned more often than that, it is dead-lettered
  (``delivery_limit``); a returned message is delivered again first, marked redelivered;
- ``x-max-length`` with ``reject-publish``: a publish to a full queue is refused
  (``PublishNackedError``);
- ``x-max-priority`` (a classic handler queue): the highest ``priority`` property first.

Properties travel as on the wire: a published message's properties are encoded and decoded
by pamqp, so a header value the broker could not carry fails the publish here too, and a
delivery reads back what a real one would (e.g. a tuple header as a list). A delivery is a real
``aio_pika.IncomingMessage`` whose ack, nack and reject settle it here.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import aio_pika
import aiormq.abc
from pamqp import frame
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import RETURN_EXCHANGE, parking_queue_name
from weclaw_mq.errors import MessageEncodingError, PublishNackedError, UnroutableError
from weclaw_mq.testing.clock import VirtualClock

EXPIRED = "expired"
REJECTED = "rejected"
DELIVERY_LIMIT = "delivery_limit"


@dataclass
class Stored:
    """A message as the broker holds it."""

    body: bytes
    properties: Basic.Properties
    enqueued_ms: int
    redelivered: bool = False
    # What it was published with (or, after a dead-letter, routed by): the default exchange
    # and the queue's name, unless published through a delay queue's exchange.
    routing_key: str = ""
    exchange: str = ""

    @property
    def headers(self) -> dict[str, Any]:
        if self.properties.headers is None:
            self.properties.headers = {}
        return self.properties.headers

    @property
    def task_id(self) -> str:
        return self.properties.message_id or ""


@dataclass
class MemoryQueue:
    name: str
    arguments: dict[str, object]
    messages: collections.deque[Stored] = field(default_factory=collections.deque)

    def _int(self, key: str) -> int | None:
        value = self.arguments.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def ttl_ms(self) -> int | None:
        return self._int("x-message-ttl")

    def dead_letter_to(self, message: Stored) -> str | None:
        """The queue ``message`` is dead-lettered to: the x-dead-letter-routing-key, else
        (dead-lettering to the default exchange) its own routing key; None: no dead-lettering."""
        if "x-dead-letter-exchange" not in self.arguments:
            return None
        target = self.arguments.get("x-dead-letter-routing-key")
        return target if isinstance(target, str) else message.routing_key or self.name

    @property
    def quorum(self) -> bool:
        return self.arguments.get("x-queue-type", "quorum") == "quorum"

    def due_ms(self, message: Stored) -> int | None:
        """When ``message`` expires here: the shorter of the queue's TTL and its own."""
        ttls = [t for t in (self.ttl_ms, _expiration_ms(message.properties)) if t is not None]
        return message.enqueued_ms + min(ttls) if ttls else None

    def head_due_ms(self) -> int | None:
        return self.due_ms(self.messages[0]) if self.messages else None

    def take(self) -> Stored:
        """The next message to deliver: the head, or on ``x-max-priority`` the first of the
        highest priority."""
        if self._int("x-max-priority") is not None:
            best = max(self.messages, key=lambda m: m.properties.priority or 0)
            self.messages.remove(best)
            return best
        return self.messages.popleft()


def _expiration_ms(properties: Basic.Properties) -> int | None:
    try:
        return int(properties.expiration) if properties.expiration is not None else None
    except ValueError:
        return None


def wire_copy(message: aio_pika.Message) -> Basic.Properties:
    """The message's properties as a consumer would read them after a trip over AMQP."""
    try:
        raw = frame.marshal(ContentHeader(0, len(message.body), message.properties), 1)
        _, _, header = frame.unmarshal(raw)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageEncodingError(
            f"the message cannot be encoded in AMQP ({str(e)[:200]}); nothing was sent"
        ) from e
    assert isinstance(header, ContentHeader)
    return header.properties


class MemoryBroker:
    """Every queue of a test broker, on its clock. ``arrived`` is set whenever a message
    becomes ready somewhere (a publish, a dead-letter, a message handed back)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.queues: dict[str, MemoryQueue] = {}
        # Fanout exchange -> the one queue bound to it.
        self.exchanges: dict[str, str] = {}
        self.arrived = asyncio.Event()
        # Every hop into a delay queue (x-message-ttl): (the lane it returns to by its routing
        # key, the queue's TTL in ms), in order.
        self.parked: list[tuple[str, int]] = []
        self._tags = itertools.count(1)
        self._unsettled: dict[int, tuple[MemoryQueue, Stored]] = {}
        self._channel = _SettlingChannel(self)

    # -- the topology ---------------------------------------------------------------------
    def declare(self, name: str, arguments: dict[str, object]) -> None:
        """Declare ``name`` with ``arguments``; an existing queue is kept as it is."""
        self.queues.setdefault(name, MemoryQueue(name, dict(arguments)))

    def declare_fanout(self, exchange: str, queue: str) -> None:
        """A fanout exchange ``exchange`` bound to ``queue``."""
        self.exchanges[exchange] = queue

    # -- publishing -----------------------------------------------------------------------
    def publish(self, routing_key: str, message: aio_pika.Message, *, exchange: str = "") -> None:
        """Store ``message`` in the queue ``routing_key`` names (or, through ``exchange``, in
        the queue bound to it), or raise as the confirmed publish of a mandatory message to
        RabbitMQ would."""
        task_id = message.message_id
        if exchange:
            if exchange not in self.exchanges:
                raise UnroutableError(
                    f"no exchange named {exchange!r} on the test broker (it declares those of "
                    "the apps it was given)",
                    queue=exchange,
                    task_id=task_id,
                )
            queue = self.queues.get(self.exchanges[exchange])
        else:
            queue = self.queues.get(routing_key)
        if queue is None:
            raise UnroutableError(
                f"no queue named {routing_key!r} on the test broker (it declares the queues "
                "of the apps it was given)",
                queue=routing_key,
                task_id=task_id,
            )
        limit = queue._int("x-max-length")
        if limit is not None and len(queue.messages) >= limit:
            raise PublishNackedError(
                f"the broker refused the message for {routing_key!r} (queue full: "
                f"x-max-length {limit}); nothing was stored, publish again later",
                queue=routing_key,
                task_id=task_id,
            )
        stored = Stored(message.body, wire_copy(message), self.clock.now_ms())
        stored.routing_key, stored.exchange = routing_key, exchange
        self._enqueue(queue, stored)

    def _enqueue(self, queue: MemoryQueue, message: Stored) -> None:
        queue.messages.append(message)
        if queue.ttl_ms is not None:
            self.parked.append((message.routing_key, queue.ttl_ms))
        self.arrived.set()

    # -- time -----------------------------------------------------------------------------
    def expire_due(self) -> None:
        """Dead-letter every message past its time at the head of its queue, as RabbitMQ
        expires messages only there."""
        now = self.clock.now_ms()
        for queue in list(self.queues.values()):
            while (due := queue.head_due_ms()) is not None and due <= now:
                self._dead_letter(queue, queue.messages.popleft(), EXPIRED)

    def next_delay_due_ms(self) -> int | None:
        """When the next message parked in a delay queue comes back (None: none waits)."""
        dues = [
            due
            for q in self.queues.values()
            if q.ttl_ms is not None and (due := q.head_due_ms()) is not None
        ]
        return min(dues) if dues else None

    # -- consuming ------------------------------------------------------------------------
    def deliver(self, name: str) -> aio_pika.IncomingMessage | None:
        """The next ready message of ``name`` as a consumer receives it, or None."""
        self.expire_due()
        queue = self.queues[name]
        if not queue.messages:
            return None
        stored = queue.take()
        tag = next(self._tags)
        self._unsettled[tag] = (queue, stored)
        delivered = aiormq.abc.DeliveredMessage(
            delivery=Basic.Deliver(
                consumer_tag="weclaw-test-broker",
                delivery_tag=tag,
                redelivered=stored.redelivered,
                exchange=stored.exchange,
                routing_key=stored.routing_key or name,
            ),
            header=ContentHeader(0, len(stored.body), stored.properties),
            body=stored.body,
            channel=cast(aiormq.abc.AbstractChannel, self._channel),
        )
        return aio_pika.IncomingMessage(delivered)

    def settle(self, tag: int, *, requeue: bool | None) -> None:
        """ack (None), hand back (True) or reject (False) the delivery ``tag``."""
        queue, stored = self._unsettled.pop(tag)
        if requeue is None:
            return
        if not requeue:
            self._dead_letter(queue, stored, REJECTED)
            return
        if queue.quorum:
            count = stored.headers.get(h.X_DELIVERY_COUNT, 0) + 1
            stored.headers[h.X_DELIVERY_COUNT] = count
            limit = queue._int("x-delivery-limit")
            if limit is not None and limit >= 0 and count > limit:
                self._dead_letter(queue, stored, DELIVERY_LIMIT)
                return
        stored.redelivered = True
        queue.messages.appendleft(stored)
        self.arrived.set()

    @property
    def unsettled(self) -> int:
        return len(self._unsettled)

    def _dead_letter(self, queue: MemoryQueue, stored: Stored, reason: str) -> None:
        routed_by = queue.dead_letter_to(stored)
        target = self.queues.get(routed_by or "")
        if target is None and queue.arguments.get("x-dead-letter-exchange") == RETURN_EXCHANGE:
            # The return exchange's alternate exchange: the parking queue (topology).
            target = self.queues.get(parking_queue_name())
        if target is None:
            # Dropped here. RabbitMQ drops it too without dead-lettering; with at-least-once
            # dead-lettering to a queue that is gone, it holds it in the source for good.
            return
        headers = stored.headers
        headers.pop(h.X_DELIVERY_COUNT, None)  # counted per stint in a queue
        deaths = [d for d in headers.get(h.X_DEATH, []) if isinstance(d, dict)]
        same = next(
            (d for d in deaths if (d.get("queue"), d.get("reason")) == (queue.name, reason)), None
        )
        if same is not None:
            deaths.remove(same)
            count = same.get("count", 0) + 1
        else:
            count = 1
        death: dict[str, Any] = {
            "count": count,
            "reason": reason,
            "queue": queue.name,
            "time": datetime.fromtimestamp(self.clock.now_ms() // 1000, UTC),
            "exchange": stored.exchange,
            "routing-keys": [stored.routing_key or queue.name],
        }
        if stored.properties.expiration is not None:
            death["original-expiration"] = stored.properties.expiration
        headers[h.X_DEATH] = [death, *deaths]
        headers.setdefault(h.X_FIRST_DEATH_REASON, reason)
        headers.setdefault(h.X_FIRST_DEATH_QUEUE, queue.name)
        headers.setdefault("x-first-death-exchange", stored.exchange)
        stored.properties.expiration = None  # RabbitMQ's rule: a dead letter never expires again
        moved = Stored(stored.body, stored.properties, self.clock.now_ms())
        moved.routing_key = routed_by or target.name
        self._enqueue(target, moved)


class _SettlingChannel:
    """The channel an ``IncomingMessage`` of the test broker settles through: the three
    calls aio-pika makes for ack, nack and reject."""

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self.is_closed = False
        # aio-pika's nack asks ``channel.connection.basic_nack`` whether the server has it.
        self.connection = self

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, **_: object) -> None:
        self._broker.settle(delivery_tag, requeue=None)

    async def basic_nack(
        self, delivery_tag: int, multiple: bool = False, requeue: bool = True, **_: object
    ) -> None:
        self._broker.settle(delivery_tag, requeue=requeue)

    async def basic_reject(self, delivery_tag: int, *, requeue: bool = True, **_: object) -> None:
        self._broker.settle(delivery_tag, requeue=requeue)

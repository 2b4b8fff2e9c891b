"""The broker side of every DLQ command: one connection per command, and the *pass* over
``Q.dlq`` that takes each message once and keeps it (a confirmed copy at the tail, then the
original acked) or hands it to the caller to move or remove.

A pass is how looking leaves the DLQ unchanged (see ``Pass``), and how a requeue or a purge
with a filter acts on the selected messages and leaves the others in their order.
``dlq`` (looks, export, import) and ``dlq_action`` (requeue, purge) drive it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from weclaw_mq.admin.dlq_message import DeadLetter, kept_properties, read_dead_letter
from weclaw_mq.app import App
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.contract.undecodable import tolerant_properties
from weclaw_mq.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    ConnectionLostError,
    PublishNackedError,
    UnroutableError,
)

UNREADABLE_REASON = "unreadable"

# (messages visited, messages in the DLQ when the pass started): for a progress bar.
Progress = Callable[[int, int], None]


UNREADABLE_REASON = "unreadable"


def read(message: DeliveredMessage) -> DeadLetter:
    """What the message says; a message our reader trips over is shown as unreadable (with
    its raw headers and body) instead of stopping the look at the whole DLQ."""
    props = message.header.properties
    try:
        return read_dead_letter(props.message_id, props.headers or {}, message.body)
    except Exception as e:  # another producer's message: anything may be in it
        headers = props.headers if isinstance(props.headers, dict) else {}
        return DeadLetter(
            task_id=props.message_id if isinstance(props.message_id, str) else "",
            reason=UNREADABLE_REASON,
            error_type=type(e).__name__,
            error_message=str(e),
            attempts=None,
            original_queue=None,
            first_failure_at=None,
            last_failure_at=None,
            trace_id=None,
            body=message.body,
            headers=dict(headers),
        )


@contextlib.asynccontextmanager
async def connected(app: App, purpose: str) -> AsyncIterator[AbstractConnection]:
    """One connection per ops command; a lost broker raised as BrokerUnavailableError."""
    conn = await app.broker.connect(name=f"{app.name}-dlq-{purpose}")
    try:
        yield conn
    except aiormq.exceptions.InvalidFrameError as e:
        raise BrokerUnavailableError(
            f"dlq {purpose} stopped: the client cannot decode a frame from the broker ({e}); "
            "messages not yet moved stay where they were"
        ) from e
    except (aiormq.exceptions.AMQPError, ConnectionError) as e:
        raise BrokerUnavailableError(
            f"lost the broker during dlq {purpose}: {type(e).__name__}: {e}; messages not yet "
            "moved stay where they were"
        ) from e
    finally:
        with contextlib.suppress(Exception):
            await conn.close()


async def ready_count(conn: AbstractConnection, name: str) -> tuple[int, int] | None:
    """(ready messages, consumers) of ``name``, or None when no such queue exists."""
    # A passive declare of a missing queue closes its channel (404): one channel per look.
    channel = await conn.channel()
    try:
        declared = await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    finally:
        if not channel.is_closed:
            await channel.close()
    result = declared.declaration_result
    return result.message_count or 0, result.consumer_count or 0


async def dlq_depth(conn: AbstractConnection, queue: str) -> int:
    counts = await ready_count(conn, dlq_name(queue))
    if counts is None:
        raise ConfigurationError(
            f"no queue named {dlq_name(queue)!r}: check the handler queue name {queue!r} "
            "(the DLQ is declared with it by 'weclaw-mq declare' or a worker)"
        )
    return counts[0]


@dataclass
class Pass:
    """One pass over ``Q.dlq``: each message present when it started is taken once and then
    either kept (an exact copy published to the tail with a confirm, then the original acked)
    or moved elsewhere by the caller.

    AMQP 0-9-1 has no "browse". Taking a message and handing it back (basic.get without ack,
    then closing the channel) marks it redelivered and raises its x-delivery-count; on
    RabbitMQ 4.0+ a quorum DLQ has a default delivery limit of 20 and nowhere to dead-letter
    to, so the 20th look would drop every dead letter. A rotation hands nothing back, on
    every version: body, properties and headers stay as they were (x-delivery-count, the
    broker's count of returns in this queue, is left off the copy, which was never
    returned), and a whole pass ends with the messages in their old order. A crash between a
    copy's confirm and the original's ack leaves both: a duplicate, never a loss.

    We use aiormq's channel under aio-pika's: its message carries the properties exactly as
    decoded, which we publish back untouched, so no conversion of ours can alter them.
    """

    channel: aiormq.abc.AbstractChannel
    dlq: str
    budget: int  # messages in the DLQ at the start: arrivals and our copies are not taken
    confirm_timeout_s: float

    async def next(self) -> DeliveredMessage | None:
        if self.budget <= 0:
            return None
        self.budget -= 1
        got = await self.channel.basic_get(self.dlq, no_ack=False)
        if not isinstance(got.delivery, Basic.GetOk):
            self.budget = 0  # empty (another reader took the rest)
            return None
        return got

    async def keep(self, message: DeliveredMessage) -> None:
        await self.publish(self.dlq, message.body, kept_properties(message.header.properties))
        await self.ack(message)

    async def ack(self, message: DeliveredMessage) -> None:
        tag = message.delivery.delivery_tag if isinstance(message.delivery, Basic.GetOk) else None
        if tag is None:  # pragma: no cover - every message of a pass came from a get-ok
            raise ConfigurationError("internal: a DLQ message without a delivery tag")
        await self.channel.basic_ack(tag)

    async def publish(self, queue: str, body: bytes, properties: Basic.Properties) -> None:
        """Publish with a confirm; a typed error when the broker did not take it."""
        task_id = properties.message_id or ""
        try:
            confirm = await self.channel.basic_publish(
                body,
                exchange="",
                routing_key=queue,
                properties=properties,
                mandatory=True,
                timeout=self.confirm_timeout_s,
            )
        except aiormq.exceptions.PublishError as e:
            raise UnroutableError(
                f"{queue!r} refused the copy of {task_id}: no such queue ({e})",
                queue=queue,
                task_id=task_id,
            ) from e
        except TimeoutError as e:
            raise ConfirmTimeoutError(
                f"no confirm for the copy of {task_id} in {self.confirm_timeout_s} s; its "
                "original stays in the DLQ",
                queue=queue,
                task_id=task_id,
            ) from e
        except aiormq.exceptions.DeliveryError as e:
            raise PublishNackedError(
                f"{queue!r} refused the copy of {task_id}; its original stays in the DLQ",
                queue=queue,
                task_id=task_id,
            ) from e
        except (aiormq.exceptions.AMQPError, ConnectionError) as e:
            raise ConnectionLostError(
                f"the link died before the copy of {task_id} was confirmed: {e}",
                queue=queue,
                task_id=task_id,
            ) from e
        if not isinstance(confirm, Basic.Ack):
            raise PublishNackedError(
                f"{queue!r} refused the copy of {task_id}; its original stays in the DLQ",
                queue=queue,
                task_id=task_id,
            )

    async def keep_the_rest(self) -> None:
        """Finish the pass, so the messages keep their order."""
        while (message := await self.next()) is not None:
            await self.keep(message)


@contextlib.asynccontextmanager
async def pass_over(app: App, queue: str, purpose: str) -> AsyncIterator[Pass]:
    # Held from before the connection opens until after it closed: its reader decodes.
    with tolerant_properties():
        async with _pass_on_connection(app, queue, purpose) as dlq:
            yield dlq


@contextlib.asynccontextmanager
async def _pass_on_connection(app: App, queue: str, purpose: str) -> AsyncIterator[Pass]:
    async with connected(app, purpose) as conn:
        depth = await dlq_depth(conn, queue)
        channel: AbstractChannel = await conn.channel(publisher_confirms=True)
        try:
            yield Pass(
                await channel.get_underlay_channel(),
                dlq_name(queue),
                depth,
                app.settings.confirm_timeout_s,
            )
        finally:
            # Anything taken and not yet settled (an error stopped us) goes back to the DLQ.
            with contextlib.suppress(Exception):
                if not channel.is_closed:
                    await channel.close()


def trimmed(dead: DeadLetter, body_max: int | None) -> DeadLetter:
    """``dead`` with its body cut to ``body_max`` bytes (``body_size`` says how long it was)."""
    if body_max is None or len(dead.body) <= body_max:
        return dead
    return replace(dead, body=dead.body[:body_max], body_size=len(dead.body))

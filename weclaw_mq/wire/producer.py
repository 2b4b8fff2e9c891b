"""Confirmed publishing: ``publish`` returns only once the broker acked the message.

Each failure ends in its own ``PublishFailedError`` subclass (see ``errors``). A channel the
broker closed, or a connection that died, is dropped and opened anew on the next publish,
never left broken.
"""

from __future__ import annotations

import asyncio
import logging

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.message import Message

from weclaw_mq.errors import (
    BrokerUnavailableError,
    ConfirmTimeoutError,
    ConnectionLostError,
    MessageEncodingError,
    PublishNackedError,
    UnroutableError,
)
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.wire.connection import (
    CLOSE_TIMEOUT_S,
    LINK_ERRORS,
    BrokerEndpoints,
    backoff_s,
    cancelled_by_caller,
    is_alive,
    server_version,
)

log = logging.getLogger("weclaw_mq.publishing.producer")

NACK_STREAK_RESET = 3


class _Outage:
    """RabbitMQ did not answer our last connect: when the next may be tried, and counts."""

    __slots__ = ("error", "failures", "refused", "retry_at", "started_at")

    def __init__(self, now: float) -> None:
        self.started_at = now
        self.failures = 0  # connect attempts that failed
        self.refused = 0  # publishes failed at once, without an attempt of their own
        self.retry_at = now
        self.error = ""


class Publisher:
    """Publishes with confirms over one channel.

    With ``connection`` given it borrows that connection (the worker's publishing one, never
    the one it consumes on: RabbitMQ blocks a publishing connection under an alarm, its acks
    with it) and never reconnects; without, it owns a connection that it opens on first use
    and again after a loss.
    """

    def __init__(
        self,
        broker: BrokerEndpoints,
        metrics: Metrics,
        *,
        name: str,
        connection: AbstractConnection | None = None,
    ) -> None:
        self._broker = broker
        self._settings = broker.settings
        self._metrics = metrics
        self._name = name
        self._owns_connection = connection is None
        self._connection = connection
        self._channel: AbstractChannel | None = None
        self._opening: asyncio.Future[AbstractChannel] | None = None
        self._nack_streak = 0
        self._retired: set[AbstractChannel] = set()  # dropped after nacks, closed later
        self._closing: set[asyncio.Future[None]] = set()
        self._outage: _Outage | None = None  # the broker unreachable at our last connect

    async def connect(self) -> None:
        """Open the channel now, within ``confirm_timeout_s`` (``BrokerUnavailableError`` if
        no broker answers or the link dies while opening: nothing was sent)."""
        timeout_s = self._settings.confirm_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await self._ready_channel()
        except BrokerUnavailableError:
            raise
        except (TimeoutError, *LINK_ERRORS) as e:
            raise BrokerUnavailableError(
                f"no channel to RabbitMQ within {timeout_s} s ({type(e).__name__}); "
                "nothing was sent"
            ) from e

    async def server_version(self) -> ServerVersion | None:
        """The version the broker announced (connecting first, like ``connect``): where a
        priority goes depends on it (``priority.plan_priorities``)."""
        await self.connect()
        return server_version(self._connection) if self._connection is not None else None

    async def _ready_channel(self) -> AbstractChannel:
        channel = self._channel
        if channel is not None and not channel.is_closed:
            return channel
        # Concurrent publishes share one attempt: during an outage they fail together,
        # not one connect timeout after another.
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._open_channel())
            self._opening.add_done_callback(_retrieve)
        # Shielded: one caller's deadline must not cancel the attempt the others wait on.
        return await asyncio.shield(self._opening)

    def unavailable(self) -> BrokerUnavailableError | None:
        """While the broker stays unreachable: the error for a publish that comes before the
        next connect attempt is due (counted; nothing is tried), else None. Publishes during
        an outage share one attempt per backoff step instead of one connect each."""
        outage = self._outage
        if outage is None or asyncio.get_running_loop().time() >= outage.retry_at:
            return None
        outage.refused += 1
        if outage.refused == 1:  # not at the failed connect: a lone publish says it itself
            log.warning(
                "%s; publishes fail at once meanwhile (to the outbox, if one is set), one "
                "connect attempt at a time, backing off up to %g s",
                outage.error,
                self._settings.reconnect_max_delay_s,
            )
        return BrokerUnavailableError(
            f"{outage.error} (the broker has not answered for "
            f"{asyncio.get_running_loop().time() - outage.started_at:.1f} s; next attempt in "
            f"{outage.retry_at - asyncio.get_running_loop().time():.1f} s); nothing was sent"
        )

    def broker_reached(self) -> None:
        """Another connection of ours (the outbox relay's) reached the broker: the next
        publish tries at once rather than waiting out this outage's backoff step."""
        if self._outage is not None:
            self._outage.retry_at = asyncio.get_running_loop().time()

    async def _connect(self) -> AbstractConnection:
        """Our connection, one attempt per backoff step while the broker is unreachable: an
        outage that fails later publishes is logged once then, and once when it ends."""
        refused = self.unavailable()
        if refused is not None:
            raise refused
        loop = asyncio.get_running_loop()
        try:
            conn = await self._broker.connect(name=self._name)
        except BrokerUnavailableError as e:
            outage = self._outage
            if outage is None:
                outage = self._outage = _Outage(loop.time())
            outage.failures += 1
            outage.error = str(e)
            delay_s = backoff_s(outage.failures, self._settings.reconnect_max_delay_s)
            outage.retry_at = loop.time() + delay_s
            raise
        outage, self._outage = self._outage, None
        if outage is not None and outage.refused:
            log.info(
                "RabbitMQ answers again after %.1f s: %d connect attempt(s) failed, %d "
                "publish(es) failed at once meanwhile",
                loop.time() - outage.started_at,
                outage.failures,
                outage.refused,
            )
        return conn

    async def _open_channel(self) -> AbstractChannel:
        conn = self._connection
        if conn is None or not is_alive(conn):
            if not self._owns_connection:
                raise aiormq.exceptions.ChannelInvalidStateError("worker connection closed")
            if conn is not None:
                self._connection = None
                await _close_quietly(conn)
            conn = self._connection = await self._connect()
        try:
            # on_return_raises: an unroutable mandatory publish must raise, not vanish.
            channel = await conn.channel(publisher_confirms=True, on_return_raises=True)
        except RuntimeError as e:  # aio-pika's word for "this connection is closed"
            raise aiormq.exceptions.ChannelInvalidStateError(str(e)) from e
        self._channel = channel
        return channel

    async def publish(self, queue: str, message: Message, *, exchange: str = "") -> None:
        """Publish to ``queue`` through the default exchange and wait for the broker's ack.

        With ``exchange`` (a delay queue's fanout exchange, ``topology.delay_exchanges``),
        publish there with routing key ``queue``: the lane the task returns to. Outcomes are
        then counted, and errors named, by the exchange (the delay queue of that name)."""
        task_id = message.message_id or ""
        routing_key, queue = queue, exchange or queue
        timeout_s = self._settings.confirm_timeout_s
        sent = False
        try:
            # One deadline for the whole call, reconnect included: aio-pika alone waits
            # forever on a blocked connection. asyncio.timeout, unlike wait_for, costs no
            # extra task per publish.
            async with asyncio.timeout(timeout_s):
                channel = await self._ready_channel()
                sent = True
                target = (
                    channel.default_exchange
                    if not exchange
                    else await channel.get_exchange(exchange, ensure=False)
                )
                await target.publish(message, routing_key=routing_key, mandatory=True)
        except aiormq.exceptions.PublishError as e:
            raise self._unroutable(queue, task_id, "queue") from e
        except aiormq.exceptions.DeliveryError as e:
            raise self._nacked(queue, task_id) from e
        except BrokerUnavailableError as e:
            # A refused connection fails fast, before our deadline: count it like a slow one.
            self._count(queue, "unavailable")
            if e.task_id is not None:
                raise
            # Raised by the connect, which knows no task: say which publish it failed.
            raise BrokerUnavailableError(str(e), queue=queue, task_id=task_id) from e
        except TimeoutError as e:
            raise self._timed_out(queue, task_id, timeout_s, sent=sent) from e
        except aiormq.exceptions.ChannelNotFoundEntity as e:
            # Only a publish to a named exchange can meet this (the default one always
            # exists): the broker closed the channel before routing anything.
            self._channel = None
            raise self._unroutable(queue, task_id, "exchange") from e
        except asyncio.CancelledError as e:
            if cancelled_by_caller():
                raise
            raise self._lost(queue, task_id, "aiormq cancelled the call") from e
        except LINK_ERRORS as e:
            raise self._lost(queue, task_id, type(e).__name__) from e
        except (TypeError, ValueError) as e:
            # aiormq encodes the frames before writing any (App.prepare checks them first;
            # this keeps a message built elsewhere inside our error tree): nothing was sent.
            raise _unencodable(queue, e) from e
        self._nack_streak = 0
        self._count(queue, "confirmed")

    # A failed publish's errors, counted: out of line, off the path of a confirmed publish.
    def _unroutable(self, queue: str, task_id: str, kind: str) -> UnroutableError:
        self._count(queue, "unroutable")
        return UnroutableError(
            f"no {kind} named {queue!r}: run 'weclaw-mq declare' or start a worker first",
            queue=queue,
            task_id=task_id,
        )

    def _nacked(self, queue: str, task_id: str) -> PublishNackedError:
        self._count(queue, "nacked")
        self._note_nack()
        return PublishNackedError(
            f"the broker refused the message for {queue!r} (queue full or broker "
            "failure); nothing was stored, publish again later",
            queue=queue,
            task_id=task_id,
        )

    def _timed_out(
        self, queue: str, task_id: str, timeout_s: float, *, sent: bool
    ) -> BrokerUnavailableError | ConfirmTimeoutError:
        if not sent:
            self._count(queue, "unavailable")
            return BrokerUnavailableError(
                f"no connection to RabbitMQ within {timeout_s} s; nothing was sent",
                queue=queue,
                task_id=task_id,
            )
        self._count(queue, "timeout")
        return ConfirmTimeoutError(
            f"no confirm for {queue!r} within {timeout_s} s; the message may or may not "
            "be stored: republish with the same task_id",
            queue=queue,
            task_id=task_id,
        )

    def _lost(self, queue: str, task_id: str, cause: str) -> ConnectionLostError:
        self._count(queue, "connection_lost")
        self._channel = None
        return ConnectionLostError(
            f"connection lost while publishing to {queue!r} ({cause}); the message may or may "
            "not be stored: republish with the same task_id",
            queue=queue,
            task_id=task_id,
        )

    def _note_nack(self) -> None:
        # After a quorum leader dies, a channel opened before the new leader was elected can
        # nack EVERY later publish (seen in 5 of 8 runs on 3.10.8) while a fresh channel works
        # at once. A run of nacks therefore costs us the channel, never the caller's retries.
        self._nack_streak += 1
        if self._nack_streak < NACK_STREAK_RESET:
            return
        self._nack_streak = 0
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            # Publishes still waiting on it keep their own outcome: close it only once every
            # pending confirm has arrived or timed out.
            self._retired.add(channel)
            asyncio.get_running_loop().call_later(
                self._settings.confirm_timeout_s + 1, self._close_retired, channel
            )

    def _close_retired(self, channel: AbstractChannel) -> None:
        self._retired.discard(channel)
        if not channel.is_closed:
            task = asyncio.ensure_future(_close_quietly(channel))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _count(self, queue: str, outcome: str) -> None:
        self._metrics.publish_outcome(queue, outcome).inc()

    async def close(self) -> None:
        """Close what we opened, each step bounded and never raising: a broker under a
        memory alarm would otherwise hold ``App.close()`` until the alarm clears."""
        channel, self._channel = self._channel, None
        conn = self._connection if self._owns_connection else None
        self._connection = None if self._owns_connection else self._connection
        if conn is not None:
            # Closing our connection closes its channels: one bounded wait, not two.
            if not conn.is_closed:
                await _close_quietly(conn)
        elif channel is not None and not channel.is_closed:
            await _close_quietly(channel)  # on a borrowed connection: only what is ours


def _unencodable(queue: str, e: TypeError | ValueError) -> MessageEncodingError:
    return MessageEncodingError(
        # pamqp's message holds the value's repr, which can be as long as the value.
        f"the message for {queue!r} cannot be encoded in AMQP ({str(e)[:200]}); nothing was sent"
    )


async def _close_quietly(link: AbstractChannel | AbstractConnection) -> None:
    try:
        await asyncio.wait_for(link.close(), CLOSE_TIMEOUT_S)
    except Exception as e:  # closing a failing link may fail too; it is dropped either way
        log.debug("closing a channel or connection failed: %s: %s", type(e).__name__, e)


def _retrieve(future: asyncio.Future[AbstractChannel]) -> None:
    # Every waiter may have given up (deadline) before the shared attempt failed.
    if not future.cancelled():
        future.exception()

"""Opening broker connections: the one place that turns URLs into a live connection.

We use plain (non-robust) aio-pika connections and own the reconnect loop ourselves (in the
worker and the producer): a robust connection silently restores channels whose delivery tags
are stale, can restore a channel that nacks every later publish after a leader election
(seen on 3.10.8), and never fails over to another node. A fresh connection with fresh
channels after every loss is simpler to reason about.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl

import aio_pika
import aiormq
import yarl
from aio_pika.abc import AbstractChannel, AbstractConnection

from weclaw_mq.config.tls import client_context, describe_refusal
from weclaw_mq.errors import BrokerUnavailableError
from weclaw_mq.policy.broker_version import ServerVersion, parse_server_version
from weclaw_mq.settings import Settings, redact_url

log = logging.getLogger("weclaw_mq.connection")

CONNECT_TIMEOUT_S = 10.0
# Closing a channel or connection waits for the broker's close-ok; a blocked broker (memory
# alarm) reads nothing until the alarm clears. Nothing we close waits longer than this.
CLOSE_TIMEOUT_S = 5.0

# What a dying connection or channel raises (OSError covers socket errors and timeouts).
LINK_ERRORS = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelClosed,
    aiormq.exceptions.ChannelInvalidStateError,
    OSError,
)


class BrokerEndpoints:
    """The cluster's node URLs, tried in turn: the node that last worked first, and after a
    loss the next one, so a dead node is not the first thing every reconnect waits on."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.urls = settings.amqp_urls()
        self._preferred = 0
        self._connected: dict[int, int] = {}  # id(connection) -> index of its URL
        self._ssl_context: ssl.SSLContext | None = None

    def _tls(self, url: str) -> ssl.SSLContext | None:
        """The SSLContext for an amqps:// URL: made once from the TLS settings (tls.py), so
        its files are read, and a verification turned off is warned about, once."""
        if not url.lower().startswith("amqps://"):
            return None
        if self._ssl_context is None:
            self._ssl_context = client_context(self.settings.tls("amqp"))
        return self._ssl_context

    def _order(self) -> list[int]:
        n = len(self.urls)
        return [(self._preferred + k) % n for k in range(n)]

    async def connect(self, *, name: str) -> AbstractConnection:
        """Connect to the first node that answers; ``BrokerUnavailableError`` if none does."""
        problems: list[str] = []
        timeout_s = CONNECT_TIMEOUT_S if len(self.urls) == 1 else CONNECT_TIMEOUT_S / 2
        hb = self.settings.heartbeat_s
        if hb > 0:
            # aiormq starts its heartbeat clock before the handshake: a handshake that ends
            # past (hb+1)*3 s gets its reader cancelled. Give up before that instead.
            timeout_s = min(timeout_s, (hb + 1) * 3 - 1)
        for index in self._order():
            url = self.urls[index]
            try:
                conn = await aio_pika.connect(
                    url,
                    timeout=timeout_s,
                    heartbeat=self.settings.heartbeat_s,
                    client_properties={"connection_name": name},
                    ssl_context=self._tls(url),
                )
            except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as e:
                problems.append(f"{redact_url(url)}: {connect_problem(e, url, timeout_s)}")
                continue
            except asyncio.CancelledError:
                if cancelled_by_caller():
                    raise
                problems.append(f"{redact_url(url)}: the handshake was cut off")
                continue
            self._preferred = index
            self._connected[id(conn)] = index
            conn.close_callbacks.add(self._on_close)
            return conn
        raise BrokerUnavailableError("cannot connect to RabbitMQ at " + "; ".join(problems))

    def _on_close(self, conn: object, exc: BaseException | None = None) -> None:
        index = self._connected.pop(id(conn), None)
        if exc is not None and index is not None and index == self._preferred:
            # Lost, not closed by us: start the next attempt on another node.
            self._preferred = (index + 1) % len(self.urls)

    async def connect_with_retry(
        self, *, name: str, stop: asyncio.Event | None = None
    ) -> AbstractConnection | None:
        """Retry ``connect`` with backoff until it succeeds, or return None once ``stop`` is set."""
        failures = 0
        while True:
            try:
                return await self.connect(name=name)
            except BrokerUnavailableError as e:
                failures += 1
                delay = backoff_s(failures, self.settings.reconnect_max_delay_s)
                log.warning("%s; retrying in %.1f s", e, delay)
                if stop is None:
                    await asyncio.sleep(delay)
                    continue
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                    return None
                except TimeoutError:
                    continue


def connect_problem(e: BaseException, url: str, timeout_s: float) -> str:
    """Why a connect to ``url`` failed and what to check, in one line (never the password)."""
    refused = describe_refusal(e, "amqp")
    if refused is not None:
        return refused
    if isinstance(e, aiormq.exceptions.ProbableAuthenticationError):
        return (
            f"the broker refused the login ({e}); check the user and password in "
            "WECLAW_MQ_AMQP_URL (RabbitMQ lets 'guest' in from localhost only)"
        )
    if isinstance(e, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(e):
        # aiormq keeps only the frame's repr: RabbitMQ closes at Connection.Open for a vhost
        # that does not exist, one the user has no permission on, or one at its limit.
        parsed = yarl.URL(url)
        vhost = parsed.path[1:] or "/"
        return (
            f"the broker refused vhost {vhost!r} to user {parsed.user or 'guest'!r} (it does "
            "not exist, the user has no permissions on it, or it is at its connection limit); "
            f"check the vhost in WECLAW_MQ_AMQP_URL: rabbitmqctl list_vhosts, "
            f"rabbitmqctl list_permissions -p {vhost}"
        )
    if isinstance(e, TimeoutError) and not str(e):
        return (
            f"the TCP connection opened but the AMQP handshake did not finish within "
            f"{timeout_s:g} s (a broker out of file handles or memory, a TLS port reached "
            "without amqps://, or a stalled TLS peer); check rabbitmqctl status and the "
            "broker's log"
        )
    return f"{type(e).__name__}: {e}"


def cancelled_by_caller() -> bool:
    """Is this CancelledError meant for us (our task was cancelled, e.g. a timeout or a stop)?

    aiormq also cancels its own futures when a connection dies (its heartbeat watchdog, a
    closing reader); that CancelledError reaches whoever awaited them but means "connection
    lost", and must not stop a worker or escape a publish as a cancellation.
    """
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def server_version(conn: AbstractConnection) -> ServerVersion | None:
    """The RabbitMQ version ``conn``'s broker announced; None if it did not say."""
    transport = conn.transport
    if transport is None:
        return None
    return parse_server_version((transport.connection.server_properties or {}).get("version"))


async def channel_server_version(channel: AbstractChannel) -> ServerVersion | None:
    """The same, from a channel (what topology declares on)."""
    try:
        underlay = await channel.get_underlay_channel()
    except aiormq.exceptions.ChannelInvalidStateError:
        return None
    properties = underlay.connection.server_properties or {}
    return parse_server_version(properties.get("version"))


def is_alive(conn: AbstractConnection) -> bool:
    # aio-pika marks a connection closed only when WE close it; a connection the broker or
    # the network dropped shows only as a cleared ``connected`` event.
    return not conn.is_closed and conn.connected.is_set()


def when_lost(conn: AbstractConnection) -> asyncio.Future[None]:
    """A future that completes when ``conn`` closes for any reason."""
    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def mark(*_: object) -> None:
        if not lost.done():
            lost.set_result(None)

    conn.close_callbacks.add(mark)
    if not is_alive(conn):
        mark()
    return lost


def backoff_s(failures: int, max_delay_s: float) -> float:
    """0.2 s, 0.4 s, 0.8 s ... capped, with jitter so a fleet does not reconnect in step."""
    base: float = min(0.2 * 2 ** max(failures - 1, 0), max_delay_s)
    return base * random.uniform(0.5, 1.0)

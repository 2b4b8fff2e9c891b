"""Opening broker connections: the one place that turns a URL into a live connection.

We use plain (non-robust) aio-pika connections and own the reconnect loop ourselves (in the
worker and the producer): a robust connection silently restores channels whose delivery tags
are stale and, per our measurements, can restore a channel that nacks every later publish.
A fresh connection with fresh channels after every loss is simpler to reason about.
"""

from __future__ import annotations

import asyncio
import logging
import random

import aio_pika
from aio_pika.abc import AbstractConnection

from .errors import BrokerUnavailableError
from .settings import Settings, redact_url

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


async def connect(settings: Settings, *, name: str) -> AbstractConnection:
    """One connection attempt; raises ``BrokerUnavailableError`` with the URL redacted."""
    url = settings.amqp_url_plain()
    try:
        return await aio_pika.connect(
            url,
            timeout=CONNECT_TIMEOUT_S,
            heartbeat=settings.heartbeat_s,
            client_properties={"connection_name": name},
        )
    except (OSError, asyncio.TimeoutError, aio_pika.exceptions.AMQPError) as e:
        raise BrokerUnavailableError(
            f"cannot connect to RabbitMQ at {redact_url(url)}: {type(e).__name__}: {e}"
        ) from e


def backoff_s(failures: int, max_delay_s: float) -> float:
    """0.2 s, 0.4 s, 0.8 s ... capped, with jitter so a fleet does not reconnect in step."""
    base: float = min(0.2 * 2 ** max(failures - 1, 0), max_delay_s)
    return base * random.uniform(0.5, 1.0)


async def connect_with_retry(
    settings: Settings, *, name: str, stop: asyncio.Event | None = None
) -> AbstractConnection | None:
    """Retry ``connect`` with backoff until it succeeds, or return None once ``stop`` is set."""
    failures = 0
    while True:
        try:
            return await connect(settings, name=name)
        except BrokerUnavailableError as e:
            failures += 1
            delay = backoff_s(failures, settings.reconnect_max_delay_s)
            log.warning("%s; retrying in %.1f s", e, delay)
            if stop is None:
                await asyncio.sleep(delay)
                continue
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return None
            except asyncio.TimeoutError:
                continue

"""Is each part this app depends on answering? Used by ``weclaw-mq health`` and probes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from weclaw_mq.config.tls import describe_refusal
from weclaw_mq.errors import BrokerUnavailableError
from weclaw_mq.settings import Settings
from weclaw_mq.wire.connection import BrokerEndpoints

PING_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PartHealth:
    part: str
    ok: bool
    detail: str


async def check_broker(settings: Settings) -> PartHealth:
    try:
        conn = await BrokerEndpoints(settings).connect(name="weclaw-mq-health")
    except BrokerUnavailableError as e:
        return PartHealth("broker", False, str(e))
    await conn.close()
    return PartHealth("broker", True, settings.amqp_url_redacted())


async def check_redis(settings: Settings) -> PartHealth:
    # Imported here: a health check of the broker alone needs no Redis client.
    from weclaw_mq.state.redis_clients import open_client

    shown = settings.redis_url_redacted()
    # The store's own client (one Redis, a cluster or a Sentinel's primary), with short waits.
    client = open_client(settings.model_copy(update={"redis_timeout_s": PING_TIMEOUT_S}))
    try:
        await asyncio.wait_for(client.ping(), PING_TIMEOUT_S)
    except Exception as e:  # any failure to answer means the same thing here
        why = describe_refusal(e, "redis") or f"{type(e).__name__}: {e}"
        return PartHealth("redis", False, f"cannot reach Redis at {shown}: {why}")
    finally:
        await client.aclose()
    return PartHealth("redis", True, shown)


async def check_all(settings: Settings) -> list[PartHealth]:
    return list(await asyncio.gather(check_broker(settings), check_redis(settings)))

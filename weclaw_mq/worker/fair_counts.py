"""The tasks waiting in each fair-share lane, read from the broker and written to the fair
book (``state.fair_book``) by every worker consuming a handler with ``fair=``: the producers
then place tenants by the broker's counts, not by counts that drift (a task that expired or was
purged, a publish the broker refused). Nothing is written per task on the consume path.

A count says which landings it covers: the book's landed tasks are read first, then the
broker, so a task a producer adds meanwhile is never wiped by a count that predates it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from aio_pika.abc import AbstractChannel, AbstractConnection

from weclaw_mq.contract.naming import fair_lane_name
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.failures import describe
from weclaw_mq.policy.fair_share import FAIR_COUNT_EVERY_S
from weclaw_mq.state.fair_book import TENANT_KEEP_MS, FairBook

log = logging.getLogger("weclaw_mq.worker")


async def waiting_per_lane(channel: AbstractChannel, spec: HandlerSpec) -> list[int]:
    """The ready messages of each of ``spec``'s fair lanes, lane 0 (Q) first (passive
    declares: nothing is created)."""
    assert spec.fair is not None
    counts = []
    for index in range(spec.fair.lanes):
        queue = await channel.declare_queue(fair_lane_name(spec.queue, index), passive=True)
        result = queue.declaration_result
        counts.append(int(result.message_count or 0))
    return counts


async def count_once(channel: AbstractChannel, spec: HandlerSpec, book: FairBook) -> None:
    """Write ``spec``'s lane counts to ``book`` once, with the landings they cover."""
    assert spec.fair is not None
    covered = await book.landed(spec.queue, spec.fair.lanes)  # before the broker: see above
    waiting = await waiting_per_lane(channel, spec)
    await book.counted(spec.queue, waiting, covered, TENANT_KEEP_MS)


async def count_forever(
    conn: AbstractConnection,
    specs: Sequence[HandlerSpec],
    book: FairBook,
    every_s: float = FAIR_COUNT_EVERY_S,
) -> None:
    """Write ``specs``' lane counts to ``book`` every ``every_s`` until cancelled; a failure
    (Redis away, a lane deleted: its channel closed) is logged and tried again next time."""
    channel: AbstractChannel | None = None
    try:
        while True:
            try:
                if channel is None or channel.is_closed:
                    channel = await conn.channel()
                for spec in specs:
                    await count_once(channel, spec, book)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("fair-share lane counts not written: %s", describe(e))
            # A period, not a wait for some event: the counts are read on a clock.
            await asyncio.sleep(every_s)
    finally:
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), 1.0)

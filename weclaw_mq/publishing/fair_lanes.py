"""The fair-share lane a producer sends each task of a handler with ``fair=`` to
(``policy.fair_share`` says why; ``state.fair_book`` keeps the assignment).

Only NORMAL tasks carrying a tenant (``x-weclaw-tenant``, set by ``Preparer``) are placed:
HIGH and URGENT ones go to their priority lanes, and a task from a producer that does not
register the handler goes to Q. The book is asked once per publish (once per batch for
``publish_many``); when it cannot answer within ``QUEUED_RECORD_WAIT_S`` the tenant is hashed
to a lane instead (``hashed_lane``), so a publish never fails or waits long for fairness.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aio_pika

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import fair_lane_name
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.fair_share import hashed_lane
from weclaw_mq.policy.priority import Priority, priority_from_header
from weclaw_mq.publishing.queued_records import QUEUED_RECORD_WAIT_S
from weclaw_mq.state.fair_book import TENANT_KEEP_MS, FairBook, fair_book_of

log = logging.getLogger("weclaw_mq.producer")

# Where each task of a batch goes: (tenant, lane index), or None (not placed by tenant).
Placement = tuple[str, int] | None


def tenant_of(message: aio_pika.Message) -> str | None:
    """The tenant a NORMAL task of a fair handler carries; None for any other task."""
    headers = message.headers or {}
    tenant = headers.get(h.TENANT)
    if not isinstance(tenant, str) or not tenant:
        return None
    if priority_from_header(headers.get(h.PRIORITY)) is not Priority.NORMAL:
        return None
    return tenant


class FairLanes:
    """One App's placement of fair handlers' tasks.

    Args:
        store: The App's task store, asked per batch (the book is beside it; None: hashing).
        background: Runs a best-effort write the App holds until it ends.
    """

    def __init__(
        self,
        store: Callable[[], object],
        background: Callable[..., object],
    ) -> None:
        self._store = store
        self._background = background
        self._warned = False

    async def place(
        self, spec: HandlerSpec, messages: Sequence[aio_pika.Message]
    ) -> list[Placement]:
        """Each message's (tenant, lane), counted in the book as waiting there."""
        assert spec.fair is not None
        tenants = [tenant_of(m) for m in messages]
        named = [t for t in tenants if t is not None]
        if not named:
            return [None] * len(messages)
        lanes = await self._assign(spec, named)
        placed = iter(lanes)
        return [None if t is None else (t, next(placed)) for t in tenants]

    async def _assign(self, spec: HandlerSpec, tenants: list[str]) -> list[int]:
        assert spec.fair is not None
        count = spec.fair.lanes
        book: FairBook | None = fair_book_of(self._store())
        if book is not None:
            asking = asyncio.ensure_future(book.assign(spec.queue, count, tenants, TENANT_KEEP_MS))
            try:
                return await asyncio.wait_for(asyncio.shield(asking), QUEUED_RECORD_WAIT_S)
            except Exception as e:  # an outage or a slow Redis: hashed, the publish goes on
                self._background(_drained(asking))
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "fair share of %r: the fair book did not answer (%s); tenants are "
                        "hashed to lanes until it does",
                        spec.queue,
                        type(e).__name__,
                    )
                return [hashed_lane(t, count) for t in tenants]
        return [hashed_lane(t, count) for t in tenants]


def lane_name(queue: str, placement: Placement) -> str | None:
    """The queue a placed task goes to; None for a task placed by priority as before."""
    return None if placement is None else fair_lane_name(queue, placement[1])


async def _drained(asking: asyncio.Future[list[int]]) -> None:
    """Let an assignment we stopped waiting for end (its counts stay: a guide, not the truth)."""
    try:
        await asking
    except Exception as e:
        log.debug("fair book assignment failed late (%s)", type(e).__name__)

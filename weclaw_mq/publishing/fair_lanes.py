"""The fair-share lane a producer sends each task of a handler with ``fair=`` to
(``policy.fair_share`` says why; ``state.fair_book`` keeps the assignment).

Only NORMAL tasks carrying a tenant (``x-weclaw-tenant``, set by ``Preparer``) are placed:
HIGH and URGENT ones go to their priority lanes, and a task from a producer that does not
register the handler goes to Q. The book is asked once per publish (once per batch for
``publish_many``) for a tenant not placed in the last ``KNOWN_FOR_S``; when it cannot answer
within ``QUEUED_RECORD_WAIT_S`` the tenant is hashed to a lane instead (``hashed_lane``), so a
publish never fails or waits long for fairness.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import aio_pika

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import fair_lane_name
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.fair_share import FAIR_COUNT_EVERY_S, hashed_lane
from weclaw_mq.policy.priority import Priority, priority_from_header
from weclaw_mq.publishing.queued_records import QUEUED_RECORD_WAIT_S
from weclaw_mq.state.fair_book import TENANT_KEEP_MS, FairBook, fair_book_of

log = logging.getLogger("weclaw_mq.producer")

# How long a producer reuses a tenant's lane without asking the book (one round trip per
# publish saved): as long as the workers take to write the broker's counts, the age of what
# the book knows anyway (``worker.fair_counts``).
KNOWN_FOR_S = FAIR_COUNT_EVERY_S
# Tasks placed from what a producer knew are added to the book's counts this often, in one
# write: a write per publish cost a publish one at a time about as much as asking would.
COUNT_FLUSH_S = 0.1
# Past this many remembered tenants, the stale ones are forgotten at the next placement.
KNOWN_MAX = 10_000

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
        # (queue, tenant) -> (lane, loop time until which it is reused without asking)
        self._known: dict[tuple[str, str], tuple[int, float]] = {}
        # Tasks published to known lanes, not yet added to the book: queue -> lane -> tasks.
        self._unsent: dict[str, Counter[int]] = {}

    async def place(
        self, spec: HandlerSpec, messages: Sequence[aio_pika.Message]
    ) -> list[Placement]:
        """Each message's (tenant, lane), counted in the book as waiting there.

        A tenant the book placed less than ``KNOWN_FOR_S`` ago keeps that lane without a
        round trip (its tasks are added to the book's count in the background, batched)."""
        assert spec.fair is not None
        tenants = [tenant_of(m) for m in messages]
        named = [t for t in tenants if t is not None]
        if not named:
            return [None] * len(messages)
        now = asyncio.get_running_loop().time()
        known = self._known
        lane_of: dict[str, int] = {}
        for tenant in named:
            hit = known.get((spec.queue, tenant))
            if hit is not None and hit[1] > now:
                lane_of[tenant] = hit[0]
        unknown = [t for t in named if t not in lane_of]
        if unknown:
            lanes, booked = await self._assign(spec, unknown)
            for tenant, lane in zip(unknown, lanes, strict=True):
                lane_of[tenant] = lane
                if booked:
                    known[(spec.queue, tenant)] = (lane, now + KNOWN_FOR_S)
            if len(known) > KNOWN_MAX:  # forget the stale ones, all at once
                self._known = {k: v for k, v in known.items() if v[1] > now}
        if len(unknown) < len(named):
            self._count(spec.queue, [lane_of[t] for t in named if t not in unknown])
        return [None if t is None else (t, lane_of[t]) for t in tenants]

    def _count(self, queue: str, lanes: list[int]) -> None:
        """Add tasks placed from what we knew to the book's counts, in one write per
        ``COUNT_FLUSH_S`` (the first task after a write starts the next)."""
        pending = self._unsent.get(queue)
        if pending is None:
            pending = self._unsent[queue] = Counter()
            asyncio.get_running_loop().call_later(COUNT_FLUSH_S, self._flush, queue)
        pending.update(lanes)

    def _flush(self, queue: str) -> None:
        tasks = self._unsent.pop(queue, None)
        book = fair_book_of(self._store())
        if tasks and book is not None:
            self._background(_added(book, queue, tasks))

    async def _assign(self, spec: HandlerSpec, tenants: list[str]) -> tuple[list[int], bool]:
        """Each tenant's lane, and whether the book gave them (else they are hashed)."""
        assert spec.fair is not None
        count = spec.fair.lanes
        book: FairBook | None = fair_book_of(self._store())
        if book is not None:
            asking = asyncio.ensure_future(book.assign(spec.queue, count, tenants, TENANT_KEEP_MS))
            try:
                lanes = await asyncio.wait_for(asyncio.shield(asking), QUEUED_RECORD_WAIT_S)
                return lanes, True
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
                return [hashed_lane(t, count) for t in tenants], False
        return [hashed_lane(t, count) for t in tenants], False


def lane_name(queue: str, placement: Placement) -> str | None:
    """The queue a placed task goes to; None for a task placed by priority as before."""
    return None if placement is None else fair_lane_name(queue, placement[1])


async def _added(book: FairBook, queue: str, tasks: Counter[int]) -> None:
    try:
        await book.added(queue, tasks, TENANT_KEEP_MS)
    except Exception as e:  # a count a second late: the workers' counts correct it
        log.debug("fair book count not added (%s)", type(e).__name__)


async def _drained(asking: asyncio.Future[list[int]]) -> None:
    """Let an assignment we stopped waiting for end (its counts stay: a guide, not the truth)."""
    try:
        await asking
    except Exception as e:
        log.debug("fair book assignment failed late (%s)", type(e).__name__)

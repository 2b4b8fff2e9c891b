"""The fair-share lane a producer sends each task of a handler with ``fair=`` to
(``policy.fair_share`` says why; ``state.fair_book`` keeps the assignment).

Only NORMAL tasks carrying a tenant (``x-weclaw-tenant``, set by ``Preparer``) are placed:
HIGH and URGENT ones go to their priority lanes, and a task from a producer that does not
register the handler goes to Q. The book is asked once per publish (once per batch for
``publish_many``) for a tenant not placed in the last ``KNOWN_FOR_S``; when it cannot answer
within ``QUEUED_RECORD_WAIT_S`` the tenant is hashed to a lane instead (``hashed_lane``), so a
publish never fails or waits long for fairness. After the broker's answer, the tasks that
landed (and the batches that no longer fly) are told to the book in one background write per
``COUNT_FLUSH_S``, off the publish's path.
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
from weclaw_mq.state.fair_book import TENANT_KEEP_MS, FairBook, Landing, fair_book_of

log = logging.getLogger("weclaw_mq.producer")

# How long a producer reuses a tenant's lane without asking the book (one round trip per
# publish saved): as long as the workers take to write the broker's counts, the age of what
# the book knows anyway (``worker.fair_counts``).
KNOWN_FOR_S = FAIR_COUNT_EVERY_S
# The broker's answers are told to the book this often, in one write: a write per publish
# cost a publish one at a time about as much as asking would.
COUNT_FLUSH_S = 0.1
# Past this many remembered tenants, the stale ones are forgotten at the next placement.
KNOWN_MAX = 10_000

# Where each task of a batch goes: (tenant, lane index, the book's flying batch or ''), or
# None (not placed by tenant).
Placement = tuple[str, int, str] | None


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
        # Answers not yet told to the book: queue -> (lanes, (tenant, lane, batch) -> landed).
        self._unsent: dict[str, tuple[int, Counter[tuple[str, int, str]]]] = {}

    async def place(
        self, spec: HandlerSpec, messages: Sequence[aio_pika.Message]
    ) -> list[Placement]:
        """Each message's (tenant, lane, batch), counted in the book as on its way there
        (``settled`` tells it the broker's answer).

        A tenant the book placed less than ``KNOWN_FOR_S`` ago keeps that lane without a
        round trip (its tasks count in the book once they landed)."""
        assert spec.fair is not None
        tenants = [tenant_of(m) for m in messages]
        named = [t for t in tenants if t is not None]
        if not named:
            return [None] * len(messages)
        now = asyncio.get_running_loop().time()
        known = self._known
        lane_of: dict[str, tuple[int, str]] = {}
        for tenant in named:
            hit = known.get((spec.queue, tenant))
            if hit is not None and hit[1] > now:
                lane_of[tenant] = (hit[0], "")
        unknown = [t for t in named if t not in lane_of]
        if unknown:
            placed, booked = await self._assign(spec, unknown)
            for tenant, (lane, batch) in zip(unknown, placed, strict=True):
                lane_of[tenant] = (lane, batch)
                if booked:
                    known[(spec.queue, tenant)] = (lane, now + KNOWN_FOR_S)
            if len(known) > KNOWN_MAX:  # forget the stale ones, all at once
                self._known = {k: v for k, v in known.items() if v[1] > now}
        return [None if t is None else (t, *lane_of[t]) for t in tenants]

    def settled(
        self, spec: HandlerSpec, placements: Sequence[Placement], landed: Sequence[bool]
    ) -> None:
        """The broker answered for ``placements`` (``landed``: confirmed): told to the book
        in one write per ``COUNT_FLUSH_S`` (the first answer after a write starts the next)."""
        assert spec.fair is not None
        pending = self._unsent.get(spec.queue)
        if pending is None:
            pending = self._unsent[spec.queue] = (spec.fair.lanes, Counter())
            asyncio.get_running_loop().call_later(COUNT_FLUSH_S, self._flush, spec.queue)
        for placed, ok in zip(placements, landed, strict=True):
            if placed is not None:
                pending[1][placed] += 1 if ok else 0

    def _flush(self, queue: str) -> None:
        lanes, answers = self._unsent.pop(queue, (0, Counter()))
        book = fair_book_of(self._store())
        if answers and book is not None:
            landings = [Landing(t, lane, n, batch) for (t, lane, batch), n in answers.items()]
            self._background(_settled(book, queue, lanes, landings))

    async def _assign(
        self, spec: HandlerSpec, tenants: list[str]
    ) -> tuple[list[tuple[int, str]], bool]:
        """Each tenant's (lane, batch), and whether the book gave them (else hashed)."""
        assert spec.fair is not None
        count = spec.fair.lanes
        book: FairBook | None = fair_book_of(self._store())
        if book is not None:
            asking = asyncio.ensure_future(book.assign(spec.queue, count, tenants, TENANT_KEEP_MS))
            try:
                placed = await asyncio.wait_for(asyncio.shield(asking), QUEUED_RECORD_WAIT_S)
                return placed, True
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
                return [(hashed_lane(t, count), "") for t in tenants], False
        return [(hashed_lane(t, count), "") for t in tenants], False


def lane_name(queue: str, placement: Placement) -> str | None:
    """The queue a placed task goes to; None for a task placed by priority as before."""
    return None if placement is None else fair_lane_name(queue, placement[1])


async def _settled(book: FairBook, queue: str, lanes: int, landings: list[Landing]) -> None:
    try:
        await book.settled(queue, lanes, landings, TENANT_KEEP_MS)
    except Exception as e:  # the workers' next count has the landed tasks; batches expire
        log.debug("fair book answers not written (%s)", type(e).__name__)


async def _drained(asking: asyncio.Future[list[tuple[int, str]]]) -> None:
    """Let an assignment we stopped waiting for end (its batches fly until ``FLYING_MS``:
    the tasks went to hashed lanes, the workers' next count has them)."""
    try:
        await asking
    except Exception as e:
        log.debug("fair book assignment failed late (%s)", type(e).__name__)

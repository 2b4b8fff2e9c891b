"""A handler's limits (``weclaw_mq.policy.limits``) counted in Redis, for every worker at once.

Per limit and key, two sorted sets (names from ``naming.limit_keys``):
- ``slots``: the attempts running now, each scored by the end of its lease. Expired entries
  are trimmed by the next admission, so a worker that dies frees its slots after one lease
  (``guard_lease_s``, the guard's lease); a live worker renews its slots every lease/3, the
  guard's rhythm, in one pipelined round trip for all of them.
- ``starts``: the starts of the last ``per_s`` seconds (a sliding-window log): a start is
  admitted only while fewer than ``rate`` lie in the window, so no window of ``per_s`` ever
  holds more than ``rate`` starts (bursts up to ``rate`` are allowed). Memory: ``rate``
  entries per busy key.
Both use Redis's clock (``TIME`` inside the script), never the workers' clocks.

An admission is one script call per limit; the admissions asked for in one turn of the event
loop (deliveries whose claims were answered together, a list of limits) go out as one
pipeline. A release is a ``ZREM`` sent within 5 ms of the handler's end, with the other
releases and admissions of that moment. Each separate command costs a worker ~80-100 us of
CPU in redis-py plus a send and a wake-up, more than the script itself: batching is what
keeps a limit cheap under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from weclaw_mq.contract.naming import limit_keys, token_keys
from weclaw_mq.errors import InvalidPayload
from weclaw_mq.llm.limit_scripts import ADMIT_SCRIPT, BLOCK_SCRIPT, RENEW_SCRIPT, SETTLE_SCRIPT
from weclaw_mq.policy.failures import describe
from weclaw_mq.policy.limits import Limit, LimitKind, deferral_ms, early_deferral_ms
from weclaw_mq.policy.signals import Retry
from weclaw_mq.settings import Settings
from weclaw_mq.state.outages import is_state_failure, state_unavailable
from weclaw_mq.state.protocol import new_owner

if TYPE_CHECKING:  # redis-py is loaded only when a handler has a limit (a lighter worker)
    from weclaw_mq.state.redis_clients import StateClient

log = logging.getLogger("weclaw_mq.worker")

# How long after its admission a start's provider call is taken to happen, at most, before
# this worker measured any (``Limiter.margin_ms``): a token limit keeps a start in its window
# this much longer than ``per_s``, so a start admitted as the oldest leaves finds the
# provider's window freed too (``make bench-token-budget``: 429s).
TOKEN_WINDOW_MARGIN_MS = 200
# The learned margin: this percentile of the last ``MARGIN_SAMPLES`` measured delays from a
# start's admission to its call's answer (its first ``ctx.usage``; its end, for a 429), per
# key, never under ``MIN_MARGIN_MS``. An answer comes after the provider counted the call, so
# the measure errs long: a start is held a little longer, never let go early.
MARGIN_PERCENTILE = 0.99
MARGIN_SAMPLES = 200
MIN_MARGIN_MS = 50
# The learned margin is this much the percentile: room for a delay a little past any seen
# yet (a loaded loop, an admission batched behind others).
MARGIN_HEADROOM = 1.25
# A cap's reservations stay in their window this long: longer than the UTC day their keys
# are named after, so each counts until the day's keys expire.
CAP_WINDOW_S = 2 * 86_400.0
# Until a handler's first release says how long its slots are held, a task refused a slot
# expects one to free in this long.
FIRST_HOLD_ESTIMATE_MS = 1000.0
# The weight of the newest hold time in the running estimate.
HOLD_EWMA_WEIGHT = 0.2
# Releases wait up to this long to go out together, or with the next batch of admissions: in
# a pipeline a command costs a fraction of one sent alone (benchmarks/README.md, "Numbers
# behind the code"). A slot is held this much longer.
RELEASE_BATCH_S = 0.005
# How long close() waits for the last releases (past it, they lapse with their leases).
CLOSE_FLUSH_S = 1.0
# Round trips to Redis at once (admissions, take-backs, releases, renewals): each takes a
# pooled connection, so a worker's connections stay this many whatever its concurrency.
ROUND_TRIPS_IN_FLIGHT = 4


# A handler's limit: (its queue, its index in the handler's limits).
_Which = tuple[str, int]


@dataclass(frozen=True)
class Held:
    """Refused by a limit: defer the task by ``delay_ms``."""

    kind: LimitKind
    delay_ms: int


class Ticket:
    """An admitted start: the slots it holds until its handler ends (``with ticket:``)."""

    def __init__(
        self,
        limiter: Limiter | None,
        holder: str,
        slots: Sequence[tuple[str, _Which]],
        budgets: Sequence[tuple[str, str, str]] = (),
        spends: Sequence[tuple[str, str, str]] = (),
        since: float | None = None,
    ) -> None:
        self._limiter = limiter
        self.holder = holder
        self.slots = tuple(slots)  # (slots key, which limit)
        # The (tokens, total, blocked) keys of each token limit the start was admitted under.
        self.budgets = tuple(budgets)
        # The (holder, tokens, total) keys of a cap's reservation of the run's cost
        # (``Limiter.reserve``): settled with ``spent_micros``, 0 if it reported nothing.
        self.spends = tuple(spends)
        self.spent_micros = 0
        # What the handler reported using (ctx.usage), None if it reported nothing: then the
        # estimate stands.
        self.used: int | None = None
        # A 429's Retry-After the attempt ended with (Retry(after_s=)): its keys admit
        # nothing for that long.
        self.blocked_ms: int | None = None
        # From the admission to its first call's answer (ms): the token limits' margin.
        self.called_ms: float | None = None
        # The attempt ended with a 429 (``Retry``): its window is shrunk at once.
        self.refused = False
        # When its admission was asked for (monotonic): before Redis's clock stamped it.
        self._since = time.monotonic() if since is None else since

    def report(self, tokens: int, at: float | None = None) -> None:
        """Add ``tokens`` to what this start used (``ctx.usage``, reported at ``at``,
        monotonic); settled when it ends."""
        self.used = (self.used or 0) + tokens
        if self.called_ms is None:
            self.called_ms = ((time.monotonic() if at is None else at) - self._since) * 1000

    def report_cost(self, micros: int) -> None:
        """Add a call's cost to what this run spent against its cap; settled when it ends."""
        self.spent_micros += micros

    def joined(self, other: Ticket) -> Ticket:
        """One ticket holding this one's slots and budgets and ``other``'s reservations."""
        if other is NO_TICKET:
            return self
        if self is NO_TICKET:
            return other
        both = Ticket(
            self._limiter, self.holder, self.slots, self.budgets, other.spends, self._since
        )
        other.spends = ()
        return both

    def release(self) -> None:
        """Free what it holds without a run (a later gate stopped the task)."""
        self.__exit__(None, None, None)

    def ended(self, error: BaseException | None) -> None:
        """Note a 429's ``Retry(after_s=)`` the attempt ended with, for the token limits."""
        if self.budgets and isinstance(error, Retry):
            self.blocked_ms = error.after_ms
            self.refused = True
            if self.called_ms is None:  # its call was answered (429) before this
                self.called_ms = (time.monotonic() - self._since) * 1000

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._limiter is not None and (self.slots or self.budgets or self.spends):
            self._limiter.let_go(self, (time.monotonic() - self._since) * 1000)
            self.slots = self.budgets = self.spends = ()


# A start no limit holds (the handler has none, or every key function said None).
NO_TICKET = Ticket(None, "", ())


def _key_of(limit: Limit, task: Any, model: str | None = None) -> tuple[bool, str | None]:
    """(limited?, key): the key as text, None for a global limit; a per-model limit's key
    is the attempt's model (not limited without one), before the key function's value."""
    if limit.per_model:
        if model is None:
            return False, None
        if limit.key is None:
            return True, model
        limited, key = _key_of(replace(limit, per_model=False), task)
        return limited, f"{model}|{key}"
    if limit.key is None:
        return True, None
    try:
        value = limit.key(task)
    except Exception as e:
        raise InvalidPayload(f"the limit's key function raised {describe(e)}") from e
    if value is None:
        return False, None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidPayload(
            f"the limit's key function returned {type(value).__name__}; it must return a "
            "str, an int or None"
        )
    return True, str(value)


@dataclass(frozen=True)
class _Call:
    """One limit's admission of one start: its keys (slots, starts, tokens, total, blocked)
    and the tokens it is estimated at (0 without a token budget)."""

    index: int
    limit: Limit
    keys: tuple[str, str, str, str, str]
    need: int
    period_ms: int  # how long a start stays in the window of its rate or tokens


def _estimate(limit: Limit, task: Any, body_bytes: int) -> int:
    try:
        return limit.estimated(task, body_bytes)
    except Exception as e:
        raise InvalidPayload(f"the limit's estimate function raised {describe(e)}") from e


class Limiter:
    """One worker's view of its handlers' limits: admissions, held slots, their renewal."""

    def __init__(self, client: StateClient, *, lease_s: float, owns_client: bool = False) -> None:
        self._redis = client
        self._owns_client = owns_client
        self.lease_s = lease_s
        self._lease_ms = max(1, int(lease_s * 1000))
        self._admit = client.register_script(ADMIT_SCRIPT)
        self._renew = client.register_script(RENEW_SCRIPT)
        self._settle = client.register_script(SETTLE_SCRIPT)
        self._block = client.register_script(BLOCK_SCRIPT)
        # Token limits' settles and blocks of ended starts, sent with the next releases:
        # (script, keys, args).
        self._corrections: list[tuple[Any, list[str], list[str | int]]] = []
        self._held: set[tuple[str, str]] = set()  # (slots key, holder) while its handler runs
        self._releases: list[tuple[str, str]] = []
        self._renewer: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        # How long a slot is held, per (queue, limit index): a running mean of this worker's
        # holds, the expected wait of a task refused a slot.
        self._hold_ms: dict[_Which, float] = {}
        # Per token limit's key (its tokens key): the latest admission-to-call delays (ms),
        # and the margin they give (``margin_ms``), kept as the samples come.
        self._delays: dict[str, deque[float]] = {}
        self._margins: dict[str, int] = {}
        # The delay of a start that met a 429, and for how many more samples it holds.
        self._after_429: dict[str, tuple[float, int]] = {}
        # Admission script calls waiting for this loop turn's batch: (keys, args, answer).
        self._asked: list[tuple[list[str], list[str | int], asyncio.Future[Any]]] = []
        self._asking: asyncio.Task[None] | None = None
        self._round_trips = asyncio.Semaphore(ROUND_TRIPS_IN_FLIGHT)

    @classmethod
    def open(cls, settings: Settings) -> Limiter:
        from weclaw_mq.state.redis_clients import open_client

        return cls(open_client(settings), lease_s=settings.guard_lease_s, owns_client=True)

    async def admit(
        self,
        queue: str,
        limits: Sequence[Limit],
        task: Any,
        body_bytes: int = 0,
        model: str | None = None,
    ) -> Ticket | Held:
        """A ticket for a start within every limit, or the first limit's refusal.

        ``body_bytes``: the task's body length, for a token limit's default estimate;
        ``model``: the attempt's model, the key of a per-model limit.
        ``InvalidPayload`` when a key or estimate function fails on the task;
        ``StateUnavailableError`` when Redis does not answer."""
        holder = new_owner()
        calls: list[_Call] = []
        for index, limit in enumerate(limits):
            limited, key = _key_of(limit, task, model)
            if limited:
                need = _estimate(limit, task, body_bytes) if limit.tokens else 0
                keys = (*limit_keys(queue, index, key), *token_keys(queue, index, key))
                # A start leaves a token limit's window this much after the provider's
                # clock lets it go: it called the provider a little after its admission.
                margin = self.margin_ms(keys[2]) if limit.tokens else 0
                calls.append(_Call(index, limit, keys, need, limit.period_ms + margin))
        if not calls:
            return NO_TICKET
        asked_at = time.monotonic()
        try:
            answers = await self._ask(holder, calls)
        except Exception as e:
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise
        admitted = [
            call for call, (verdict, _) in zip(calls, answers, strict=True) if verdict == b"ok"
        ]
        for call, (verdict, wait_ms) in zip(calls, answers, strict=True):
            if verdict == b"ok":
                continue
            # Every limit was asked at once: take back what the others admitted, before or after.
            await self._undo(holder, admitted)
            kind = LimitKind(verdict.decode())
            if kind is LimitKind.CONCURRENCY:
                wait_ms = self._hold_ms.get((queue, call.index), FIRST_HOLD_ESTIMATE_MS)
            if kind is LimitKind.TOKENS:  # back a little early, deferred again for the rest
                return Held(kind, early_deferral_ms(wait_ms))
            return Held(kind, deferral_ms(wait_ms))
        slots = [(c.keys[0], (queue, c.index)) for c in admitted if c.limit.concurrency]
        for key, _ in slots:
            self._held.add((key, holder))
        if slots and self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_while_held())
        budgets = [(c.keys[2], c.keys[3], c.keys[4]) for c in admitted if c.limit.tokens]
        return Ticket(self, holder, slots, budgets, since=asked_at)

    def margin_ms(self, tokens_key: str) -> int:
        """How much longer than ``per_s`` a start of the token limit's key stays in its
        window: a high percentile of its measured admission-to-call delays."""
        return self._margins.get(tokens_key, TOKEN_WINDOW_MARGIN_MS)

    def learned(self, tokens_key: str, delay_ms: float, refused: bool) -> None:
        """A start's admission-to-call delay. One that met a 429 (its call reached a provider
        whose window we thought had room) raises the key's margin to it at once, and holds
        it there while it is among the key's samples."""
        delays = self._delays.get(tokens_key)
        if delays is None:
            delays = self._delays[tokens_key] = deque(maxlen=MARGIN_SAMPLES)
        delays.append(delay_ms)
        ranked = sorted(delays)
        margin = ranked[math.ceil(MARGIN_PERCENTILE * len(ranked)) - 1]  # the max, under 100
        floor, left = self._after_429.get(tokens_key, (0.0, 0))
        if refused:
            floor, left = max(delay_ms, floor if left else 0.0), MARGIN_SAMPLES
        if left:
            self._after_429[tokens_key] = (floor, left - 1)
            margin = max(margin, floor)
        self._margins[tokens_key] = max(MIN_MARGIN_MS, round(margin * MARGIN_HEADROOM))

    async def reserve(
        self, keys: tuple[str, str, str, str, str], budget: int, need: int
    ) -> Ticket | Held:
        """Reserve ``need`` of ``budget`` under ``keys`` (``naming.cap_keys``: a tenant's
        day), as a token limit admits a start's estimate: a ticket whose ``spends`` settle
        to what the run reported (``report_cost``), or a refusal while what is reserved and
        spent already leaves no room for ``need`` (the day's first start always fits).
        ``StateUnavailableError`` when Redis does not answer."""
        holder = new_owner()
        day = Limit(tokens=max(1, budget), per_s=CAP_WINDOW_S)
        call = _Call(-1, day, keys, need, day.period_ms)
        try:
            [(verdict, wait_ms)] = await self._ask(holder, [call])
        except Exception as e:
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise
        if verdict != b"ok":
            return Held(LimitKind(verdict.decode()), deferral_ms(wait_ms))
        return Ticket(self, holder, (), (), [(holder, keys[2], keys[3])])

    async def _ask(self, holder: str, calls: list[_Call]) -> list[Any]:
        loop = asyncio.get_running_loop()
        answers = []
        for call in calls:
            limit = call.limit
            args: list[str | int] = [
                holder,
                self._lease_ms,
                limit.concurrency or 0,
                limit.rate or 0,
                call.period_ms,
                limit.tokens or 0,
                call.need,
            ]
            answer: asyncio.Future[Any] = loop.create_future()
            self._asked.append((list(call.keys), args, answer))
            answers.append(answer)
        if self._asking is None:
            # Runs at the next turn of the loop: what else is asked in this turn joins it.
            self._asking = loop.create_task(self._send_asked())
        try:
            return [await answer for answer in answers]
        except BaseException:
            # Cancelled (a hard stop) after Redis admitted it: the slot lapses with its lease.
            for answer in answers:
                if answer.done() and not answer.cancelled():
                    answer.exception()  # retrieved: no "never retrieved" warning
            raise

    async def _send_asked(self) -> None:
        batch, self._asked, self._asking = self._asked, [], None
        # Releases waiting for their batch ride along: no round trip of their own.
        releases, self._releases = self._releases, []
        try:
            async with self._round_trips:
                if len(batch) == 1 and not releases:  # Script reloads a script Redis forgot
                    keys, args, _ = batch[0]
                    results = [await self._admit(keys=keys, args=args)]
                else:
                    results = (await self._pipelined(batch, releases))[len(releases) :]
        except BaseException as e:  # every asker gets the failure (a cancel included)
            if releases:
                log.warning("could not release %d limit slot(s) (%s)", len(releases), describe(e))
            for _, _, answer in batch:
                if not answer.done():
                    answer.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        for (_, _, answer), result in zip(batch, results, strict=True):
            if not answer.done():
                answer.set_result(result)

    async def _pipelined(
        self,
        batch: list[tuple[list[str], list[str | int], asyncio.Future[Any]]],
        releases: list[tuple[str, str]],
    ) -> list[Any]:
        """The releases' answers, then the admissions'."""
        from redis.exceptions import NoScriptError  # loaded with the client already

        # EVALSHA by hand: a Script in a pipeline asks SCRIPT EXISTS first, every time.
        for attempt in range(2):
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key, holder in releases:
                        pipe.zrem(key, holder)
                    for keys, args, _ in batch:
                        pipe.evalsha(self._admit.sha, len(keys), *keys, *args)
                    return list(await pipe.execute())
            except NoScriptError:
                if attempt:
                    raise
                # Redis restarted or its scripts were flushed: load it once, then again.
                self._admit.sha = await self._redis.script_load(ADMIT_SCRIPT)
        raise AssertionError("unreachable")

    async def _undo(self, holder: str, admitted: list[_Call]) -> None:
        """Take back what earlier limits of the same start admitted (it does not start)."""
        if not admitted:
            return
        try:
            async with self._round_trips, self._redis.pipeline(transaction=False) as pipe:
                for call in admitted:
                    slots, starts, tokens, total, _ = call.keys
                    pipe.zrem(slots, holder)
                    pipe.zrem(starts, holder)
                    if call.limit.tokens:  # its tokens back to the window, then its entry
                        pipe.evalsha(self._settle.sha, 2, tokens, total, holder, 0)
                        pipe.hdel(tokens, holder)
                await pipe.execute()
        except Exception as e:  # the slots lapse with their lease, the starts with the window
            log.warning("could not take back a refused start's admissions (%s)", describe(e))

    def let_go(self, ticket: Ticket, held_ms: float) -> None:
        """Free ``ticket``'s slots (the handler ended, however): renewal stops now, the
        ``ZREM`` goes out with the next batch of releases."""
        for tokens, total, blocked in ticket.budgets:
            if ticket.called_ms is not None:
                self.learned(tokens, ticket.called_ms, ticket.refused)
            if ticket.used is not None:
                self._corrections.append(
                    (self._settle, [tokens, total], [ticket.holder, ticket.used])
                )
            if ticket.blocked_ms:
                self._corrections.append((self._block, [blocked], [ticket.blocked_ms]))
        for holder, tokens, total in ticket.spends:
            self._corrections.append((self._settle, [tokens, total], [holder, ticket.spent_micros]))
        for key, which in ticket.slots:
            self._held.discard((key, ticket.holder))
            self._releases.append((key, ticket.holder))
            before = self._hold_ms.get(which)
            self._hold_ms[which] = (
                held_ms if before is None else before + HOLD_EWMA_WEIGHT * (held_ms - before)
            )
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_releases())

    async def _flush_releases(self) -> None:
        await asyncio.sleep(RELEASE_BATCH_S)
        while self._releases or self._corrections:
            batch, self._releases = self._releases, []
            corrections, self._corrections = self._corrections, []
            try:
                async with self._round_trips:
                    if len(batch) == 1 and not corrections:
                        await self._redis.zrem(*batch[0])
                    else:
                        async with self._redis.pipeline(transaction=False) as pipe:
                            for key, holder in batch:
                                pipe.zrem(key, holder)
                            for script, keys, args in corrections:
                                await script(keys=keys, args=args, client=pipe)
                            await pipe.execute()
            except Exception as e:  # a Redis blip: the slots lapse with their leases
                log.warning(
                    "could not release %d limit slot(s) or settle %d token count(s) (%s)",
                    len(batch),
                    len(corrections),
                    describe(e),
                )
        # No await between the emptiness check and this: a later release starts a new flusher.
        self._flusher = None

    async def _renew_while_held(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            if not self._held:
                self._renewer = None  # no await since the check: see RedisTaskStore's renewer
                return
            held = list(self._held)
            try:
                async with self._round_trips, self._redis.pipeline(transaction=False) as pipe:
                    for key, holder in held:
                        await self._renew(
                            keys=[key],
                            args=[holder, self._lease_ms],
                            client=pipe,  # type: ignore[arg-type]  # (a cluster pipeline too)
                        )
                    renewed = await pipe.execute()
            except Exception as e:  # a Redis blip must not kill the handlers
                log.warning("could not renew %d limit slot(s) (%s)", len(held), describe(e))
                continue
            for (key, holder), ok in zip(held, renewed, strict=True):
                if not ok and (key, holder) in self._held:
                    log.warning(
                        "lost a slot of %s (its lease lapsed): the limit may be exceeded "
                        "while this task runs",
                        key,
                    )

    async def close(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        flusher = self._flusher
        if flusher is not None:
            # A stopping worker frees its slots now rather than a lease later, if Redis answers.
            await asyncio.wait({flusher}, timeout=CLOSE_FLUSH_S)
            flusher.cancel()
        if self._owns_client:
            await self._redis.aclose()

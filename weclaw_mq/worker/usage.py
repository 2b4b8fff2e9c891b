"""What a run's model calls used and cost: ``ctx.usage`` collected, recorded in the cost
ledger (``state.cost_ledger``), settled into token limits; and a tenant's daily cap checked
before its task runs (``policy.costs``).

Only an App with prices (or a handler with a token limit) comes here: the common path makes no
call for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from weclaw_mq.contract.message import Delivery
from weclaw_mq.contract.naming import cap_keys
from weclaw_mq.errors import BudgetExceeded
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import UNPRICED_MODEL
from weclaw_mq.policy.costs import Cap, Price
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.state.cost_ledger import MICROS, NO_TENANT, Call, day_of
from weclaw_mq.worker.admission import park_until
from weclaw_mq.worker.attempt import Attempt
from weclaw_mq.worker.ends import DeadLetter, End, by
from weclaw_mq.worker.limiting import Ticket
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")

# Models reported without a price, warned about once per process (the first few: the names
# are handlers' strings).
_UNPRICED: set[str] = set()
UNPRICED_WARNED_MAX = 100


class RunUsage:
    """The model calls one run reported (``ctx.usage``), as (model, input, output)."""

    def __init__(
        self, ticket: Ticket, model: str | None, prices: Mapping[str, Price] | None = None
    ) -> None:
        self._ticket = ticket
        self._model = model
        self._prices = prices or {}
        self.calls: list[tuple[str, int, int]] = []

    def report(self, input_tokens: int, output_tokens: int, model: str | None) -> None:
        called = model or self._model or "-"
        self.calls.append((called, input_tokens, output_tokens))
        if self._ticket.budgets:  # the token limits settle with it when the run ends
            self._ticket.report(input_tokens + output_tokens)
        if self._ticket.spends:  # and a cap's reservation, with its cost
            price = self._prices.get(called)
            if price is not None:
                self._ticket.report_cost(round(price.of(input_tokens, output_tokens) * MICROS))


def tenant_of(spec: HandlerSpec, task: Any) -> str:
    """The task's tenant as its handler's ``tenant=`` says, or ``NO_TENANT``."""
    if spec.tenant is None:
        return NO_TENANT
    try:
        value = spec.tenant(task)
    except Exception as e:  # the bill must not fail the task: it goes on the no-tenant line
        log.warning("the handler's tenant function raised %s: %s", type(e).__name__, e)
        return NO_TENANT
    return NO_TENANT if value is None else str(value)


async def record_usage(
    rt: Runtime, delivery: Delivery, spec: HandlerSpec, task: Any, usage: RunUsage
) -> None:
    """Cost the run's calls with the App's prices and record them (logged if Redis fails:
    the task's outcome does not depend on its bill)."""
    if rt.ledger is None or not usage.calls:
        return
    prices = rt.app.prices
    tenant = tenant_of(spec, task)
    at = datetime.now(UTC).isoformat()
    calls = []
    for model, input_tokens, output_tokens in usage.calls:
        price = prices.get(model)
        if price is None and model not in _UNPRICED and len(_UNPRICED) < UNPRICED_WARNED_MAX:
            _UNPRICED.add(model)
            log.warning("model %r has no price in App(prices=...): its calls cost 0", model)
        cost = 0.0 if price is None else price.of(input_tokens, output_tokens)
        calls.append(
            Call(
                spec.queue,
                delivery.attempt,
                model,
                tenant,
                input_tokens,
                output_tokens,
                round(cost * MICROS),
                at,
            )
        )
        label = UNPRICED_MODEL if price is None else model
        rt.metrics.tokens.labels(spec.queue, label, "input").inc(input_tokens)
        rt.metrics.tokens.labels(spec.queue, label, "output").inc(output_tokens)
        rt.metrics.cost.labels(spec.queue, label).inc(cost)
    try:
        await rt.ledger.record(delivery.task_id, calls)
    except Exception as e:
        log.warning("could not record the task's model usage (%s: %s)", type(e).__name__, e)


async def within_cap(a: Attempt) -> End | None:
    """The cap's gate, before the limits take their slots: go on as is; with the run's cost
    reserved against the cap (``a.reserved``, settled when the run ends); on the cap's
    cheaper model (``a.model``, a downgrade); or the end of a task whose tenant spent its
    day's cap (parked until the next UTC day, or shed), or whose estimate does not fit beside
    the runs that hold the rest of it now (parked 1 s)."""
    capped = await _cap_reading(a.rt, a.spec, a.task)
    if isinstance(capped, Ticket):
        a.reserved = capped
    elif isinstance(capped, str):
        a.model = capped  # downgraded: the run gets the cap's cheaper model
    elif capped is not None:
        return by(capped, "cap")
    return None


async def _cap_reading(rt: Runtime, spec: HandlerSpec, task: Any) -> End | str | Ticket | None:
    cap = spec.cap
    if cap is None or rt.ledger is None:
        return None
    tenant = tenant_of(spec, task)
    now = datetime.now(UTC)
    day = day_of(now)
    try:
        spent, mean = await rt.ledger.cap_reading(tenant, spec.queue, day)
    except Exception as e:  # the cap cannot tell: run it (the bill is recorded all the same)
        log.warning("the tenant's spending could not be read (%s); running uncapped", e)
        return None
    budget = cap.per_day_micros
    if spent >= budget:
        return _capped(rt, spec, cap, tenant, spent, now)
    if rt.limiter is None:
        return None
    need = _estimate_micros(cap, task, mean, budget - spent)
    try:
        reserved = await rt.limiter.reserve(cap_keys(rt.app.name, tenant, day), budget, need)
    except Exception as e:  # as an unreadable spending: run it, billed all the same
        log.warning("the tenant's cap could not reserve the run's cost (%s); running", e)
        return None
    if isinstance(reserved, Ticket):
        return reserved
    if spent + need > budget:  # what it spent leaves no room for this run: the cap is reached
        return _capped(rt, spec, cap, tenant, spent, now)
    # Runs under way hold the rest; they settle (often under their estimates) as they end.
    why = f"tenant {tenant!r}'s runs under way hold the rest of its cap of {cap.per_day:g}"
    return park_until(spec, int(now.timestamp() * 1000) + 1000, why)


def _estimate_micros(cap: Cap, task: Any, mean: int | None, left: int) -> int:
    """The cost a run reserves: the cap's ``estimate``, else the day's mean run of the
    handler, else (none yet) all that is left of the cap, so the first runs alone."""
    if cap.estimate is None:
        return left if mean is None else mean
    try:
        value = float(cap.estimate(task))
    except Exception as e:  # the bill must not fail the task: reserve as without estimate=
        log.warning("the cap's estimate raised %s: %s", type(e).__name__, e)
        return left if mean is None else mean
    return max(0, round(value * MICROS))


def _capped(
    rt: Runtime, spec: HandlerSpec, cap: Cap, tenant: str, spent: int, now: datetime
) -> End | str:
    """The end (or the downgrade's model) of a task whose tenant reached its cap today."""
    rt.metrics.capped.labels(spec.queue, cap.action).inc()
    if cap.action == "downgrade":
        assert cap.model is not None
        return cap.model
    if cap.action == "shed":
        why = BudgetExceeded(
            f"tenant {tenant!r} spent {spent / MICROS:g} today, its cap is {cap.per_day:g}"
        )
        return DeadLetter(DeadLetterReason.BUDGET_EXCEEDED, why)
    tomorrow = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
    reached = f"tenant {tenant!r} reached its cap of {cap.per_day:g} for today"
    # One move: the midnight queue holds it until then (not ~84 hops through the ladder).
    return replace(park_until(spec, int(tomorrow.timestamp() * 1000), reached), at_midnight=True)

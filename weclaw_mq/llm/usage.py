"""What a run's model calls used and cost: the calls it reported (``run.usage``) costed with
the App's prices and recorded in the cost ledger (``state.cost_ledger``); and a tenant's daily
cap checked before its task runs (``policy.costs``).

Only a handler of an App with prices (or with a cap) has this part of its ``ModelCalls``
middleware (``llm.calls``): the common path makes no call for it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from weclaw_mq.contract.naming import cap_keys
from weclaw_mq.errors import BudgetExceeded
from weclaw_mq.handlers.middleware import DeadLetter, Defer, Run, Usage
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.llm.limiting import Limiter, Ticket
from weclaw_mq.observability.metrics import UNPRICED_MODEL, Metrics
from weclaw_mq.policy.costs import Cap, Price
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.state.cost_ledger import MICROS, NO_TENANT, Call, CostLedger, day_of
from weclaw_mq.state.steps import Usage as StepUsage

log = logging.getLogger("weclaw_mq.worker")

# Models reported without a price, warned about once per process (the first few: the names
# are handlers' strings).
_UNPRICED: set[str] = set()
UNPRICED_WARNED_MAX = 100
# How long a task waits when the runs under way hold the rest of its tenant's cap.
CAP_HELD_RETRY_S = 1.0


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


def charge(ticket: Ticket, run: Run, prices: Mapping[str, Price]) -> None:
    """Settle the run's reported calls into its ticket: tokens for its token limits, cost for
    its cap's reservation (both settled as the ticket is let go)."""
    for used in run.usage:
        if ticket.budgets:
            ticket.report(used.input_tokens + used.output_tokens, at=used.at)
        if ticket.spends:
            price = prices.get(used.model)
            if price is not None:
                ticket.report_cost(round(price.of(used.input_tokens, used.output_tokens) * MICROS))


def costed(
    metrics: Metrics,
    prices: Mapping[str, Price],
    spec: HandlerSpec,
    run: Run,
    used: Iterable[StepUsage],
) -> list[Call]:
    """The run's calls ``used`` ((model, input tokens, output tokens) each) costed with the
    App's prices, as the ledger records them (and counted in the tokens and cost metrics)."""
    tenant = tenant_of(spec, run.task)
    at = datetime.now(UTC).isoformat()
    calls = []
    for model, input_tokens, output_tokens in used:
        price = prices.get(model)
        if price is None and model not in _UNPRICED and len(_UNPRICED) < UNPRICED_WARNED_MAX:
            _UNPRICED.add(model)
            log.warning("model %r has no price in App(prices=...): its calls cost 0", model)
        cost = 0.0 if price is None else price.of(input_tokens, output_tokens)
        calls.append(
            Call(
                spec.queue,
                run.attempt,
                model,
                tenant,
                input_tokens,
                output_tokens,
                round(cost * MICROS),
                at,
            )
        )
        label = UNPRICED_MODEL if price is None else model
        metrics.tokens.labels(spec.queue, label, "input").inc(input_tokens)
        metrics.tokens.labels(spec.queue, label, "output").inc(output_tokens)
        metrics.cost.labels(spec.queue, label).inc(cost)
    return calls


def unbilled(usage: Sequence[Usage], billed: Sequence[StepUsage]) -> list[StepUsage]:
    """The run's calls (``run.usage``) less those its steps billed already (each once)."""
    left = Counter(billed)
    outside = []
    for used in usage:
        call = (used.model, used.input_tokens, used.output_tokens)
        if left[call] > 0:
            left[call] -= 1
        else:
            outside.append(call)
    return outside


async def within_cap(
    app_name: str,
    metrics: Metrics,
    ledger: CostLedger,
    limiter: Limiter | None,
    spec: HandlerSpec,
    task: Any,
) -> Ticket | str | Defer | DeadLetter | None:
    """The cap's answer before the limits take their slots: go on as is (None); with the
    run's cost reserved against the cap (a ``Ticket``, settled when the run ends); on the
    cap's cheaper model (its name, a downgrade); or parked or shed: the tenant spent its
    day's cap, or the runs under way hold the rest of it now (parked 1 s)."""
    cap = spec.cap
    assert cap is not None
    tenant = tenant_of(spec, task)
    now = datetime.now(UTC)
    day = day_of(now)
    try:
        spent, mean = await ledger.cap_reading(tenant, spec.queue, day)
    except Exception as e:  # the cap cannot tell: run it (the bill is recorded all the same)
        log.warning("the tenant's spending could not be read (%s); running uncapped", e)
        return None
    budget = cap.per_day_micros
    if spent >= budget:
        return _capped(metrics, spec, cap, tenant, spent, now)
    if limiter is None:
        return None
    need = _estimate_micros(cap, task, mean, budget - spent)
    try:
        reserved = await limiter.reserve(cap_keys(app_name, tenant, day), budget, need)
    except Exception as e:  # as an unreadable spending: run it, billed all the same
        log.warning("the tenant's cap could not reserve the run's cost (%s); running", e)
        return None
    if isinstance(reserved, Ticket):
        return reserved
    if spent + need > budget:  # what it spent leaves no room for this run: the cap is reached
        return _capped(metrics, spec, cap, tenant, spent, now)
    # Runs under way hold the rest; they settle (often under their estimates) as they end.
    why = f"tenant {tenant!r}'s runs under way hold the rest of its cap of {cap.per_day:g}"
    return Defer(why, after_s=CAP_HELD_RETRY_S, by="cap")


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
    metrics: Metrics, spec: HandlerSpec, cap: Cap, tenant: str, spent: int, now: datetime
) -> str | Defer | DeadLetter:
    """The answer (or the downgrade's model) for a task whose tenant reached its cap today."""
    metrics.capped.labels(spec.queue, cap.action).inc()
    if cap.action == "downgrade":
        assert cap.model is not None
        return cap.model
    if cap.action == "shed":
        why = BudgetExceeded(
            f"tenant {tenant!r} spent {spent / MICROS:g} today, its cap is {cap.per_day:g}"
        )
        return DeadLetter(why, DeadLetterReason.BUDGET_EXCEEDED.value)
    tomorrow = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
    reached = f"tenant {tenant!r} reached its cap of {cap.per_day:g} for today"
    # Until the next UTC midnight: one move through the midnight queue, not ~84 hops.
    return Defer(reached, until=tomorrow, by="cap")

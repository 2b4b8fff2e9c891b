"""A handler's LLM features as one middleware on the public seam (``handlers.middleware``):
its tenant's daily cap, its model fallback chain, its limits by requests and tokens, and the
recording of what its runs' model calls cost. The worker knows none of them: it runs the
handler's middleware after the App's (``App.handler_chain``).

In ``admit``, in this order: the cap (a tenant past it is parked, shed or downgraded; a run's
estimated cost is reserved), the fallback chain's model (``run.model``), the limits' slots
(per model too). In ``before_run``: the run's steps given their biller (``state.steps``), so
a step's calls go to the cost ledger as its record is written. In ``after_call``: the slots
and the reservation settled with all the calls the run reported (``run.usage``, its steps'
included: they used the provider's tokens), the calls not billed by a step recorded in the
cost ledger, and the model's health told how the attempt went. ``let_go`` frees the slots
and the reservation of a run that did not end its call here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence

from weclaw_mq.errors import InvalidPayload, StateCommandError
from weclaw_mq.handlers.middleware import CallEnd, Chain, DeadLetter, Defer, Middleware, Run
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.llm import fallbacks
from weclaw_mq.llm.limiting import NO_TICKET, Held, Ticket
from weclaw_mq.llm.resources import ModelResources
from weclaw_mq.llm.usage import charge, costed, unbilled, within_cap
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.policy.costs import Price
from weclaw_mq.policy.failures import describe
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.settings import Settings
from weclaw_mq.state.cost_ledger import Call, CostLedger
from weclaw_mq.state.steps import Usage as StepUsage
from weclaw_mq.state.steps import step_billing

log = logging.getLogger("weclaw_mq.worker")

# Where a run keeps what this middleware took for it (``run.state``).
_HELD = "weclaw_mq.llm"


class _Held:
    """What one run holds: its slots and cost reservation, whether its model is the fallback
    chain's (a cap's downgrade is not), and the calls its steps billed already."""

    __slots__ = ("billed", "chained", "ticket", "unrecorded")

    def __init__(self) -> None:
        self.ticket: Ticket = NO_TICKET
        self.chained = False
        self.billed: list[StepUsage] = []
        # A step's costed calls whose ledger write failed: tried again at the attempt's end.
        self.unrecorded: list[Call] = []


class ModelCalls(Middleware):
    """One handler's cap, fallback chain, limits and cost recording (those it has).

    Args:
        app_name: The App's name (its caps' keys).
        settings: The App's settings (``guard_on_redis_down``).
        metrics: The App's metrics.
        prices: The App's prices.
        spec: The handler.
        resources: The App's limiter, ledger and models' health (open while it runs).
    """

    def __init__(
        self,
        app_name: str,
        settings: Settings,
        metrics: Metrics,
        prices: Mapping[str, Price],
        spec: HandlerSpec,
        resources: ModelResources,
    ) -> None:
        self._app_name = app_name
        self._unguarded = settings.guard_on_redis_down == "run_unguarded"
        self._metrics = metrics
        self._prices = prices
        self._spec = spec
        self._resources = resources

    def __repr__(self) -> str:
        return f"ModelCalls({self._spec.queue!r})"

    async def admit(self, run: Run) -> Defer | DeadLetter | None:
        spec, resources = self._spec, self._resources
        held = run.state[_HELD] = _Held()
        if spec.cap is not None and resources.ledger is not None:
            capped = await within_cap(
                self._app_name,
                self._metrics,
                resources.ledger,
                resources.limiter,
                spec,
                run.task,
            )
            if isinstance(capped, Ticket):
                held.ticket = capped  # the run's cost, reserved until it ends
            elif isinstance(capped, str):
                run.model = capped  # downgraded: the run gets the cap's cheaper model
            elif capped is not None:
                return capped
        if spec.fallback is not None and run.model is None:  # a downgrade is outside it
            chosen = await fallbacks.model_for(resources.health, spec, run)
            if isinstance(chosen, Defer):
                held.ticket.release()
                return chosen
            run.model, held.chained = chosen, True
        if spec.limits and resources.limiter is not None:
            limited = await self._within_limits(run)
            if not isinstance(limited, Ticket):
                held.ticket.release()
                return limited
            held.ticket = limited.joined(held.ticket)
        return None

    async def _within_limits(self, run: Run) -> Ticket | Defer | DeadLetter:
        """The limits' ticket (its slots freed as the run ends), or the answer of a task that
        may not start: parked (over a limit, or Redis down) or dead-lettered (a key function
        failed)."""
        spec, limiter = self._spec, self._resources.limiter
        assert limiter is not None
        try:
            answer = await limiter.admit(spec.queue, spec.limits, run.task, run.size, run.model)
        except InvalidPayload as e:
            return DeadLetter(e, DeadLetterReason.INVALID_PAYLOAD.value)
        except StateCommandError as e:  # as for the guard
            log.error("the limits' store refused the admission: %s", e)
            return Defer("Redis refused the limits' command", by="limit")
        except Exception as e:  # Redis unreachable or failing: as for the guard
            if self._unguarded:
                log.warning("limits unavailable (%s); running UNLIMITED as configured", e)
                return NO_TICKET
            log.warning("limits unavailable (%s: %s)", type(e).__name__, e)
            return Defer("Redis is down, the limits cannot tell", by="limit")
        if not isinstance(answer, Held):
            return answer
        self._metrics.limit_deferred(spec.queue, answer.kind).inc()
        # Routine under load (one line per deferral would drown the log): the metric counts.
        why = f"over its {answer.kind} limit"
        return Defer(why, after_s=answer.delay_ms / 1000, by="limit", quiet=True)

    async def before_run(self, run: Run) -> None:
        held: _Held | None = run.state.get(_HELD)
        ledger = self._resources.ledger
        if held is not None and ledger is not None:  # the handler's steps bill as they end
            step_billing.set(functools.partial(self._bill_step, run, held, ledger))

    async def _bill_step(
        self, run: Run, held: _Held, ledger: CostLedger, used: Sequence[StepUsage]
    ) -> None:
        """Record a fresh step's calls in the ledger, before its record is written (a write
        that failed is tried again at the attempt's end)."""
        calls = costed(self._metrics, self._prices, self._spec, run, used)
        held.billed.extend(used)
        try:
            # Written even when the handler is cancelled meanwhile: the call was made.
            await asyncio.shield(ledger.record(run.task_id, calls))
        except Exception as e:
            log.warning("could not record a step's model usage yet (%s)", describe(e))
            held.unrecorded.extend(calls)

    async def after_call(self, run: Run, call: CallEnd) -> BaseException | Defer | None:
        held: _Held | None = run.state.pop(_HELD, None)
        if held is None:  # admitted by none of ours (an earlier admit hook failed it)
            return None
        ticket = held.ticket
        if ticket is not NO_TICKET:  # its slots freed as the handler ended, however
            # Every real call of the attempt, its steps' too: they used the window's tokens.
            charge(ticket, run, self._prices)
            ticket.ended(call.error)
            ticket.release()
        ledger = self._resources.ledger
        if ledger is not None and run.usage:  # recorded before the task's end is
            outside = unbilled(run.usage, held.billed)  # the steps' calls are billed already
            calls = held.unrecorded + costed(self._metrics, self._prices, self._spec, run, outside)
            try:
                await ledger.record(run.task_id, calls, run_of=self._spec.queue)
            except Exception as e:  # the task's outcome does not depend on its bill
                log.warning("could not record the task's model usage (%s)", describe(e))
        if not held.chained or run.model is None or call.cancelled or not call.started:
            return None
        answer = await fallbacks.after_attempt(
            self._resources.health, self._metrics, self._spec, run, run.model, call.error
        )
        return None if answer is call.error else answer

    def let_go(self, run: Run) -> None:
        held: _Held | None = run.state.pop(_HELD, None)
        if held is not None:
            held.ticket.release()


def handler_chain(
    chain: Chain,
    resources: ModelResources,
    app_name: str,
    settings: Settings,
    metrics: Metrics,
    prices: Mapping[str, Price],
    spec: HandlerSpec,
) -> Chain | None:
    """The middleware a handler's runs pass: the App's ``chain``, then a ``ModelCalls`` when
    the handler has a cap, a fallback chain or limits, or its App costs runs; None when no
    hook runs."""
    own: list[Middleware] = []
    needed = spec.cap is not None or spec.fallback is not None or spec.limits or prices
    if needed:
        own.append(ModelCalls(app_name, settings, metrics, prices, spec, resources))
    joined = chain.joined(own)
    return joined if joined.runs else None

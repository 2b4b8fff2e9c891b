"""One delivery, start to end: read -> admit -> call -> end.

``process`` reads the delivery, passes it through the gates (``admission``), runs the handler
(``running``) and hands the ``End`` each of them answers with to ``ends.carry_out``, the one
place that settles. Nothing acks before the handler returned and its result was stored; every
path either ends in ``carry_out`` or raises, and then the worker gives the message back
(``in_flight.settled``). Whatever the handler does (returns anything, raises anything,
ignores its cancellation) ends the attempt as a success or a failure with a reason; only a
cancel of the delivery's own task (the worker stopping hard) escapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.message import Delivery, read_delivery
from weclaw_mq.contract.undecodable import undecodable
from weclaw_mq.errors import InvalidPayload, UndecodableBody, WorkerCrashLoop
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability import tracing
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.state import TaskStatus
from weclaw_mq.worker import fallbacks, run_hooks
from weclaw_mq.worker.admission import (
    Unguarded,
    cancelled_before_start,
    expired_on_arrival,
    parked_until_due,
    pass_guard,
    within_limits,
)
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.ends import (
    AckCancelled,
    DeadLetter,
    Defer,
    End,
    RejectOriginal,
    after_attempt,
    carry_out,
)
from weclaw_mq.worker.limiting import NO_TICKET, Ticket
from weclaw_mq.worker.records import record_status, release
from weclaw_mq.worker.run_hooks import run_of
from weclaw_mq.worker.running import call_handler, take_over
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.sync_threads import NoThreadFree
from weclaw_mq.worker.usage import RunUsage, record_usage, within_cap

__all__ = ["process"]

# How long a delivery that is being given back (a hard stop, a bug of ours) waits to release
# its claim first.
RELEASE_ON_EXIT_S = 1.0

# Read once: on Python 3.11 every ``EnumClass.MEMBER`` is a descriptor call, per use.
_RUNNING = TaskStatus.RUNNING
# What a delivery that holds no claim keeps alive: nothing (reentrant, shared).
_NOT_HELD = contextlib.nullcontext()


async def process(message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime) -> None:
    delivery = read_delivery(message, spec.queue)
    token = tracing.enter(delivery)  # the delivery is its own trace context
    # Watched from before the claim: a cancel request is never missed in between.
    watch = rt.cancels.watch(spec.queue, delivery.task_id, delivery.attempt)
    try:
        if rt.spans is None:
            await _process(message, delivery, spec, rt, watch)
        else:
            with rt.spans.handling(spec.queue, delivery):
                await _process(message, delivery, spec, rt, watch)
    finally:
        rt.cancels.unwatch(watch)
        tracing.leave(token)


async def _process(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    watch: Watch,
) -> None:
    if h.UNDECODABLE_PROPERTIES in delivery.headers and undecodable(delivery.headers) is not None:
        # Its properties did not decode (the worker reads them tolerantly, see Worker.run), so
        # no copy of it can be built: the broker moves the original to Q.dlq, where the DLQ
        # tools show it as "undecodable_properties". (The membership test first: the common
        # delivery pays no call.)
        await carry_out(RejectOriginal(), message, delivery, spec, rt)
        return
    if delivery.returns > spec.delivery_limit:
        # The broker enforces the limit within one stint in Q; this catches a task that
        # keeps killing workers while hopping through the guard's delay queue.
        crash = WorkerCrashLoop(
            f"the task went back unsettled {delivery.returns} times (its worker died or "
            f"lost its connection); delivery limit {spec.delivery_limit}"
        )
        await carry_out(
            DeadLetter(DeadLetterReason.DELIVERY_LIMIT, crash), message, delivery, spec, rt
        )
        return
    if len(delivery.body) > rt.settings.max_message_bytes:
        # The same bound as publish: another producer's huge body is not parsed or stored.
        too_large = InvalidPayload(
            f"the body is {len(delivery.body)} bytes, over max_message_bytes "
            f"({rt.settings.max_message_bytes})"
        )
        await carry_out(
            DeadLetter(DeadLetterReason.INVALID_PAYLOAD, too_large), message, delivery, spec, rt
        )
        return
    # Asked only of a task that carries a not-before time (a delayed publish, a retry).
    if h.NOT_BEFORE in delivery.headers:
        parked = parked_until_due(delivery, spec)
        if parked is not None:
            await carry_out(parked, message, delivery, spec, rt)
            return
    circuit = rt.circuits.get(spec.queue)
    if circuit is not None and not circuit.admits(message):
        # Delivered as the breaker opened (or waiting for a lane slot): parked, no attempt.
        why = f"the circuit breaker of {spec.queue!r} is {circuit.state}"
        await carry_out(Defer(why, by="breaker"), message, delivery, spec, rt)
        return
    try:
        task = spec.parse(delivery.body)
    except UndecodableBody as e:
        await carry_out(DeadLetter(DeadLetterReason.UNDECODABLE, e), message, delivery, spec, rt)
        return
    except InvalidPayload as e:
        invalid = DeadLetter(DeadLetterReason.INVALID_PAYLOAD, e)
        await carry_out(invalid, message, delivery, spec, rt)
        return

    held: str | None = None  # the claim's owner token, while we hold the claim
    if rt.store is not None and spec.idempotent:
        gate = await pass_guard(delivery, spec, rt.store, rt)
        if isinstance(gate, str):
            held = gate
        elif not isinstance(gate, Unguarded):
            await carry_out(gate, message, delivery, spec, rt)
            return
    if h.EXPIRES_AT in delivery.headers:
        late = await expired_on_arrival(delivery, spec, rt, held)
        if late is not None:
            await carry_out(late, message, delivery, spec, rt, held)
            return
    # Only a request, or the marker of a delivery that claims nothing, can cancel it here:
    # the common path pays no call.
    if watch.requested or (rt.store is not None and not spec.idempotent):
        cancelled = await cancelled_before_start(delivery, spec, rt, watch)
        if cancelled is not None:
            await carry_out(cancelled, message, delivery, spec, rt, held)
            return
    model: str | None = None
    reserved = NO_TICKET  # the run's estimated cost, reserved against its tenant's cap
    if spec.cap is not None:  # the tenant's daily cap: before the limits take their slots
        capped = await within_cap(rt, spec, task)
        if isinstance(capped, Ticket):
            reserved = capped
        elif isinstance(capped, str):
            model = capped  # downgraded: the run gets the cap's cheaper model
        elif capped is not None:
            await carry_out(_by(capped, "cap"), message, delivery, spec, rt, held)
            return
    # A fallback chain's model: the first up that the task has not failed on.
    chained = spec.fallback is not None and model is None
    if chained:
        chosen = await fallbacks.model_for(rt, spec, delivery)
        if not isinstance(chosen, str):
            reserved.release()
            await carry_out(_by(chosen, "fallback"), message, delivery, spec, rt, held)
            return
        model = chosen
    if model is not None:
        delivery.model = model  # on its records: the status says which model runs it
    ticket = NO_TICKET
    if spec.limits and rt.limiter is not None:
        admitted = await within_limits(spec, rt, rt.limiter, task, len(delivery.body), model)
        if not isinstance(admitted, Ticket):
            reserved.release()
            await carry_out(_by(admitted, "limit"), message, delivery, spec, rt, held)
            return
        ticket = admitted
    if reserved is not NO_TICKET:  # settled as the handler ends, with the limits' slots
        ticket = ticket.joined(reserved)

    # Without a claim (that wrote it), the "running" record is written beside the handler:
    # a model call need not wait for it. Again with one when the claim's record could not
    # name the attempt's model yet (chosen after the claim).
    running = (
        asyncio.create_task(record_status(rt, delivery, spec, _RUNNING))
        if rt.results is not None and (held is None or model is not None)
        else None
    )
    # The claim's lease is kept from the handler's start until its ending returned (a result
    # write that retries included): a lapsed lease would let a copy run the task again.
    hold = (
        rt.store.holding(spec.queue, delivery.task_id, held)
        if held is not None and rt.store is not None
        else _NOT_HELD
    )
    # The run's model calls (ctx.usage), where they are costed or settle a token limit.
    usage = (
        RunUsage(ticket, model, rt.app.prices) if rt.ledger is not None or ticket.budgets else None
    )
    report = None if usage is None else usage.report
    begun: run_hooks.Begun | None = None
    try:
        with hold:
            if rt.hooks is not None:  # the middleware's run: its before_run in call_handler
                begun = run_hooks.begin(rt.hooks, run_of(delivery, spec, task))
            # If the handler ignores its cancellation, another task ends the attempt without
            # it (a partial, not a closure: made for every delivery, called for almost none).
            on_stuck = functools.partial(take_over, message, delivery, spec, rt, held, watch, begun)
            outcome: tuple[Any, BaseException | None] | None
            if ticket is NO_TICKET:
                # The common path: no limit's slot to free.
                outcome = await call_handler(
                    spec, task, delivery, rt, on_stuck, watch, report, model, begun
                )
            else:
                with ticket:  # the limits' slots are freed as the handler ends, however it ends
                    outcome = await call_handler(
                        spec,
                        task,
                        delivery,
                        rt,
                        on_stuck,
                        watch,
                        report,
                        model,
                        begun,
                    )
                    ticket.ended(outcome)
            # No thread took a plain def's call: it never started, so no attempt is spent.
            unstarted = outcome is not None and type(outcome[1]) is NoThreadFree
            if outcome is not None and circuit is not None and not unstarted:
                circuit.outcome(message, outcome[1])
            if running is not None:
                await running
            if outcome is None:  # abandoned, and the task that took over settled it
                return
            if usage is not None and usage.calls:  # recorded before the task's end is
                await record_usage(rt, delivery, spec, task, usage)
            probed: Defer | None = None  # a failed probe of a model: parked, no attempt spent
            if chained and model is not None and not watch.requested and not unstarted:
                error = await fallbacks.after_attempt(rt, spec, delivery, model, outcome[1])
                if isinstance(error, Defer):
                    probed = error
                else:
                    outcome = (outcome[0], error)
            # Cancelled while it ran: whatever it returned or raised no longer counts (a
            # failure is not retried).
            end: End
            if watch.requested:
                end = AckCancelled()
            elif unstarted:
                end = Defer(str(outcome[1]), queued_again=True, by="threads")
            elif probed is not None:
                end = _by(probed, "fallback")
            else:
                end = after_attempt(delivery, spec, outcome[0], outcome[1])
            await carry_out(end, message, delivery, spec, rt, held)
        if begun is not None:  # settled: the lease is no longer kept while they run
            await run_hooks.finish(begun, outcome[0], outcome[1])
    except BaseException as e:
        if begun is not None:
            await run_hooks.given_back(begun, e)
        # Stopping hard, or a bug of ours: the worker gives the message back. Free the claim
        # so the next delivery runs at once, not after the lease (owner-checked: a no-op once
        # the task is done or another worker holds it).
        if running is not None:
            running.cancel()
        # Bounded: the message is given back only after this, and a stop promises that
        # within DRAIN_CANCEL_S even when the store hangs (the lease lapses by itself).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release(rt, spec, delivery, held), RELEASE_ON_EXIT_S)
        raise


def _by(end: End, by: str) -> End:
    """A gate's deferral, saying which gate: its record and its first log line say so."""
    return dataclasses.replace(end, by=by) if type(end) is Defer else end

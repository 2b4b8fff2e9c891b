"""One delivery, start to end: a pipeline of stages, and its one ending carried out.

``process`` reads the delivery and passes it through its stages: ``admission.admit`` (the
checks, the guard's claim, then the middleware's ``admit`` hooks: the App's and the handler's
own, its cap, fallback chain and limits among them, ``weclaw_mq.llm``), then ``_run`` (the
handler, the middleware's ``after_call`` hooks, and what its outcome becomes). Each stage
answers "go on" (None) or an ``End``; ``_process`` hands the one ``End`` to ``ends.carry_out``,
the one place that settles, once. No stage settles, releases or publishes a move
(``tests/unit/test_settle_point.py``). Nothing acks before the handler returned and its result
was stored; a path that raises is given back by the worker (``in_flight.settled``). Whatever the
handler does (returns anything, raises anything, ignores its cancellation) ends the attempt as a
success or a failure with a reason; only a cancel of the delivery's own task (the worker
stopping hard) escapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.contract.message import Delivery, read_delivery
from weclaw_mq.handlers.middleware import CallEnd
from weclaw_mq.handlers.middleware import Defer as Deferred
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability import tracing
from weclaw_mq.state import TaskStatus
from weclaw_mq.worker import run_hooks
from weclaw_mq.worker.admission import admit
from weclaw_mq.worker.admit_hooks import admitted, called_back, parked
from weclaw_mq.worker.attempt import Attempt, Gate, Pipeline
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.ends import AckCancelled, Defer, End, after_attempt, carry_out
from weclaw_mq.worker.long_runs import detach, hand_over
from weclaw_mq.worker.records import record_status, release
from weclaw_mq.worker.run_hooks import run_of
from weclaw_mq.worker.running import call_handler, take_over
from weclaw_mq.worker.runtime import Runtime
from weclaw_mq.worker.sync_threads import NoThreadFree

__all__ = ["process"]

# How long a delivery that is being given back (a hard stop, a bug of ours) waits to release
# its claim first.
RELEASE_ON_EXIT_S = 1.0
# How long a long run of a stopping worker has to hand itself over (a publish with confirm,
# then the watch and the claim): inside the stop's DRAIN_CANCEL_S.
HAND_OVER_S = 3.0

# Read once: on Python 3.11 every ``EnumClass.MEMBER`` is a descriptor call, per use.
_RUNNING = TaskStatus.RUNNING


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
    a = Attempt(message, delivery, spec, rt, watch, rt.pipelines.get(spec.queue) or _made(spec, rt))
    try:
        end = await admit(a)
        if a.taken_over:  # an admit hook ignored its cancellation: ended by another task
            return
        if end is None and a.held is not None and rt.store is not None:
            # The claim's lease is kept from the handler's start until its ending returned (a
            # result write that retries included): a lapsed lease would let a copy run it.
            with rt.store.holding(spec.queue, delivery.task_id, a.held):
                if spec.long_running and rt.long_runs is not None:
                    a.long_run = await detach(rt, spec, delivery, message)
                    if a.long_run is None:  # not begun: given back, or the store failed
                        if not message.processed:
                            end = Defer("the long run's watch could not begin")
                        else:
                            await release(rt, spec, delivery, a.held)
                            return
                await _to_the_end(a, end)
        else:
            await _to_the_end(a, end)
        begun = a.begun
        if begun is not None and a.outcome is not None and begun.hooks.afters:  # settled
            await run_hooks.finish(begun, a.outcome[0], a.outcome[1])  # no lease kept
    except BaseException as e:
        if a.begun is not None:
            await run_hooks.given_back(a.begun, e)
        # Stopping hard, or a bug of ours: the worker gives the message back. Free the claim
        # (and what the middleware took: the limits' slots) so the next delivery runs at
        # once, not after the lease (owner-checked: a no-op once the task is done or another
        # worker holds it).
        if a.recording is not None:
            a.recording.cancel()
        a.let_go()
        # Bounded: the message is given back only after this, and a stop promises that
        # within DRAIN_CANCEL_S even when the store hangs (the lease lapses by itself). A long
        # run holds no message: it is handed over (its watch copy brings it back if not).
        letting_go = (
            release(rt, spec, delivery, a.held)
            if a.long_run is None
            else hand_over(rt, spec, delivery, message, a.long_run, a.held)
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                letting_go, RELEASE_ON_EXIT_S if a.long_run is None else HAND_OVER_S
            )
        raise


async def _to_the_end(a: Attempt, end: End | None) -> None:
    """Run the handler when every gate let it (``end`` None), then carry out the delivery's
    one end: the only call of ``carry_out`` on a delivery's path."""
    if end is None:
        end = await _run(a)
        if end is None:  # abandoned, and the task that took over settled it
            return
    await carry_out(end, a.message, a.delivery, a.spec, a.rt, a.held, a.long_run)


async def _run(a: Attempt) -> End | None:
    """The handler's run and what its outcome becomes; None when the handler ignored its
    cancellation and the task that took over ended the attempt without it."""
    delivery, spec, rt, hooks = a.delivery, a.spec, a.rt, a.pipeline.hooks
    # Without a claim (that wrote it), the "running" record is written beside the handler:
    # a model call need not wait for it. Again with one when the claim's record could not
    # name the attempt's model yet (chosen after the claim).
    if rt.results is not None and (a.held is None or a.model is not None):
        a.recording = asyncio.create_task(record_status(rt, delivery, spec, _RUNNING))
    report: Callable[[int, int, str | None], None] | None = None
    if hooks is not None:  # the middleware's run: its before_run in call_handler
        run = a.run = a.run or run_of(delivery, spec, a.task)
        run.model = a.model
        a.begun = run_hooks.begin(hooks, run)
        report = run_hooks.reporting(run)  # the run's model calls (ctx.usage), in run.usage
    # If the handler ignores its cancellation, another task ends the attempt without it (a
    # partial, not a closure: made for every delivery, called for almost none).
    on_stuck = functools.partial(take_over, a)
    outcome = await call_handler(a, on_stuck, report)
    # No thread took a plain def's call: it never started, so no attempt is spent.
    unstarted = outcome is not None and type(outcome[1]) is NoThreadFree
    circuit = a.pipeline.circuit
    if outcome is not None and circuit is not None and not unstarted:
        circuit.outcome(a.message, outcome[1])
    if a.recording is not None:
        await a.recording
    if outcome is None:
        a.let_go()  # abandoned: what the middleware took is freed as the handler ended
        return None
    deferred: End | None = None  # an after_call hook's Defer: parked, no attempt spent
    if hooks is not None and hooks.calls and a.run is not None:
        a.admitted = False  # told here, not let go
        call = CallEnd(outcome[0], outcome[1], a.watch.requested, not unstarted)
        answer = await called_back(a, call)  # under the handler's timeout, counted afresh
        if a.taken_over:  # a hook ignored its cancellation: another task ended the attempt
            return None
        if isinstance(answer, Deferred):
            deferred = parked(answer, spec)
        elif answer is not None:
            outcome = (None, answer)
    a.outcome = outcome
    # Cancelled while it ran: whatever it returned or raised no longer counts (a failure is
    # not retried).
    if a.watch.requested:
        return AckCancelled()
    if unstarted:
        return Defer(str(outcome[1]), queued_again=True, by="threads")
    if deferred is not None:
        return deferred
    return after_attempt(delivery, spec, outcome[0], outcome[1])


def _made(spec: HandlerSpec, rt: Runtime) -> Pipeline:
    """The handler's pipeline in this worker, made at its first delivery: its middleware
    (the App's, then its own: ``App.handler_chain``), whose admit hooks are its gate."""
    hooks = rt.app.handler_chain(spec) if rt.handler_middleware else rt.hooks
    gates: list[Gate] = []
    if hooks is not None and hooks.admits:
        gates.append(admitted)
    made = Pipeline(
        tuple(gates), rt.circuits.get(spec.queue), rt.metrics.handler_timing(spec.queue), hooks
    )
    rt.pipelines[spec.queue] = made
    return made

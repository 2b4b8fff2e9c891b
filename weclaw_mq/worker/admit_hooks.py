"""The middleware's ``admit`` hooks (``handlers.middleware``) as the gate of a handler's
pipeline, after the worker's own checks: the App's hooks, then the handler's own (its cap,
fallback chain and limits, ``weclaw_mq.llm``), so a task the team's own rule parks takes no
slot.

The hooks run under the handler's ``timeout_s`` with the claim's lease kept: past it, the
attempt fails as a ``HandlerTimeout`` (retried or dead-lettered by the handler's policy), as a
handler past its deadline does. An exception of theirs is the attempt's failure (``Reject``:
the DLQ now). A ``Defer`` parks the task without spending an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.errors import HandlerTimeout
from weclaw_mq.handlers.middleware import CallEnd
from weclaw_mq.handlers.middleware import DeadLetter as DeadLettered
from weclaw_mq.handlers.middleware import Defer as Deferred
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.wire.connection import cancelled_by_caller
from weclaw_mq.worker.admission import park_until
from weclaw_mq.worker.attempt import Attempt
from weclaw_mq.worker.deadlines import Deadline
from weclaw_mq.worker.ends import DeadLetter, Defer, End, GiveBack, after_attempt
from weclaw_mq.worker.run_hooks import run_of
from weclaw_mq.worker.running import take_over


async def admitted(a: Attempt) -> End | None:
    """Run the ``admit`` hooks: None to go on, else the end their answer (or failure) is.

    A hook still running ``handler_cancel_grace_s`` after its cancellation at the timeout is
    left behind as a stuck handler is: another task ends the attempt (``running.take_over``)
    and ``a.taken_over`` tells the delivery's task to settle nothing."""
    spec, rt, hooks = a.spec, a.rt, a.pipeline.hooks
    assert hooks is not None  # in the pipeline only with admit hooks
    run = a.run = run_of(a.delivery, spec, a.task)
    held = a.held is not None and rt.store is not None
    grace_s = rt.settings.handler_cancel_grace_s
    stuck = functools.partial(_stuck, a, "an admit hook")
    deadline = Deadline(rt.deadlines, spec.timeout_s, stuck, grace_s)
    holding = (
        rt.store.holding(spec.queue, a.delivery.task_id, a.held)  # type: ignore[union-attr,arg-type]
        if held
        else contextlib.nullcontext()
    )
    end: End | None
    try:
        with holding, deadline:
            answer = await hooks.admit(run)
            if answer is not None and not isinstance(answer, Deferred | DeadLettered):
                raise TypeError(
                    f"an admit hook returned {answer!r}: None, a weclaw_mq.Defer or a "
                    "weclaw_mq.DeadLetter"
                )
    except asyncio.CancelledError as e:
        if cancelled_by_caller():
            raise
        end = after_attempt(a.delivery, spec, None, e)  # raised by a hook itself
    except Exception as e:
        if isinstance(e, TimeoutError) and deadline.expired:
            e = HandlerTimeout(f"admit hooks ran past the handler's timeout of {spec.timeout_s} s")
        end = after_attempt(a.delivery, spec, None, e)
    else:
        if answer is None:
            a.admitted = True
            a.model = run.model
            end = None
        elif isinstance(answer, DeadLettered):
            end = DeadLetter(DeadLetterReason(answer.reason), answer.error)
        else:
            end = parked(answer, spec)
    # Taken over: the later gates must not run, and ``_process`` carries out no end.
    return _TAKEN_OVER if a.taken_over else end


async def called_back(a: Attempt, call: CallEnd) -> BaseException | Deferred | None:
    """Run the ``after_call`` hooks: their answer (None, the error the retry policy sees, a
    ``Defer``), or the attempt's failure they became (a hook's exception; a ``HandlerTimeout``
    past the handler's ``timeout_s``, counted afresh: the claim's lease is kept meanwhile and
    no longer). One that ignores its cancellation is left behind as a stuck handler is
    (``a.taken_over``: the delivery's task settles nothing more)."""
    spec, rt, hooks, run = a.spec, a.rt, a.pipeline.hooks, a.run
    assert hooks is not None and run is not None  # only for a run of a chain with such hooks
    stuck = functools.partial(_stuck, a, "an after_call hook")
    deadline = Deadline(rt.deadlines, spec.timeout_s, stuck, rt.settings.handler_cancel_grace_s)
    try:
        with deadline:
            answer = await hooks.after_call(run, call)
    except asyncio.CancelledError as e:
        if cancelled_by_caller():
            raise
        return e  # raised by a hook itself
    except Exception as e:
        if isinstance(e, TimeoutError) and deadline.expired:
            why = f"after_call hooks ran past the handler's timeout of {spec.timeout_s} s"
            return HandlerTimeout(why)
        return e
    if answer is None or isinstance(answer, BaseException | Deferred):
        return answer
    return TypeError(f"an after_call hook returned {answer!r}: None, an exception or a Defer")


# What the gate answers once another task ended the attempt: it stops the later gates and is
# never carried out (``delivery._process`` reads ``taken_over`` first).
_TAKEN_OVER = GiveBack("an admit hook was abandoned; the task that took over ended it")


def _stuck(a: Attempt, what: str, stuck: asyncio.Task[Any]) -> None:
    """The deadline's call for a hook still running a grace after its cancellation."""
    a.taken_over = what
    take_over(a, stuck)


def parked(answer: Deferred, spec: HandlerSpec) -> End:
    """The worker's end for a hook's ``Defer``: parked until its time (the next UTC midnight
    in one hop, through the midnight queue), or for the handler's first retry delay."""
    level = logging.DEBUG if answer.quiet else None
    if answer.until is None and answer.after_s is None:
        return Defer(answer.why, level=level, queued_again=True, by=answer.by)
    if answer.until is not None:
        due_ms = round(answer.until.timestamp() * 1000)
    else:
        due_ms = now_ms() + round((answer.after_s or 0) * 1000)
    end = park_until(spec, due_ms, answer.why)
    return Defer(
        end.why,
        delay_ms=end.delay_ms,
        level=level,
        queued_again=True,
        not_before_ms=end.not_before_ms,
        by=answer.by,
        at_midnight=due_ms == _next_midnight_ms(),
    )


def _next_midnight_ms() -> int:
    today = datetime.now(UTC).date()
    midnight = datetime.combine(today + timedelta(days=1), datetime.min.time(), UTC)
    return round(midnight.timestamp() * 1000)

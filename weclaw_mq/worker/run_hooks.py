"""The middleware's run hooks around one handler run (``handlers.middleware``).

Only a worker whose App has run middleware comes here (``Runtime.hooks``); the common path
makes no call. ``before_run`` runs under the handler's own deadline and cancel watch
(``running.call_handler``): a hook that sleeps past the timeout ends the attempt as a
``HandlerTimeout``, one that ignores its cancellation is abandoned like a stuck handler.
``after_run`` runs after the settle, bounded by ``AFTER_RUN_TIMEOUT_S``: a hook that hangs
is cancelled (or left behind) and holds neither the worker's slot nor the claim.
``after_run`` is called exactly once per run that ``before_run`` saw: by the
delivery once its ending was carried out, or, for a handler abandoned at its deadline, by the
task that ended the attempt without it (``running.take_over``). The outcome it reports is the
one the Settler counted (``settle.settled_as``), so a decided success whose result could not
be stored reads ``requeued``, never ``acked``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weclaw_mq.contract.message import Delivery
from weclaw_mq.handlers.middleware import Chain, Run, RunEnd, Usage
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.worker.records import session_of
from weclaw_mq.worker.settle import settled_as

log = logging.getLogger("weclaw_mq.middleware")

# How long the after_run hooks of a delivery being given back (a hard stop) may take.
AFTER_RUN_ON_EXIT_S = 1.0
# How long the after_run hooks of a settled attempt may take: the message is settled, so past
# this they are cancelled, and left behind if they ignore that (the slot is freed).
AFTER_RUN_TIMEOUT_S = 5.0


def run_of(delivery: Delivery, spec: HandlerSpec, task: Any) -> Run:
    """The ``Run`` the middleware sees for this delivery."""
    return Run(
        task_id=delivery.task_id,
        trace_id=delivery.trace_id,
        queue=spec.queue,
        attempt=delivery.attempt,
        redelivered=delivery.redelivered,
        headers=delivery.headers,
        task=task,
        session_id=session_of(delivery),
        size=len(delivery.body),
    )


@dataclass
class Begun:
    """A hooked run between its ``before_run`` and ``after_run`` hooks."""

    hooks: Chain
    run: Run
    started: float
    # The outcomes the Settler counts while this delivery is settled (settle.settled_as).
    seen: list[Outcome]
    # A before_run hook's exception: the attempt's failure, the handler not called.
    failed: Exception | None = None
    reported: bool = False


def begin(hooks: Chain, run: Run) -> Begun:
    """A hooked run, in the delivery's own task: from here the Settler notes this delivery's
    outcome. Its ``before_run`` hooks run in ``before``, under the handler's deadline."""
    begun = Begun(hooks, run, time.perf_counter(), [])
    if hooks.afters:
        settled_as.set(begun.seen)
    return begun


def reporting(run: Run) -> Callable[[int, int, str | None], None]:
    """Where ``ctx.usage`` reports a hooked run's model calls: ``run.usage``, in order, each
    with the time it was reported."""
    usage = run.usage

    def report(input_tokens: int, output_tokens: int, model: str | None) -> None:
        usage.append(Usage(model or run.model or "-", input_tokens, output_tokens))

    return report


async def before(begun: Begun) -> Exception | None:
    """The ``before_run`` hooks (``running.call_handler`` awaits them under the handler's
    deadline, in the delivery's task: what they set in context vars, the handler sees); the
    exception that failed the attempt, or None."""
    begun.failed = await begun.hooks.before_run(begun.run)
    return begun.failed


async def finish(begun: Begun, result: Any, error: BaseException | None) -> None:
    """The ``after_run`` hooks, once the attempt's ending was carried out (bounded)."""
    await _bounded(begun, _end(begun, result, error), AFTER_RUN_TIMEOUT_S)


async def given_back(begun: Begun, error: BaseException) -> None:
    """The ``after_run`` hooks of a delivery given back by an exception (a hard stop, a bug
    of ours): ``requeued``, bounded, before the exception goes on."""
    if begun.reported or not begun.hooks.afters:
        return
    end = RunEnd(Outcome.REQUEUED, None, error, time.perf_counter() - begun.started)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_report(begun, end), AFTER_RUN_ON_EXIT_S)


async def abandoned(begun: Begun, seen: list[Outcome], error: BaseException) -> None:
    """The ``after_run`` hooks of an attempt ended without its handler (``running.take_over``),
    with the outcome its ending counted in ``seen``."""
    if not begun.hooks.afters:
        return
    begun.seen = seen
    await _bounded(begun, _end(begun, None, error), AFTER_RUN_TIMEOUT_S)


async def _report(begun: Begun, end: RunEnd) -> None:
    begun.reported = True
    await begun.hooks.after_run(begun.run, end)


async def _bounded(begun: Begun, end: RunEnd, bound_s: float) -> None:
    """``_report`` for at most ``bound_s``: in a task of its own (a copy of this context), so
    a hook that ignores its cancellation is left behind, not waited for."""
    reporting = asyncio.ensure_future(_report(begun, end))
    try:
        done, _ = await asyncio.wait((reporting,), timeout=bound_s)
    except BaseException:  # the delivery's task is cancelled (a hard stop): not left running
        reporting.cancel()
        raise
    if done:
        reporting.result()  # the chain logs a hook's exception; anything else is ours
        return
    reporting.cancel()
    log.warning(
        "after_run hooks of task %s ran past %g s: cancelled (the message is settled)",
        begun.run.task_id,
        bound_s,
    )


def _end(begun: Begun, result: Any, error: BaseException | None) -> RunEnd:
    # No outcome counted: the ack or the move did not reach the broker, which redelivers.
    outcome = begun.seen[-1] if begun.seen else Outcome.REQUEUED
    return RunEnd(
        outcome, result if error is None else None, error, time.perf_counter() - begun.started
    )

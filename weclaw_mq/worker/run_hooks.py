"""The middleware's run hooks around one handler run (``handlers.middleware``).

Only a worker whose App has run middleware comes here (``Runtime.hooks``); the common path
makes no call. ``after_run`` is called exactly once per run that ``before_run`` saw: by the
delivery once its ending was carried out, or, for a handler abandoned at its deadline, by the
task that ended the attempt without it (``running.take_over``). The outcome it reports is the
one the Settler counted (``settle.settled_as``), so a decided success whose result could not
be stored reads ``requeued``, never ``acked``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from weclaw_mq.contract.message import Delivery
from weclaw_mq.handlers.middleware import Chain, Run, RunEnd
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.worker.records import session_of
from weclaw_mq.worker.settle import settled_as

# How long the after_run hooks of a delivery being given back (a hard stop) may take.
AFTER_RUN_ON_EXIT_S = 1.0


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


async def begin(hooks: Chain, run: Run) -> Begun:
    """The ``before_run`` hooks, in the delivery's own task: what they set in context vars,
    the handler sees; and from here the Settler notes this delivery's outcome."""
    begun = Begun(hooks, run, time.perf_counter(), [])
    settled_as.set(begun.seen)
    begun.failed = await hooks.before_run(run)
    return begun


async def finish(begun: Begun, result: Any, error: BaseException | None) -> None:
    """The ``after_run`` hooks, once the attempt's ending was carried out."""
    await _report(begun, _end(begun, result, error))


async def given_back(begun: Begun, error: BaseException) -> None:
    """The ``after_run`` hooks of a delivery given back by an exception (a hard stop, a bug
    of ours): ``requeued``, bounded, before the exception goes on."""
    if begun.reported:
        return
    end = RunEnd(Outcome.REQUEUED, None, error, time.perf_counter() - begun.started)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_report(begun, end), AFTER_RUN_ON_EXIT_S)


async def abandoned(begun: Begun, seen: list[Outcome], error: BaseException) -> None:
    """The ``after_run`` hooks of an attempt ended without its handler (``running.take_over``),
    with the outcome its ending counted in ``seen``."""
    begun.seen = seen
    await _report(begun, _end(begun, None, error))


async def _report(begun: Begun, end: RunEnd) -> None:
    begun.reported = True
    await begun.hooks.after_run(begun.run, end)


def _end(begun: Begun, result: Any, error: BaseException | None) -> RunEnd:
    # No outcome counted: the ack or the move did not reach the broker, which redelivers.
    outcome = begun.seen[-1] if begun.seen else Outcome.REQUEUED
    return RunEnd(
        outcome, result if error is None else None, error, time.perf_counter() - begun.started
    )

"""A handler's model fallback chain at work (``policy.fallback``), as a part of its
``ModelCalls`` middleware (``llm.calls``): the model of each attempt,
chosen from its models' health in Redis (``state.model_health``), and what the attempt's end
says of that model.

The model is written on the task's retry and dead-letter copies (``x-weclaw-model``, and
``x-weclaw-models-tried``: every model its attempts failed on), so the next attempt moves on
down the list and ``weclaw-mq dlq show`` says which models failed. Only a handler with
``fallback=`` comes here.

When a model's cool-down ends, one attempt (of every worker's) probes it, as a breaker's
half-open does; the rest stay parked without spending attempts. The probe's success brings it
up for all; its failure takes it down again and parks the probing task without spending its
attempt either (the model failed, not the task), however long the outage lasts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.errors import HandlerTimeout, InvalidPayload, UnserialisableResult
from weclaw_mq.handlers.middleware import Defer, Run
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.policy.fallback import choose
from weclaw_mq.policy.signals import Reject, Retry
from weclaw_mq.state.model_health import PROBE_RECHECK_MS, ModelHealth

log = logging.getLogger("weclaw_mq.worker")

# Failures that say nothing of the model: the task itself is at fault (a handler's own
# timeout included: the handler chose how long a call may take, not the model).
_NOT_THE_MODELS = (Reject, InvalidPayload, UnserialisableResult, HandlerTimeout)


def tried_models(headers: Mapping[str, Any]) -> list[str]:
    """The models this task's earlier attempts failed on, as its copy says."""
    value = headers.get(h.MODELS_TRIED)
    if not isinstance(value, list):
        return []
    return [m.decode() if isinstance(m, bytes) else m for m in value if isinstance(m, str | bytes)]


async def model_for(health: ModelHealth | None, spec: HandlerSpec, run: Run) -> str | Defer:
    """The attempt's model: the first of the chain up that the task has not failed on; or a
    deferral while every model of the chain is down."""
    fallback = spec.fallback
    assert fallback is not None
    tried = tried_models(run.headers)
    if health is None:
        return fallback.models[0]
    try:
        now, down, half_open = await health.read(fallback.models)
    except Exception as e:  # health unknown: walk the list by what the task tried
        log.warning("the models' health could not be read (%s); choosing without it", e)
        now, down, half_open = 0, {}, set()
    lease_ms = round(max(fallback.cool_down_s, spec.timeout_s) * 1000)
    pick = choose(fallback, tried, down, now)
    while isinstance(pick, str) and pick in half_open:
        try:  # its cool-down is over: one attempt probes it, the others see it down
            if await health.probe(pick, run.task_id, lease_ms):
                return pick
        except Exception as e:
            log.warning("the probe of model %r could not be taken (%s)", pick, e)
        half_open.discard(pick)  # another attempt probes it: down for us, for now
        down[pick] = now + PROBE_RECHECK_MS
        pick = choose(fallback, tried, down, now)
    if isinstance(pick, str):
        return pick
    why = f"every model of {spec.queue!r} is down for {pick / 1000:.3g} s more"
    return Defer(why, after_s=pick / 1000, by="fallback")


async def after_attempt(
    health: ModelHealth | None,
    metrics: Metrics,
    spec: HandlerSpec,
    run: Run,
    model: str,
    error: BaseException | None,
) -> BaseException | Defer | None:
    """Tell the chain how the attempt on ``model`` ended; a failed one's copy names it.

    Returns the attempt's error as its retry should see it: a 429's ``Retry(after_s=)``
    takes ``model`` down for that long, and the task's next attempt goes to the next model
    after the policy's delay, not after the Retry-After (when every model is down then, it
    waits for the first to come back, without spending an attempt). A ``Defer`` when the
    attempt was the probe of a half-open model and failed: the model is down again, and the
    task is parked without spending its attempt."""
    fallback = spec.fallback
    assert fallback is not None
    owner = run.task_id
    if health is None or isinstance(error, _NOT_THE_MODELS):
        if error is not None:
            _name_on_copy(run, model)
            if health is not None:  # its probe, if it held one, is free for another
                try:
                    await health.released(model, owner)
                except Exception as e:
                    log.warning("could not free the probe of model %r (%s)", model, e)
        return error
    try:
        if error is None:
            await health.succeeded(model, owner)
            outcome = "succeeded"
        elif isinstance(error, Retry) and error.after_ms:
            await health.block(model, error.after_ms, owner)
            outcome = "blocked"
            if len(fallback.models) > 1:
                moved_on = Retry(f"{error.reason} (on {model}: the next model is tried)")
                moved_on.__cause__ = error
                error = moved_on
        else:
            downed = await health.failed(
                model, fallback.failures, round(fallback.cool_down_s * 1000), owner
            )
            outcome = "taken_down" if downed else "failed"
            if downed == 2:
                metrics.model_attempts.labels(spec.queue, model, "probe_failed").inc()
                log.warning(
                    "the probe of model %r failed: skipped for %g s more",
                    model,
                    fallback.cool_down_s,
                )
                return Defer(f"the probe of model {model!r} failed", by="fallback")
            if downed:
                log.warning(
                    "model %r failed %d attempts in a row: skipped for %g s",
                    model,
                    fallback.failures,
                    fallback.cool_down_s,
                )
    except Exception as e:  # the attempt's end stands; the chain learns next time
        log.warning("could not record the model's health (%s)", e)
        if error is not None:
            _name_on_copy(run, model)
        return error
    if error is not None:
        _name_on_copy(run, model)
    metrics.model_attempts.labels(spec.queue, model, outcome).inc()
    return error


def _name_on_copy(run: Run, model: str) -> None:
    """The failed attempt's model, on the copy its retry or dead letter travels as (the
    copy carries the delivery's headers)."""
    run.headers[h.MODEL] = model
    run.headers[h.MODELS_TRIED] = [*tried_models(run.headers), model]

"""A handler's model fallback chain at work (``policy.fallback``): the model of each attempt,
chosen from its models' health in Redis (``state.model_health``), and what the attempt's end
says of that model.

The model is written on the task's retry and dead-letter copies (``x-weclaw-model``, and
``x-weclaw-models-tried``: every model its attempts failed on), so the next attempt moves on
down the list and ``weclaw-mq dlq show`` says which models failed. Only a handler with
``fallback=`` comes here.
"""

from __future__ import annotations

import logging

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.contract.message import Delivery
from weclaw_mq.errors import InvalidPayload, UnserialisableResult
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.fallback import choose
from weclaw_mq.policy.signals import Reject, Retry
from weclaw_mq.worker.admission import park_until
from weclaw_mq.worker.ends import End
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")

# Failures that say nothing of the model: the task itself is at fault.
_NOT_THE_MODELS = (Reject, InvalidPayload, UnserialisableResult)


def tried_models(delivery: Delivery) -> list[str]:
    """The models this task's earlier attempts failed on, as its copy says."""
    value = delivery.headers.get(h.MODELS_TRIED)
    if not isinstance(value, list):
        return []
    return [m.decode() if isinstance(m, bytes) else m for m in value if isinstance(m, str | bytes)]


async def model_for(rt: Runtime, spec: HandlerSpec, delivery: Delivery) -> str | End:
    """The model of this attempt, or a deferral while every model of the chain is down."""
    fallback = spec.fallback
    assert fallback is not None
    tried = tried_models(delivery)
    if rt.health is None:
        return fallback.models[0]
    try:
        now, down = await rt.health.down_until(fallback.models)
    except Exception as e:  # health unknown: walk the list by what the task tried
        log.warning("the models' health could not be read (%s); choosing without it", e)
        now, down = 0, {}
    pick = choose(fallback, tried, down, now)
    if isinstance(pick, str):
        return pick
    why = f"every model of {spec.queue!r} is down for {pick / 1000:.3g} s more"
    return park_until(spec, now_ms() + pick, why)


async def after_attempt(
    rt: Runtime, spec: HandlerSpec, delivery: Delivery, model: str, error: BaseException | None
) -> BaseException | None:
    """Tell the chain how the attempt on ``model`` ended; a failed one's copy names it.

    Returns the attempt's error as its retry should see it: a 429's ``Retry(after_s=)``
    takes ``model`` down for that long, and the task's next attempt goes to the next model
    after the policy's delay, not after the Retry-After (when every model is down then, it
    waits for the first to come back, without spending an attempt)."""
    fallback = spec.fallback
    assert fallback is not None
    if error is not None:
        delivery.headers[h.MODEL] = model
        delivery.headers[h.MODELS_TRIED] = [*tried_models(delivery), model]
    if rt.health is None or isinstance(error, _NOT_THE_MODELS):
        return error
    try:
        if error is None:
            await rt.health.succeeded(model)
            outcome = "succeeded"
        elif isinstance(error, Retry) and error.after_ms:
            await rt.health.block(model, error.after_ms)
            outcome = "blocked"
            if len(fallback.models) > 1:
                moved_on = Retry(f"{error.reason} (on {model}: the next model is tried)")
                moved_on.__cause__ = error
                error = moved_on
        else:
            downed = await rt.health.failed(
                model, fallback.failures, round(fallback.cool_down_s * 1000)
            )
            outcome = "taken_down" if downed else "failed"
            if downed:
                log.warning(
                    "model %r failed %d attempts in a row: skipped for %g s",
                    model,
                    fallback.failures,
                    fallback.cool_down_s,
                )
    except Exception as e:  # the attempt's end stands; the chain learns next time
        log.warning("could not record the model's health (%s)", e)
        return error
    rt.metrics.model_attempts.labels(spec.queue, model, outcome).inc()
    return error

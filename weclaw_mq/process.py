"""One delivery, start to end: decode -> call -> decide -> settle.

Nothing here acks before the handler returned; every path out of ``process`` either acked
(after storing or moving the task), or left the message with the broker for redelivery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aio_pika.abc import AbstractIncomingMessage

from . import settle
from .context import Context
from .handler import HandlerSpec, InvalidPayload, UndecodableBody
from .message import Delivery, read_delivery
from .metrics import Metrics, Outcome
from .producer import Publisher
from .retry import Ack, DeadLetter, DeadLetterReason, RetryLater, decide
from .tracing import TraceContext, bind

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("weclaw_mq.worker")


class HandlerTimeout(Exception):
    """The handler ran past its ``timeout_s`` and was cancelled."""


@dataclass(frozen=True)
class Runtime:
    """What a delivery needs from the worker that received it."""

    app: App
    publisher: Publisher
    metrics: Metrics


async def process(message: AbstractIncomingMessage, spec: HandlerSpec, rt: Runtime) -> None:
    delivery = read_delivery(message)
    trace = TraceContext(
        trace_id=delivery.trace_id,
        task_id=delivery.task_id,
        queue=spec.queue,
        attempt=delivery.attempt,
        traceparent=delivery.traceparent,
    )
    with bind(trace):
        try:
            task = spec.parse(delivery.body)
        except UndecodableBody as e:
            await _dead_letter(message, delivery, spec, rt, DeadLetterReason.UNDECODABLE, e)
            return
        except InvalidPayload as e:
            await _dead_letter(message, delivery, spec, rt, DeadLetterReason.INVALID_PAYLOAD, e)
            return

        error = await _call(spec, task, delivery, rt)
        decision = decide(delivery.attempt, error, spec.retry)
        if isinstance(decision, Ack):
            await settle.ack(message)
            rt.metrics.messages.labels(spec.queue, Outcome.ACKED.value).inc()
        elif isinstance(decision, RetryLater):
            assert error is not None
            log.warning(
                "attempt %d failed (%s: %s); retrying in %.3g s",
                delivery.attempt,
                type(error).__name__,
                error,
                decision.delay_ms / 1000,
            )
            if await settle.retry(
                message,
                delivery,
                rt.publisher,
                queue=spec.queue,
                delay_ms=decision.delay_ms,
                error=error,
            ):
                rt.metrics.messages.labels(spec.queue, Outcome.RETRIED.value).inc()
        elif isinstance(decision, DeadLetter):
            assert error is not None
            await _dead_letter(message, delivery, spec, rt, decision.reason, error)


async def _call(
    spec: HandlerSpec, task: Any, delivery: Delivery, rt: Runtime
) -> BaseException | None:
    """Run the handler under its timeout; the error it ended with, or None."""
    args: tuple[Any, ...] = (task,)
    if spec.takes_context:
        args = (
            task,
            Context(
                task_id=delivery.task_id,
                trace_id=delivery.trace_id,
                queue=spec.queue,
                attempt=delivery.attempt,
                redelivered=delivery.redelivered,
                headers=delivery.headers,
                app=rt.app,
            ),
        )
    in_flight = rt.metrics.in_flight.labels(spec.queue)
    in_flight.inc()
    started = time.perf_counter()
    try:
        # A CancelledError from outside (the worker stopping hard) is a BaseException and
        # passes through: the message stays unacked and is redelivered.
        async with asyncio.timeout(spec.timeout_s) as deadline:
            await spec.func(*args)
        return None
    except TimeoutError as e:
        if deadline.expired():
            return HandlerTimeout(f"handler ran past its timeout of {spec.timeout_s} s")
        return e
    except Exception as e:
        return e
    finally:
        in_flight.dec()
        rt.metrics.handler_seconds.labels(spec.queue).observe(time.perf_counter() - started)


async def _dead_letter(
    message: AbstractIncomingMessage,
    delivery: Delivery,
    spec: HandlerSpec,
    rt: Runtime,
    reason: DeadLetterReason,
    error: BaseException,
) -> None:
    log.error(
        "dead-lettering after attempt %d: %s (%s: %s)",
        delivery.attempt,
        reason.value,
        type(error).__name__,
        error,
    )
    if await settle.dead_letter(
        message, delivery, rt.publisher, queue=spec.queue, reason=reason.value, error=error
    ):
        rt.metrics.messages.labels(spec.queue, Outcome.DEAD_LETTERED.value).inc()

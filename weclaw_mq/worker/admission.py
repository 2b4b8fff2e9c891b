"""The gates a delivery passes before its handler runs: due yet, the guard's claim, still
alive, not cancelled, within its limits. Each answers "go on" or the ``End`` the delivery
takes instead (``ends.carry_out`` settles it); none settles anything itself."""

from __future__ import annotations

import logging
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import left_ms, now_ms
from weclaw_mq.contract.message import Delivery
from weclaw_mq.errors import InvalidPayload, StateCommandError, TaskExpired
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.delays import next_hop_ms, not_before_ms
from weclaw_mq.policy.retry import DeadLetterReason, delay_queue_set
from weclaw_mq.state import Claim, TaskStatus, TaskStore, new_owner
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.ends import AckCancelled, AckDuplicate, DeadLetter, Defer, End
from weclaw_mq.worker.limiting import NO_TICKET, Held, Limiter, Ticket
from weclaw_mq.worker.records import record_status, task_state
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")


class Unguarded:
    """The guard's answer when the store is down and the user chose ``run_unguarded``."""


UNGUARDED = Unguarded()

# Read once: on Python 3.11 every ``EnumClass.MEMBER`` is a descriptor call, per use.
_CLAIM_DONE = Claim.DONE
_CLAIM_BUSY = Claim.BUSY
_CLAIM_CANCELLED = Claim.CANCELLED
_RUNNING = TaskStatus.RUNNING


def park_until(spec: HandlerSpec, due_ms: int, why: str) -> Defer:
    """Park a task that may not run before ``due_ms`` (epoch ms): the due time is written on
    it and it hops through the handler's delay queues until then (``parked_until_due``),
    spending no attempt; a claim's ``running`` record goes back to ``queued``."""
    left = max(due_ms - now_ms(), 1)
    return Defer(
        why,
        delay_ms=next_hop_ms(left, delay_queue_set(spec.retry)),
        queued_again=True,
        not_before_ms=due_ms,
    )


def parked_until_due(delivery: Delivery, spec: HandlerSpec) -> Defer | None:
    """A task that came back from a delay queue before its not-before time goes to the next
    one (weclaw_mq.policy.delays): no claim, no record, no attempt; it did not run. Its status stays
    what it was (``queued`` for a delayed publish, ``retrying`` for a retry)."""
    due = not_before_ms(delivery.headers)
    left = None if due is None else due - now_ms()
    if left is None or left <= 0:
        return None
    hop_ms = next_hop_ms(left, delay_queue_set(spec.retry))
    return Defer(f"due in {left / 1000:.3g} s", delay_ms=hop_ms)


async def pass_guard(
    delivery: Delivery, spec: HandlerSpec, store: TaskStore, rt: Runtime
) -> str | Unguarded | End:
    """The claim's owner token when we hold the claim; ``UNGUARDED`` to run without one; or
    the end of a delivery that must not run (a copy of a finished, running or cancelled task,
    or a store that cannot answer)."""
    owner = new_owner()
    # With results on, the "running" record rides on the claim (one step, one round trip).
    running = task_state(delivery, spec, _RUNNING) if rt.results is not None else None
    try:
        claim = await store.claim(spec.queue, delivery.task_id, owner, running=running)
    except StateCommandError as e:  # Redis is up and said no: never run unguarded for it
        log.error("the task store refused the claim: %s", e)
        return Defer("the task store refused the claim")
    except Exception as e:  # the store unreachable or failing: the same answer either way
        if rt.settings.guard_on_redis_down == "run_unguarded":
            log.warning("task store unavailable (%s); running UNGUARDED as configured", e)
            return UNGUARDED
        log.warning("task store unavailable (%s: %s)", type(e).__name__, e)
        return Defer("the task store is down, the guard cannot tell")
    if claim is _CLAIM_CANCELLED:
        return AckCancelled()
    if claim is _CLAIM_DONE:
        return AckDuplicate()
    if await _finished_before(delivery, spec, rt):
        return AckDuplicate(mark_done=True)
    if claim is _CLAIM_BUSY:
        return Defer("another worker is running this task")
    return owner


async def _finished_before(delivery: Delivery, spec: HandlerSpec, rt: Runtime) -> bool:
    """Did a worker store this task's result in this queue, then die before marking it done?

    Asked only of a copy that came back unsettled (a fresh delivery cannot be in that state),
    so the common path pays no extra round trip.
    """
    if rt.results is None or not (delivery.redelivered or delivery.returns):
        return False
    try:
        state = await rt.results.get(delivery.task_id, queue=spec.queue)
    except Exception as e:  # unknown: let the guard's answer stand
        log.warning("could not read the stored result (%s)", e)
        return False
    return state is not None and state.status is TaskStatus.SUCCEEDED


async def expired_on_arrival(
    delivery: Delivery, spec: HandlerSpec, rt: Runtime, held: str | None
) -> DeadLetter | None:
    """A task that arrived past its deadline is dead-lettered (RabbitMQ expires only what
    reaches the head of Q with its expiration still set; a task back from a delay queue has
    none).

    Checked after the guard: a copy of a task that finished or runs elsewhere is acked or
    parked as usual, never dead-lettered beside its twin's result."""
    left = left_ms(delivery.headers, now_ms())
    near = left is not None and 0 < left <= rt.settings.redis_timeout_s * 1000
    if near and held is None and rt.results is not None:
        # Unclaimed, the "running" record is written beside the handler, and could land past
        # the deadline: status() would meanwhile read the queued record as expired for a task
        # that runs. This close to the deadline, write it first, then decide.
        await record_status(rt, delivery, spec, TaskStatus.RUNNING)
        left = left_ms(delivery.headers, now_ms())
    if left is None or left > 0:
        return None
    late = TaskExpired(
        f"the task arrived {-left / 1000:.3g} s past the end of its lifetime "
        f"(x-weclaw-ttl-ms {delivery.headers.get(h.TTL_MS)})"
    )
    return DeadLetter(DeadLetterReason.EXPIRED, late)


async def cancelled_before_start(
    delivery: Delivery, spec: HandlerSpec, rt: Runtime, watch: Watch
) -> AckCancelled | None:
    """A task cancelled before its handler started: by a request that came while it was
    claimed, or, for a handler that claims nothing (``idempotent=False``), by the cancel
    marker (one read; a claim reads it in the same step)."""
    if not watch.requested and not spec.idempotent and rt.store is not None:
        try:
            if await rt.store.is_cancelled(spec.queue, delivery.task_id):
                watch.request()
        except Exception as e:  # unknown: run it; a cancel request still reaches the handler
            log.warning("could not read the cancel marker (%s)", e)
    return AckCancelled() if watch.requested else None


async def within_limits(
    spec: HandlerSpec,
    rt: Runtime,
    limiter: Limiter,
    task: Any,
    body_bytes: int,
    model: str | None = None,
) -> Ticket | End:
    """The ticket of a start within the handler's limits, or the end of a delivery that may
    not start: deferred (over a limit, or Redis down) or dead-lettered (a key function
    failed). A deferral spends no attempt and frees the claim for the copy that returns."""
    try:
        answer = await limiter.admit(spec.queue, spec.limits, task, body_bytes, model)
    except InvalidPayload as e:
        return DeadLetter(DeadLetterReason.INVALID_PAYLOAD, e)
    except StateCommandError as e:  # as for the guard
        log.error("the limits' store refused the admission: %s", e)
        return Defer("Redis refused the limits' command")
    except Exception as e:  # Redis unreachable or failing: as for the guard
        if rt.settings.guard_on_redis_down == "run_unguarded":
            log.warning("limits unavailable (%s); running UNLIMITED as configured", e)
            return NO_TICKET
        log.warning("limits unavailable (%s: %s)", type(e).__name__, e)
        return Defer("Redis is down, the limits cannot tell")
    if not isinstance(answer, Held):
        return answer
    rt.metrics.limit_deferred(spec.queue, answer.kind).inc()
    return Defer(
        f"over its {answer.kind} limit",
        delay_ms=answer.delay_ms,
        # Routine under load (one line per deferral would drown the log): the metric counts.
        level=logging.DEBUG,
        queued_again=True,
    )

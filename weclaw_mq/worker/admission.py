"""The gates a delivery passes before its handler runs (``admit``): well-formed, due yet, its
breaker closed, decoded, the guard's claim, still alive, not cancelled, then the handler's
middleware's ``admit`` hooks (the App's, then its own: its cap, fallback chain and limits,
``weclaw_mq.llm``). Each answers "go on" (None) or
the ``End`` the delivery takes instead (``delivery._process`` carries it out); none settles
anything itself."""

from __future__ import annotations

import logging
from logging import DEBUG

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import left_ms, now_ms
from weclaw_mq.contract.message import Delivery
from weclaw_mq.contract.undecodable import undecodable
from weclaw_mq.errors import (
    InvalidPayload,
    StateCommandError,
    TaskExpired,
    UndecodableBody,
    WorkerCrashLoop,
)
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.delays import next_hop_ms, not_before_ms
from weclaw_mq.policy.retry import DeadLetterReason, delay_queue_set
from weclaw_mq.state import Claim, TaskStatus, TaskStore, new_owner
from weclaw_mq.worker.attempt import Attempt
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.ends import (
    AckCancelled,
    AckDuplicate,
    AckStale,
    DeadLetter,
    Defer,
    End,
    RejectOriginal,
)
from weclaw_mq.worker.long_runs import hop_ms, watch_generation
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
_CLAIM_STALE = Claim.STALE
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


async def admit(a: Attempt) -> End | None:
    """The delivery's checks and gates, in order: None when its handler may run, else the
    end it takes instead. Cheap checks first (no round trip), then the guard's claim, then
    the task's own lifetime and cancel, then the handler's own gates (``Pipeline.gates``:
    the middleware's ``admit`` hooks)."""
    delivery, spec, rt = a.delivery, a.spec, a.rt
    headers = delivery.headers
    if h.UNDECODABLE_PROPERTIES in headers and undecodable(headers) is not None:
        # Its properties did not decode (the worker reads them tolerantly, see Worker.run), so
        # no copy of it can be built: the broker moves the original to Q.dlq, where the DLQ
        # tools show it as "undecodable_properties". (The membership test first: the common
        # delivery pays no call.)
        return RejectOriginal()
    if delivery.returns > spec.delivery_limit:
        # The broker enforces the limit within one stint in Q; this catches a task that
        # keeps killing workers while hopping through the guard's delay queue.
        crash = WorkerCrashLoop(
            f"the task went back unsettled {delivery.returns} times (its worker died or "
            f"lost its connection); delivery limit {spec.delivery_limit}"
        )
        return DeadLetter(DeadLetterReason.DELIVERY_LIMIT, crash)
    if len(delivery.body) > rt.settings.max_message_bytes:
        # The same bound as publish: another producer's huge body is not parsed or stored.
        too_large = InvalidPayload(
            f"the body is {len(delivery.body)} bytes, over max_message_bytes "
            f"({rt.settings.max_message_bytes})"
        )
        return DeadLetter(DeadLetterReason.INVALID_PAYLOAD, too_large)
    # Asked only of a task that carries a not-before time (a delayed publish, a retry).
    if h.NOT_BEFORE in headers:
        parked = parked_until_due(delivery, spec)
        if parked is not None:
            return parked
    circuit = a.pipeline.circuit
    if circuit is not None and not circuit.admits(a.message):
        # Delivered as the breaker opened (or waiting for a lane slot): parked, no attempt.
        return Defer(f"the circuit breaker of {spec.queue!r} is {circuit.state}", by="breaker")
    try:
        a.task = spec.parse(delivery.body)
    except UndecodableBody as e:
        return DeadLetter(DeadLetterReason.UNDECODABLE, e)
    except InvalidPayload as e:
        return DeadLetter(DeadLetterReason.INVALID_PAYLOAD, e)
    if spec.long_running and rt.long_runs is not None and rt.long_runs.full(spec.queue):
        # Sent before its consumer paused for a queue full of long runs (they hold no
        # delivery, so the prefetch no longer bounds them): parked, no attempt spent, for
        # another worker. Never given back: each return counts toward the delivery limit.
        return Defer(f"this worker runs {rt.long_runs.concurrency} long runs of {spec.queue!r}")
    if rt.store is not None and spec.idempotent:
        claimed = await pass_guard(delivery, spec, rt.store, rt)
        if isinstance(claimed, str):
            a.held = claimed
        elif not isinstance(claimed, Unguarded):
            return claimed
    if h.EXPIRES_AT in headers:
        late = await expired_on_arrival(delivery, spec, rt, a.held)
        if late is not None:
            return late
    # Only a request, or the marker of a delivery that claims nothing, can cancel it here:
    # the common path pays no call.
    if a.watch.requested or (rt.store is not None and not spec.idempotent):
        cancelled = await cancelled_before_start(delivery, spec, rt, a.watch)
        if cancelled is not None:
            return cancelled
    for gate in a.pipeline.gates:
        end = await gate(a)
        if end is not None:
            a.let_go()  # what the earlier gates took: no run holds it
            return end
    if a.model is not None:
        delivery.model = a.model  # on its records: the status says which model runs it
    return None


async def pass_guard(
    delivery: Delivery, spec: HandlerSpec, store: TaskStore, rt: Runtime
) -> str | Unguarded | End:
    """The claim's owner token when we hold the claim; ``UNGUARDED`` to run without one; or
    the end of a delivery that must not run (a copy of a finished, running or cancelled task,
    or a store that cannot answer)."""
    owner = new_owner()
    # With results on, the "running" record rides on the claim (one step, one round trip).
    running = task_state(delivery, spec, _RUNNING) if rt.results is not None else None
    watch = watch_generation(delivery) if h.WATCH in delivery.headers else None
    try:
        if watch is None:  # a store of the user's own from before long runs takes no watch
            claim = await store.claim(spec.queue, delivery.task_id, owner, running=running)
        else:
            claim = await store.claim(
                spec.queue, delivery.task_id, owner, running=running, watch=watch
            )
    except StateCommandError as e:  # Redis is up and said no: never run unguarded for it
        log.error("the task store refused the claim: %s", e)
        return Defer("the task store refused the claim")
    except Exception as e:  # the store unreachable or failing: the same answer either way
        if rt.settings.guard_on_redis_down == "run_unguarded":
            log.warning("task store unavailable (%s); running UNGUARDED as configured", e)
            return UNGUARDED
        log.warning("task store unavailable (%s: %s)", type(e).__name__, e)
        return Defer("the task store is down, the guard cannot tell")
    if claim is _CLAIM_STALE:
        return AckStale()
    if claim is _CLAIM_CANCELLED:
        return AckCancelled()
    if claim is _CLAIM_DONE:
        return AckDuplicate()
    if await _finished_before(delivery, spec, rt):
        return AckDuplicate(mark_done=True)
    if claim is _CLAIM_BUSY:
        if watch is not None:  # a long run's watch copy, its run alive: one more period
            return Defer("its long run is alive", delay_ms=hop_ms(spec, rt.settings), level=DEBUG)
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

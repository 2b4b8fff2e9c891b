"""The ends of a delivery: ack, move to a delay queue, move to the dead-letter queue, give
back (or leave for the broker to return), reject.

Every move is "publish with confirm, then ack the source": a crash between the two leaves a
duplicate (absorbed by the idempotency guard), never a loss. If the move fails, the source is
returned to its queue instead, so the broker keeps the task. The moves answer whether the
copy reached its target.

Every end passes through ``Settler._ended``, the one outcome event of a settled delivery: it
counts ``weclaw_mq_messages_total{outcome}`` and writes the delivery's outcome log line, once.
A settle frame that did not reach the broker is no outcome: the broker redelivers the message
and its next delivery ends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from aio_pika import Message
from aio_pika.abc import AbstractIncomingMessage, HeadersType

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.contract.message import Delivery, build_message
from weclaw_mq.contract.naming import MIDNIGHT_QUEUE, dlq_name, ladder_queue_name, source_lane
from weclaw_mq.errors import WeclawMQError
from weclaw_mq.observability.metrics import Metrics, Outcome
from weclaw_mq.policy.delays import next_hop_ms, schedule
from weclaw_mq.policy.failures import (
    describe,
    error_class,
    error_type,
    handler_traceback,
    safe_text,
    traceback_text,
)
from weclaw_mq.policy.signals import Retry
from weclaw_mq.wire.connection import cancelled_by_caller
from weclaw_mq.wire.producer import Publisher
from weclaw_mq.worker.deadlines import Deadline, Deadlines

log = logging.getLogger("weclaw_mq.worker.settle")
# Outcome lines go where the rest of the worker's lines go.
outcome_log = logging.getLogger("weclaw_mq.worker")

# The log level of each outcome's line, unless the end says otherwise.
OUTCOME_LEVELS = {
    Outcome.ACKED: logging.DEBUG,  # the common case: one line per task would drown the rest
    Outcome.DUPLICATE: logging.INFO,
    Outcome.DEFERRED: logging.INFO,
    Outcome.RETRIED: logging.WARNING,
    Outcome.DEAD_LETTERED: logging.ERROR,
    Outcome.REQUEUED: logging.WARNING,
    Outcome.CANCELLED: logging.INFO,
}

# What an ack says, by its outcome.
_ACK_TEXTS = {
    Outcome.ACKED: "result stored, acked",
    Outcome.DUPLICATE: "acked without running the handler: a finished task seen again",
    Outcome.CANCELLED: "acked: the task was cancelled (App.cancel)",
}


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


def carried_headers(delivery: Delivery) -> dict[str, Any]:
    """The source's headers for its next hop, with the return count carried forward."""
    out = dict(delivery.headers)
    out.pop(h.X_DELIVERY_COUNT, None)  # the broker's, for one stint in one queue
    if delivery.returns:
        out[h.RETURNS] = delivery.returns
    return out


def failure_headers(delivery: Delivery, queue: str, error: BaseException) -> dict[str, Any]:
    """The source's headers plus what went wrong; first-failure time survives every hop."""
    out = carried_headers(delivery)
    now = _now_iso()
    # Safe text only: an error whose __str__ raises, or whose message UTF-8 cannot encode,
    # must not stop the headers from being built or encoded (the task would stay unsettled).
    out[h.ERROR_TYPE] = error_type(error)
    out[h.ERROR_CLASS] = error_class(error)
    out[h.ERROR_MESSAGE] = safe_text(error)[: h.ERROR_MESSAGE_MAX_CHARS]
    # The end of a traceback says most: keep that part.
    out[h.ERROR_TRACEBACK] = traceback_text(error)[-h.TRACEBACK_MAX_CHARS :]
    out[h.ORIGINAL_QUEUE] = queue
    out.setdefault(h.FIRST_FAILURE_AT, now)
    out[h.LAST_FAILURE_AT] = now
    out[h.TRACE_ID] = delivery.trace_id
    return out


# How the delivery being settled in this context ended, for the middleware's ``after_run``
# (``worker.run_hooks``): a list a hooked run sets, to which ``_ended`` appends the outcome.
settled_as: ContextVar[list[Outcome] | None] = ContextVar("settled_as", default=None)

# An ack or nack is one frame handed to the connection's writer. After the writer died,
# aiormq's basic_ack waits forever; past this the connection is taken for dead.
SETTLE_TIMEOUT_S = 5.0


class Settler:
    """Ends deliveries for one worker session: its publisher for moves, its deadlines, and the
    metrics its outcomes are counted in. Each method ends one delivery of ``queue``."""

    def __init__(
        self,
        publisher: Publisher,
        deadlines: Deadlines,
        metrics: Metrics,
        *,
        before_settle: Callable[[AbstractIncomingMessage], Awaitable[None]] | None = None,
        retry_level: int = logging.WARNING,
        tracebacks: bool = True,
        observed: bool = False,
    ) -> None:
        self.publisher = publisher
        self.deadlines = deadlines
        self.metrics = metrics
        # settings.retry_log_level and settings.failure_tracebacks.
        self.retry_level = retry_level
        self.tracebacks = tracebacks
        # Called once the outcome is decided, before the ack/nack frame: priority lanes hand
        # the slot on and may cancel the message's consumer first (worker.lanes).
        self.before_settle = before_settle
        # The App has run middleware: each outcome is also noted in ``settled_as``.
        self.observed = observed

    def _ended(
        self,
        queue: str,
        outcome: Outcome,
        text: str,
        *,
        level: int | None = None,
        error: BaseException | None = None,
    ) -> None:
        """The outcome event: called exactly once per settled delivery, by every end below.
        ``error``: the handler's, whose traceback the line carries (``tracebacks``)."""
        self.metrics.settled(queue, outcome).inc()
        if self.observed:
            seen = settled_as.get()
            if seen is not None:
                seen.append(outcome)
        if level is None:
            level = OUTCOME_LEVELS[outcome]
        # Asked first: an acked task's line is DEBUG, off in production, and ``log`` would
        # ask the same behind one more call.
        if outcome_log.isEnabledFor(level):
            trace = handler_traceback(error) if self.tracebacks and error is not None else None
            if trace is None:
                outcome_log.log(level, "%s: %s", outcome, text)
                return
            # The traceback as finished text (exc_text), not the live exception: every
            # formatter, ours or a test runner's, then shows text that always encodes.
            record = outcome_log.makeRecord(
                outcome_log.name, level, __file__, 0, "%s: %s", (outcome, text), None
            )
            record.exc_text = trace
            outcome_log.handle(record)

    async def ack(
        self,
        message: AbstractIncomingMessage,
        *,
        queue: str,
        outcome: Outcome = Outcome.ACKED,
        text: str | None = None,
    ) -> bool:
        """Ack a task whose result is stored (``ACKED``), a copy of a finished task
        (``DUPLICATE``) or a cancelled task (``CANCELLED``); False when the channel is gone
        (the broker redelivers: a duplicate, not a loss). ``text``: the log line's, if not
        the outcome's."""
        if not await self._settle(message, requeue=None):
            return False
        self._ended(queue, outcome, text or _ACK_TEXTS[outcome])
        return True

    async def give_back(
        self, message: AbstractIncomingMessage, *, queue: str, why: str, level: int | None = None
    ) -> bool:
        """Return the message to its queue now rather than when the channel closes."""
        if not await self._settle(message, requeue=True):
            return False
        self._ended(queue, Outcome.REQUEUED, f"given back to its queue: {why}", level=level)
        return True

    async def reject(self, message: AbstractIncomingMessage, *, queue: str) -> bool:
        """Reject without requeue: the broker dead-letters the untouched original to ``Q.dlq``.

        Only for a message we cannot copy (its properties did not decode): every other move is
        "publish a copy with confirm, then ack", which keeps our failure headers.
        """
        if not await self._settle(message, requeue=False):
            return False
        self._ended(
            queue,
            Outcome.DEAD_LETTERED,
            "its properties could not be decoded: rejected to the dead-letter queue",
        )
        return True

    async def retry(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        *,
        queue: str,
        delay_ms: int,
        error: BaseException,
        queues_ms: tuple[int, ...] | None = None,
    ) -> bool:
        """Park the task for ``delay_ms`` as its next attempt. With ``queues_ms`` (the handler's
        delay queues, shared by its lanes), a delay without a queue of its own hops through
        them (``delays``)."""
        headers = failure_headers(delivery, queue, error)
        headers[h.ATTEMPT] = delivery.attempt + 1
        hop_ms = delay_ms if queues_ms is None else next_hop_ms(delay_ms, queues_ms)
        schedule(headers, delay_ms, hop_ms, now_ms())
        # The lane it came from, which the delay queue dead-letters it back to: a retried task
        # keeps its priority (``topology.delay_queue_arguments``).
        target, lane = ladder_queue_name(hop_ms), source_lane(message.routing_key, queue)
        if not await self._move(message, delivery, lane, headers, queue=queue, exchange=target):
            return False
        self._ended(
            queue,
            Outcome.RETRIED,
            f"attempt {delivery.attempt} failed ({describe(error)}); retrying in "
            f"{delay_ms / 1000:.3g} s",
            # A handler asking for a retry (the model said "busy") is no failure to warn of.
            level=logging.INFO if isinstance(error, Retry) else self.retry_level,
            error=error,
        )
        return True

    async def defer(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        *,
        queue: str,
        delay_ms: int,
        why: str,
        level: int | None = None,
        not_before_ms: int | None = None,
        at_midnight: bool = False,
    ) -> bool:
        """Park the task in a delay queue without counting an attempt: it did not fail.
        ``not_before_ms``: its due time beyond this hop, written on it (it hops until then).
        ``at_midnight``: that due time is the next UTC midnight: one hop through the
        midnight queue, the message's own TTL running until then."""
        # The lane it came from, as a retry's: a deferred task keeps its priority.
        target, lane = ladder_queue_name(delay_ms), source_lane(message.routing_key, queue)
        headers = carried_headers(delivery)
        expiration_ms = None
        if not_before_ms is not None:
            headers[h.NOT_BEFORE] = not_before_ms
            if at_midnight:
                target, expiration_ms = MIDNIGHT_QUEUE, max(1, not_before_ms - now_ms())
                delay_ms = expiration_ms
        headers[h.DEFERRALS] = delivery.deferrals + 1
        if not await self._move(
            message,
            delivery,
            lane,
            headers,
            queue=queue,
            exchange=target,
            expiration_ms=expiration_ms,
        ):
            return False
        self._ended(
            queue,
            Outcome.DEFERRED,
            f"parked in {target} for {delay_ms / 1000:.3g} s: {why}",
            level=level,
        )
        return True

    async def dead_letter(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        *,
        queue: str,
        reason: str,
        error: BaseException,
    ) -> bool:
        headers = failure_headers(delivery, queue, error)
        headers[h.ATTEMPT] = delivery.attempt
        headers[h.DEAD_LETTER_REASON] = reason
        if not await self._move(message, delivery, dlq_name(queue), headers, queue=queue):
            return False
        self._ended(
            queue,
            Outcome.DEAD_LETTERED,
            f"dead-lettered after attempt {delivery.attempt}: {reason} ({describe(error)})",
            error=error,
        )
        return True

    async def watch(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        *,
        queue: str,
        hop_ms: int,
        generation: int,
    ) -> bool:
        """A long run begins (``worker.long_runs``): its watch copy of ``generation`` parked
        for ``hop_ms``, then the source acked. No outcome: the run's end is the delivery's,
        and its lane slot stays taken until then."""
        headers = carried_headers(delivery)
        headers[h.WATCH] = generation
        target, lane = ladder_queue_name(hop_ms), source_lane(message.routing_key, queue)
        return await self._move(
            message, delivery, lane, headers, queue=queue, exchange=target, keep_slot=True
        )

    async def hand_over(
        self, message: AbstractIncomingMessage, delivery: Delivery, *, queue: str, generation: int
    ) -> bool:
        """A long run this worker will not end (it stops): a copy of ``generation`` straight
        to its lane, which the next worker resumes at once."""
        headers = carried_headers(delivery)
        headers[h.WATCH] = generation
        lane = source_lane(message.routing_key, queue)
        try:
            await self.publisher.publish(lane, self._copy(message, delivery, headers))
        except Exception as e:
            log.warning("could not hand the long run over (%s); its watch copy brings it back", e)
            return False
        self._ended(queue, Outcome.REQUEUED, "a long run handed over to the next worker")
        await self._settle(message, requeue=None)  # frees its lane slot
        return True

    def _copy(
        self, message: AbstractIncomingMessage, delivery: Delivery, headers: HeadersType
    ) -> Message:
        copy = build_message(
            delivery.body, task_id=delivery.task_id, headers=headers, timestamp=delivery.timestamp
        )
        # A native priority travels in the property (the header x-weclaw-priority is in
        # ``headers``): the copy is served at the same level when it comes back.
        copy.priority = message.priority
        return copy

    async def _move(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        target: str,
        headers: HeadersType,
        *,
        queue: str,
        exchange: str = "",
        expiration_ms: int | None = None,
        keep_slot: bool = False,
    ) -> bool:
        """Publish a copy to ``target`` (a routing key: through ``exchange``, a delay queue's,
        when given), then ack the source. ``expiration_ms``: the copy's own TTL.
        ``keep_slot``: the lane slot stays taken (a long run goes on)."""
        copy = self._copy(message, delivery, headers)
        if expiration_ms is not None:
            copy.expiration = expiration_ms / 1000  # aio-pika takes seconds
        try:
            await self.publisher.publish(target, copy, exchange=exchange)
        except Exception as e:
            # Any failure (not only ours: a header the client cannot encode, say) means the
            # copy may not be there; the source goes back and the broker's delivery limit
            # bounds how often that can repeat.
            reason = str(e) if isinstance(e, WeclawMQError) else describe(e)
            await self.give_back(
                message,
                queue=queue,
                why=f"could not move it to {exchange or target} ({reason})",
                level=logging.ERROR,
            )
            return False
        # Moved, whatever the ack does: if it fails, the source comes back as a duplicate.
        await self._settle(message, requeue=None, keep_slot=keep_slot)
        return True

    async def _settle(
        self, message: AbstractIncomingMessage, *, requeue: bool | None, keep_slot: bool = False
    ) -> bool:
        if self.before_settle is not None and not keep_slot:
            try:
                await self.before_settle(message)
            except Exception as e:  # the settle below matters more than the hand-over
                log.warning("releasing the lane slot failed (%s)", describe(e))
        if message.processed:
            # A long run's delivery, acked as it began (``watch``): an ack has nothing left to
            # send; a give-back cannot return it (its watch copy will: ``worker.long_runs``).
            return requeue is None
        try:
            with Deadline(self.deadlines, SETTLE_TIMEOUT_S):
                if requeue is None:
                    await message.ack()
                else:
                    await message.nack(requeue=requeue)
            return True
        except asyncio.CancelledError:
            if cancelled_by_caller():
                raise
            log.warning("%s failed (connection lost); the broker will redeliver", _verb(requeue))
        except Exception as e:  # any failure here means the same thing: not settled
            log.warning(
                "%s failed (%s: %s); the broker will redeliver",
                _verb(requeue),
                type(e).__name__,
                e,
            )
        return False


def _verb(requeue: bool | None) -> str:
    return "ack" if requeue is None else ("nack" if requeue else "reject")

"""Retry policy and the pure decision of what happens to a finished delivery."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.delays import STEP_DELAYS_MS
from weclaw_mq.policy.signals import Reject, Retry


class DeadLetterReason(StrEnum):
    """Why a task is in ``Q.dlq``: the ``x-weclaw-dead-letter-reason`` header, part of the
    wire format (filters and alerts match on it)."""

    # The body is not UTF-8 JSON: no handler ran.
    UNDECODABLE = "undecodable"
    # The body fails the handler's model, or is over max_message_bytes: no handler ran.
    INVALID_PAYLOAD = "invalid_payload"
    # The handler raised Reject: no retry can fix it.
    REJECTED = "rejected"
    # The handler failed (raised, timed out, was abandoned) on its last allowed attempt.
    RETRIES_EXHAUSTED = "retries_exhausted"
    # The handler returned something that is not JSON: storing it can never succeed.
    INVALID_RESULT = "invalid_result"
    # The broker's own name for it: a task whose worker died on it too often.
    DELIVERY_LIMIT = "delivery_limit"
    # RabbitMQ's name too: the task outlived its lifetime (weclaw_mq.contract.lifetime).
    EXPIRED = "expired"
    # Its tenant's spending reached the day's cap, and the cap sheds (weclaw_mq.policy.costs).
    BUDGET_EXCEEDED = "budget_exceeded"


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: the n-th retry waits ``delay_s * multiplier**(n-1)``, capped.

    These defaults are the only statement of them: the ``WECLAW_MQ_MAX_RETRIES`` and
    ``WECLAW_MQ_RETRY_*`` settings take theirs from here. They are the production config of
    our design notes: 5 s, 10 s, 20 s, then the DLQ.

    Args:
        max_retries: Retries after the first attempt; 0 dead-letters the first failure.
        delay_s: The first retry's delay, in seconds (at least 0.001).
        multiplier: Each later delay is this many times the one before (at least 1).
        max_delay_s: The cap of every delay, in seconds.

    Raises:
        ConfigurationError: A value out of those bounds.
    """

    max_retries: int = 3
    delay_s: float = 5.0
    multiplier: float = 2.0
    max_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigurationError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.delay_s <= 0 or self.max_delay_s <= 0:
            raise ConfigurationError("delay_s and max_delay_s must be > 0")
        if self.multiplier < 1:
            raise ConfigurationError(f"multiplier must be >= 1, got {self.multiplier}")
        if self.delay_ms(1) < 1:
            raise ConfigurationError("delay_s must be at least 0.001 (1 ms)")

    def delay_ms(self, failed_attempt: int) -> int:
        """Delay before the attempt that follows ``failed_attempt``.

        Args:
            failed_attempt: The attempt that failed (1-based).

        Returns:
            The delay in milliseconds.
        """
        raw = self.delay_s * self.multiplier ** max(failed_attempt - 1, 0)
        return round(min(raw, self.max_delay_s) * 1000)

    def delays_ms(self) -> tuple[int, ...]:
        """Each distinct delay once: one delay queue is declared per entry.

        Returns:
            The delays in milliseconds, in the order the retries meet them.
        """
        seen: dict[int, None] = {}
        for attempt in range(1, self.max_retries + 1):
            seen[self.delay_ms(attempt)] = None
        return tuple(seen)


@functools.cache
def delay_queue_set(policy: RetryPolicy) -> tuple[int, ...]:
    """Every delay queue (ms) of a handler with ``policy``, shortest first. The
    policy's first delay is always there: the guard parks duplicates in it."""
    return tuple(sorted({policy.delay_ms(1), *policy.delays_ms(), *STEP_DELAYS_MS}))


@dataclass(frozen=True)
class Ack:
    pass


@dataclass(frozen=True)
class RetryLater:
    # The whole delay: the policy's, or the one the handler asked for (``Retry(after_s=)``).
    delay_ms: int


@dataclass(frozen=True)
class GiveUp:
    """Move the task to its dead-letter queue with ``reason``."""

    reason: DeadLetterReason


Decision = Ack | RetryLater | GiveUp


def decide(attempt: int, error: BaseException | None, policy: RetryPolicy) -> Decision:
    """What to do with a delivery whose handler ran as attempt ``attempt`` (1-based)."""
    if error is None:
        return Ack()
    if isinstance(error, Reject):
        return GiveUp(DeadLetterReason.REJECTED)
    if attempt > policy.max_retries:
        return GiveUp(DeadLetterReason.RETRIES_EXHAUSTED)
    if isinstance(error, Retry) and error.after_ms is not None:
        return RetryLater(error.after_ms)
    return RetryLater(policy.delay_ms(attempt))

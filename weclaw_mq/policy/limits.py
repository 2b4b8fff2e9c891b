"""Per-key concurrency, rate and token limits of a handler: what the user declares.

    @app.handler("chat", limit=Limit(key=lambda task: task.user_id, concurrency=2))
    @app.handler("embed", limit=[Limit(key=lambda t: t.user_id, rate=5), Limit(rate=100)])
    @app.handler("answer", limit=Limit(key=lambda t: t.model, tokens=90_000, rate=500, per_s=60))

A ``Limit`` holds tasks that share a key (``key(task)``; ``key=None``: every task of the
handler shares one) to at most ``concurrency`` running at once across every worker, and/or at
most ``rate`` starts in any window of ``per_s`` seconds, and/or at most ``tokens`` model tokens
started in any such window: a task is admitted when its estimated tokens (``estimate(task)``,
by default the payload's JSON length / 4) fit, and settled with what the handler reports
(``ctx.usage``), so the estimate's error does not accumulate. A task over a limit is deferred: moved
to one of the handler's delay queues without spending an attempt, so it leaves the worker's
prefetch window at once and other keys flow past it. The counting lives in Redis
(``llm.limiting``), with leases that lapse when a worker dies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from weclaw_mq.errors import ConfigurationError

# What a key function may return: an id, or None for "this task is not limited by it".
KeyValue = str | int | None
KeyFunc = Callable[[Any], KeyValue]


class LimitKind(StrEnum):
    """Which part of a limit held a task back (the ``limit`` label of the deferral metric)."""

    CONCURRENCY = "concurrency"
    RATE = "rate"
    TOKENS = "tokens"
    # The model API answered 429 with a Retry-After (``Retry(after_s=...)``): the key admits
    # nothing until then.
    BLOCKED = "blocked"


# Characters per token of the default estimate: a common rule of thumb for English text with
# the GPT and Claude tokenizers; give ``estimate=`` for anything better.
CHARS_PER_TOKEN = 4
EstimateFunc = Callable[[Any], int]


@dataclass(frozen=True)
class Limit:
    """At most ``concurrency`` tasks per key at once, ``rate`` starts and ``tokens`` per ``per_s``.

    Args:
        key: A function of the validated task (the handler's first argument) returning the
            key as ``str`` or ``int``; ``None`` for a task means that task is not held by
            this limit. Without ``key`` the limit is one global limit of the handler.
        concurrency: At most this many tasks of one key run at once, across every worker.
        rate: At most this many tasks of one key start in any window of ``per_s`` seconds.
        per_s: The window of ``rate`` and ``tokens``, in seconds (at least 0.001).
        tokens: At most this many model tokens (estimated at admission, settled with the
            usage the handler reports) started per key in any window of ``per_s``. A task
            estimated over the whole budget runs alone in its window.
        estimate: A function of the validated task returning its expected tokens (prompt
            and answer); default the payload's JSON length divided by ``CHARS_PER_TOKEN``.
        per_model: Count per model: the key is the model the attempt calls (``ctx.model``,
            chosen by the handler's ``fallback=`` or a tenant's ``cap=``), joined with
            ``key``'s value when both are given; so each model of a chain has its own budget.

    Raises:
        ConfigurationError: None of ``concurrency``, ``rate`` and ``tokens`` is given, one is
            not an int of at least 1, ``per_s`` is under 0.001, ``key`` or ``estimate`` is
            not callable, or ``estimate`` is given without ``tokens``.
    """

    key: KeyFunc | None = None
    concurrency: int | None = None
    rate: int | None = None
    per_s: float = 1.0
    tokens: int | None = None
    estimate: EstimateFunc | None = None
    per_model: bool = False

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None and self.tokens is None:
            raise ConfigurationError("a Limit needs concurrency=, rate=, tokens= or some of them")
        for name, value in (
            ("concurrency", self.concurrency),
            ("rate", self.rate),
            ("tokens", self.tokens),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigurationError(f"Limit {name} must be an int, got {value!r}")
            if value is not None and value < 1:
                raise ConfigurationError(f"Limit {name} must be >= 1, got {value}")
        if not self.per_s >= 0.001:
            raise ConfigurationError(f"Limit per_s must be >= 0.001, got {self.per_s}")
        if self.key is not None and not callable(self.key):
            raise ConfigurationError(f"Limit key must be a function of the task, got {self.key!r}")
        if self.estimate is not None and not callable(self.estimate):
            raise ConfigurationError(
                f"Limit estimate must be a function of the task, got {self.estimate!r}"
            )
        if self.estimate is not None and self.tokens is None:
            raise ConfigurationError("Limit estimate= estimates tokens: give tokens= too")
        if not isinstance(self.per_model, bool):
            raise ConfigurationError(
                f"Limit per_model must be True or False, got {self.per_model!r}"
            )

    @property
    def period_ms(self) -> int:
        """``per_s`` in milliseconds."""
        return round(self.per_s * 1000)

    def estimated(self, task: Any, body_bytes: int) -> int:
        """The tokens a task is admitted with.

        Args:
            task: The validated task.
            body_bytes: Its body's length, for the default estimate.

        Returns:
            ``estimate(task)``, else the body's length over ``CHARS_PER_TOKEN`` (at least 1).

        Raises:
            ValueError: ``estimate`` returned something that is not an int of at least 0.
        """
        if self.estimate is None:
            return max(1, -(-body_bytes // CHARS_PER_TOKEN))
        value = self.estimate(task)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"the limit's estimate returned {value!r}; it must return an int >= 0")
        return value


def as_limits(limit: Limit | Sequence[Limit] | None) -> tuple[Limit, ...]:
    """``limit=`` of a handler as a tuple (checked at registration)."""
    if limit is None:
        return ()
    limits = (limit,) if isinstance(limit, Limit) else tuple(limit)
    for one in limits:
        if not isinstance(one, Limit):
            raise ConfigurationError(f"limit= takes Limit objects, got {one!r}")
    return limits


# Deferral delays of a limited handler: powers of two from 125 ms to 16 s, one delay queue
# each. A deferred task waits the first of them at or past its expected wait (see
# ``deferral_ms``): never less than the wait, at most twice it below 16 s. Bounded, so any
# wait costs at most these eight queues.
DEFER_LADDER_MS = (125, 250, 500, 1000, 2000, 4000, 8000, 16000)


def deferral_ms(wait_ms: float) -> int:
    """The delay queue for a task expected to get in after ``wait_ms``."""
    for delay in DEFER_LADDER_MS:
        if delay >= wait_ms:
            return delay
    return DEFER_LADDER_MS[-1]


def early_deferral_ms(wait_ms: float) -> int:
    """The delay queue for a task over a token limit: the longest rung not longer than
    ``wait_ms`` (the shortest under it). It comes back at most that early and is deferred
    again for what is left, so the window's tokens are taken up within a rung of freeing
    instead of up to twice the wait later (``make bench-token-budget``: goodput)."""
    fitting = [delay for delay in DEFER_LADDER_MS if delay <= wait_ms]
    return fitting[-1] if fitting else DEFER_LADDER_MS[0]

"""The circuit breaker of a handler queue: its options (``Breaker``), the error that trips it
(``UpstreamDown``), and its pure state machine (``Circuit``), driven by an injected clock.

The worker (``worker.pausing``) feeds it handler outcomes and does what its states mean:
CLOSED consumes as usual; OPEN cancels the queue's consumer(s) for ``cooldown_s``; HALF_OPEN
takes one probe task; the probe's outcome closes or reopens it.

Per worker process: nothing is shared in Redis, so each worker trips and probes on its own
(N workers: up to N probes per cool-down). Within one worker, an outage costs at most
``failures + concurrency - 1`` failed attempts while it trips (the tasks already running when
it opens may fail too), then at most one probe per cool-down (``Breaker.attempts_bound``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from weclaw_mq.errors import ConfigurationError


class UpstreamDown(Exception):
    """Raise from a handler when the service it calls is down (a 5xx, a refused connection).

    It fails the attempt like any error, and counts toward the handler's circuit breaker.
    """

    error_type: ClassVar[str] = "weclaw_mq.UpstreamDown"  # stable, as in ``errors``


class CircuitState(StrEnum):
    CLOSED = "closed"  # consuming
    OPEN = "open"  # not consuming until the cool-down ends
    HALF_OPEN = "half_open"  # one probe task running


ErrorClasses = type[BaseException] | tuple[type[BaseException], ...]


@dataclass(frozen=True)
class Breaker:
    """``failures`` failures counted within ``window_s`` open the circuit for ``cooldown_s``.

    Args:
        failures: How many counted failures open the circuit (at least 1).
        window_s: The window the failures are counted in, in seconds.
        cooldown_s: How long the circuit stays open before a probe, in seconds.
        on: Which errors count: ``UpstreamDown`` by default, a class or a tuple of classes
            of yours, or ``Exception`` for every failure. Other errors neither count nor
            reset.

    Raises:
        ConfigurationError: ``failures`` under 1, a ``window_s`` or ``cooldown_s`` not over
            0, or an ``on`` that is not an exception class or a tuple of them.
    """

    failures: int = 5
    window_s: float = 30.0
    cooldown_s: float = 30.0
    on: ErrorClasses = UpstreamDown

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ConfigurationError(f"breaker failures must be >= 1, got {self.failures}")
        if self.window_s <= 0 or self.cooldown_s <= 0:
            raise ConfigurationError("breaker window_s and cooldown_s must be > 0")
        classes = self.on if isinstance(self.on, tuple) else (self.on,)
        if not classes or not all(
            isinstance(c, type) and issubclass(c, BaseException) for c in classes
        ):
            raise ConfigurationError(
                f"breaker on= takes an exception class or a tuple of them, got {self.on!r}"
            )

    def counts(self, error: BaseException | None) -> bool:
        """Whether a handler outcome counts toward opening the circuit.

        Args:
            error: What the handler raised; None when it returned.

        Returns:
            True for an instance of ``on``.
        """
        return error is not None and isinstance(error, self.on)

    def attempts_bound(self, concurrency: int, outage_s: float) -> int:
        """Failed attempts one worker spends on an outage, at most.

        ``failures`` trip it, ``concurrency - 1`` others may be running then, and each
        cool-down lets one probe through.

        Args:
            concurrency: The worker's concurrency.
            outage_s: The outage's length in seconds, counted from its first failure.

        Returns:
            The bound on failed attempts.
        """
        return self.failures + concurrency - 1 + int(outage_s // self.cooldown_s) + 1


class Circuit:
    """The state machine; no I/O. ``clock`` gives seconds (monotonic)."""

    def __init__(self, breaker: Breaker, clock: Callable[[], float]) -> None:
        self.breaker = breaker
        self.clock = clock
        self.state = CircuitState.CLOSED
        self._failures: deque[float] = deque()  # times of counted failures in the window
        self._opened_at = 0.0

    @property
    def probe_at(self) -> float | None:
        """When the open circuit may let a probe through (None unless OPEN)."""
        if self.state is not CircuitState.OPEN:
            return None
        return self._opened_at + self.breaker.cooldown_s

    def record(self, error: BaseException | None, *, probe: bool = False) -> CircuitState | None:
        """A handler outcome (``error`` None: it returned); the new state if it changed.

        Only the probe's outcome moves a HALF_OPEN circuit; outcomes of tasks that were
        running when the circuit opened change nothing once it is open."""
        now = self.clock()
        if self.state is CircuitState.HALF_OPEN:
            if not probe:
                return None
            return self._open(now) if self.breaker.counts(error) else self._close()
        if self.state is CircuitState.OPEN or not self.breaker.counts(error):
            return None
        self._failures.append(now)
        while self._failures and self._failures[0] <= now - self.breaker.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.breaker.failures:
            return self._open(now)
        return None

    def half_open(self) -> CircuitState | None:
        """The cool-down is over: HALF_OPEN (None if it is not over, or not OPEN)."""
        at = self.probe_at
        if at is None or self.clock() < at:
            return None
        self.state = CircuitState.HALF_OPEN
        return self.state

    def reopen(self) -> CircuitState | None:
        """No probe could be made (the queue was empty, the probe never reached the handler,
        the connection was lost): OPEN for another cool-down."""
        if self.state is not CircuitState.HALF_OPEN:
            return None
        return self._open(self.clock())

    def _open(self, now: float) -> CircuitState:
        self.state = CircuitState.OPEN
        self._opened_at = now
        self._failures.clear()
        return self.state

    def _close(self) -> CircuitState:
        self.state = CircuitState.CLOSED
        self._failures.clear()
        return self.state

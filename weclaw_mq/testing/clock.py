"""The test broker's clock: real time plus the time it skipped.

A retry waits 5 s, 10 s, 20 s in production; a test should not. When nothing is left to run
but tasks parked in delay queues, ``TestBroker`` moves this clock forward to the moment the
next one is due, instead of waiting. Everything that reads time for a task's rules reads
this clock while the broker is open: the deadlines and not-before times the worker checks
(``weclaw_mq.contract.lifetime.now_ms``), the leases and record TTLs of the in-memory task store,
the
inbox TTLs of the in-memory stream store, and the delay queues' own expiry. A handler's
timeout is not on it: that is real time (``Deadlines``), as a handler's own work is.
"""

from __future__ import annotations

import time

from weclaw_mq.errors import ConfigurationError


class VirtualClock:
    """Real time, moved forward by ``advance``; never backwards."""

    def __init__(self) -> None:
        self.skipped_s = 0.0  # how far ahead of real time this clock is

    def time(self) -> float:
        """Seconds since the epoch, as ``time.time()`` would say after the skipped time."""
        return time.time() + self.skipped_s

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped_s

    def now_ms(self) -> int:
        return int(self.time() * 1000)

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:  # also refuses NaN
            raise ConfigurationError(f"the clock only moves forward; got {seconds!r} s")
        self.skipped_s += seconds

    def advance_to_ms(self, at_ms: int) -> None:
        """Move forward until ``now_ms()`` reads at least ``at_ms`` (no-op if it does)."""
        behind_ms = at_ms - self.now_ms()
        if behind_ms > 0:
            # A microsecond over: float rounding must not leave now_ms() one short of at_ms.
            self.advance(behind_ms / 1000 + 1e-6)

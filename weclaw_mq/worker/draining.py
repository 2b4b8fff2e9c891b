"""How a worker's stop ends its in-flight deliveries: within the grace, then cancelled, then
left behind (``InFlight.abandon``; a handler that ignored its cancellation mid-delivery is
taken over by ``InFlight.replace``).

A mixin of ``consume.Worker``: it reads the worker's attributes declared below.
"""

from __future__ import annotations

import asyncio
import logging

from weclaw_mq.worker.in_flight import InFlight
from weclaw_mq.worker.long_runs import LongRuns

log = logging.getLogger("weclaw_mq.worker")

# After the grace, cancelled handlers get this long to give their messages back.
DRAIN_CANCEL_S = 5.0


class Draining:
    """The worker's drain at a stop."""

    shutdown_grace_s: float
    _in_flight: InFlight
    _long_runs: LongRuns | None

    async def _drain(self) -> None:
        """Wait for in-flight handlers up to the grace period, then cancel the rest; they
        give their messages back. Bounded: a handler that ignores its cancellation is left."""
        running = self._in_flight.all()
        if not running:
            return
        handed = [t for t in running if self._long_runs is not None and t in self._long_runs.tasks]
        if handed:
            # They hold no delivery, and may run for hours: handed over now (each publishes
            # its copy for the next worker as it ends: worker.long_runs), not waited for.
            log.info("handing over %d long run(s) to the next worker", len(handed))
            for task in handed:
                task.cancel()
        log.info(
            "waiting up to %.0f s for %d in-flight task(s)", self.shutdown_grace_s, len(running)
        )
        _, pending = await asyncio.wait(running, timeout=self.shutdown_grace_s)
        if not pending:
            return
        for task in pending:
            task.cancel()
        log.warning(
            "%d task(s) still running after the grace period were cancelled; their messages "
            "go back to the queue",
            len(pending),
        )
        _, stuck = await asyncio.wait(pending, timeout=DRAIN_CANCEL_S)
        if stuck:
            log.error(
                "%d handler(s) ignored their cancellation; leaving them behind (their messages "
                "return to the queue when the connection closes)",
                len(stuck),
            )
            for task in stuck:
                self._in_flight.abandon(task)

"""What a worker reports on ``/healthz`` (``observability.metrics_server``): is it working now?

Healthy means both: its broker connections (consuming, publishing) are open, and every
handler queue it serves is being consumed. A queue whose circuit breaker is open is
``paused`` on purpose, waiting for its upstream, and counts as healthy: restarting the worker
would not bring the upstream back.
A queue is ``down`` while there is no session (connecting, reconnecting, stopping) and while
the broker has cancelled its consumer and the worker has not consumed it again yet.
A worker that fires the schedules (``--schedules``) also says what its scheduler does.
A worker of plain-``def`` handlers is also unhealthy while every one of its sync threads is
held by a call past its timeout (``sync_threads.stuck``): a thread cannot be killed, so no
plain-def task can start until one returns on its own, and a restart frees them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class QueueState(StrEnum):
    CONSUMING = "consuming"
    PAUSED = "paused"  # its circuit breaker is open (or probing)
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    broker_open: bool
    queues: Mapping[str, QueueState]
    # The scheduler it runs (``--schedules``), as ``Scheduler.state`` says; None without. Shown,
    # not counted in ``ok``: a restart of the worker would not mend Redis or a schedule.
    scheduler: str | None = None
    # The plain-def handlers' threads: how many, and how many are held by calls past their
    # timeout (0 and 0 for a worker without plain-def handlers).
    sync_threads: int = 0
    sync_threads_stuck: int = 0

    @property
    def ok(self) -> bool:
        threads_stuck = self.sync_threads > 0 and self.sync_threads_stuck >= self.sync_threads
        return (
            self.broker_open and QueueState.DOWN not in self.queues.values() and not threads_stuck
        )

    def as_json(self) -> Mapping[str, object]:
        document: dict[str, object] = {
            "status": "ok" if self.ok else "unavailable",
            "broker": "open" if self.broker_open else "closed",
            "queues": {queue: state.value for queue, state in self.queues.items()},
        }
        if self.scheduler is not None:
            document["scheduler"] = self.scheduler
        if self.sync_threads:
            document["sync_threads"] = {
                "size": self.sync_threads,
                "stuck": self.sync_threads_stuck,
            }
        return document

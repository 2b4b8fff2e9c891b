"""What a worker tells its heartbeat about itself (``weclaw-mq inspect``, the console): its
state, its breakers that are not closed, and its sync threads.

A mixin of ``consume.Worker``: it reads the worker's attributes declared below.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from weclaw_mq.app import App
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.breaker import CircuitState
from weclaw_mq.settings import Settings
from weclaw_mq.state.worker_registry import registry_of
from weclaw_mq.worker.beat import Beat
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.health import WorkerHealth
from weclaw_mq.worker.pausing import QueueCircuit


class Status:
    """The worker's heartbeat (``worker.beat``) and what it reports."""

    app: App
    settings: Settings
    specs: list[HandlerSpec]
    concurrency: int
    cancels: Cancels
    worker_id: str
    ready: asyncio.Event
    _stop: asyncio.Event
    _circuits: dict[str, QueueCircuit]

    if TYPE_CHECKING:
        # Worker's public method, kept there for the API reference (no inherited members).
        def health(self) -> WorkerHealth: ...

    def _beat(self, store: object) -> Beat | None:
        registry = registry_of(store)
        if registry is None:
            return None
        return Beat(
            registry,
            worker_id=self.worker_id,
            app=self.app.name,
            queues=[s.queue for s in self.specs],
            concurrency=self.concurrency,
            cancels=self.cancels,
            state=self._state,
            interval_s=self.settings.worker_beat_s,
            leave_timeout_s=self.settings.redis_timeout_s,
            breakers=self._open_breakers,
            sync_threads=self._sync_thread_counts,
        )

    def _sync_thread_counts(self) -> tuple[int, int]:
        """(threads, held by calls past their timeout): (0, 0) without plain-def handlers."""
        health = self.health()
        return health.sync_threads, health.sync_threads_stuck

    def _open_breakers(self) -> dict[str, str]:
        """This worker's breakers that are not closed, for its heartbeat (the console)."""
        return {
            queue: circuit.state.value
            for queue, circuit in self._circuits.items()
            if circuit.state is not CircuitState.CLOSED
        }

    def _state(self) -> str:
        if self._stop.is_set():
            return "stopping"
        return "consuming" if self.ready.is_set() else "connecting"

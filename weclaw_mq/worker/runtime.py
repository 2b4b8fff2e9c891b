"""What a delivery needs from the worker that received it (or from the test kit's broker)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.handlers.middleware import Chain
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.settings import Settings
from weclaw_mq.state import TaskStore
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.deadlines import Deadlines
from weclaw_mq.worker.pausing import QueueCircuit
from weclaw_mq.worker.settle import Settler
from weclaw_mq.worker.sync_threads import SyncThreads

if TYPE_CHECKING:
    from weclaw_mq.app import App
    from weclaw_mq.observability.otel import Spans


@dataclass(frozen=True)
class Runtime:
    """What a delivery needs from the worker that received it."""

    app: App
    settings: Settings
    settler: Settler
    deadlines: Deadlines
    metrics: Metrics
    # The task store, for claims; None when no handler is guarded and results are off.
    store: TaskStore | None
    # The same store when results are on (records are written), else None.
    results: TaskStore | None
    # take_over(message, spec, rt, stuck, ending) runs a delivery's ending in a new task in
    # place of ``stuck``, whose handler ignored its cancellation; the worker counts the new
    # task as in flight, not the old one, and settles the message if the ending fails.
    take_over: Callable[
        [
            AbstractIncomingMessage,
            HandlerSpec,
            Runtime,
            asyncio.Task[Any],
            Coroutine[Any, Any, None],
        ],
        None,
    ]
    # The deliveries being processed, for cancel requests (worker.cancel_watch).
    cancels: Cancels = field(default_factory=Cancels)
    # The circuit breaker of each handler queue that has one (``worker.pausing``).
    circuits: Mapping[str, QueueCircuit] = field(default_factory=dict)
    # OpenTelemetry spans (``weclaw_mq.observability.otel``); None when off: one check per delivery.
    spans: Spans | None = None
    # The threads plain-``def`` handlers run in (``worker.sync_threads``): the worker's one
    # pool, outliving its broker sessions; no thread is made before such a handler runs.
    threads: SyncThreads = field(default_factory=SyncThreads)
    # The App's middleware when it has run hooks (``worker.run_hooks``), else None: one
    # check per delivery.
    hooks: Chain | None = None
    # Whether a handler's runs pass its own middleware too (``App.handler_chain``: its cap,
    # fallback chain, limits, costs); the test kit runs the App's alone.
    handler_middleware: bool = True
    # Each handler queue's ``worker.attempt.Pipeline``, made at its first delivery (typed
    # Any: attempt.py reads this module, and an import back would close a cycle).
    pipelines: dict[str, Any] = field(default_factory=dict)
    # The worker's ``worker.long_runs.LongRuns``; None in the test kit, which runs a
    # ``long_running`` handler as any other (no consumer timeout there to outlive). Typed Any
    # as ``pipelines``: long_runs reads this module.
    long_runs: Any = None

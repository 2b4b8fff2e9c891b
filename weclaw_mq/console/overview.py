"""The overview page's document: every handler queue of the app with its depths (the work
queue, its lanes, the shared delay queues it uses, its DLQ: ``admin.queue_stats``), its
limits and breaker as configured, and the live workers with the tasks each runs now (the
worker registry ``weclaw-mq inspect`` reads).

The queues are counted over one connection per read (``admin.queue_stats.stats_on``).
AMQP tells a queue's ready messages and consumers, not its unacked ones: the tasks the live
workers report running stand in for those. A breaker's state lives in each worker's memory:
each worker's heartbeat says which of its breakers are open or half open, and the overview
counts the workers per state beside how the breaker is configured.

One read serves every console open at once: the document is kept ``fresh_s`` (a passive
declare per queue and one Redis script per read), so twenty pages polling every few seconds
cost the broker and Redis what one does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from weclaw_mq.admin.dlq_pass import connected
from weclaw_mq.admin.queue_stats import QueueStats, handler_retry_delays_ms, stats_on
from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError, WeclawMQError
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.limits import Limit
from weclaw_mq.state.worker_registry import WorkerRecord, registry_of

# How long one read of the broker and Redis serves every page that asks.
FRESH_S = 2.0


def describe_limit(limit: Limit) -> str:
    """``per key: 2 at once, 10 per 1 s`` and the like."""
    parts = []
    if limit.concurrency is not None:
        parts.append(f"{limit.concurrency} at once")
    if limit.rate is not None:
        parts.append(f"{limit.rate} per {limit.per_s:g} s")
    if limit.tokens is not None:
        parts.append(f"{limit.tokens} tokens per {limit.per_s:g} s")
    keys = [name for name, on in (("model", limit.per_model), ("key", limit.key)) if on]
    scope = f"per {' and '.join(keys)}" if keys else "global"
    return f"{scope}: {', '.join(parts)}"


def describe_breaker(spec: HandlerSpec) -> str | None:
    breaker = spec.breaker
    if breaker is None:
        return None
    return (
        f"opens after {breaker.failures} failure(s) in {breaker.window_s:g} s, "
        f"for {breaker.cooldown_s:g} s"
    )


def breakers_in(queue: str, workers: Sequence[WorkerRecord]) -> dict[str, int]:
    """How many live workers report ``queue``'s breaker open, half open (none: closed)."""
    states: dict[str, int] = {}
    for w in workers:
        state = w.breakers.get(queue)
        if state is not None:
            states[state] = states.get(state, 0) + 1
    return states


def _queue_document(
    spec: HandlerSpec,
    counted: QueueStats | None,
    problem: str | None,
    running: int,
    breakers: dict[str, int],
) -> dict[str, Any]:
    def count(c: Any) -> dict[str, Any]:
        return {"name": c.name, "exists": c.exists, "ready": c.messages, "consumers": c.consumers}

    return {
        "queue": spec.queue,
        "problem": problem,
        "work": count(counted.work) if counted else None,
        "lanes": [count(c) for c in counted.lanes] if counted else [],
        "delays": [count(c) for c in counted.retries if c.exists] if counted else [],
        "old": [count(c) for c in counted.old] if counted else [],
        "dlq": count(counted.dlq) if counted else None,
        "running": running,
        "limits": [describe_limit(limit) for limit in spec.limits],
        "breaker": describe_breaker(spec),
        "breaker_states": breakers,
        "idempotent": spec.idempotent,
        "sync": spec.is_sync,
    }


def _worker_document(w: WorkerRecord) -> dict[str, Any]:
    document = asdict(w)
    document["tasks"] = [asdict(t) for t in w.tasks]
    return document


def running_in(queue: str, workers: Sequence[WorkerRecord]) -> int:
    """The tasks of ``queue`` the live workers report running (those each record lists)."""
    return sum(1 for w in workers for t in w.tasks if t.queue == queue)


class Overview:
    """The overview of ``app``, read at most once per ``fresh_s`` whoever asks."""

    def __init__(self, app: App, *, fresh_s: float = FRESH_S) -> None:
        self._app = app
        self._fresh_s = fresh_s
        self._lock = asyncio.Lock()
        self._document: dict[str, Any] | None = None
        self._read_at = 0.0

    async def document(self) -> dict[str, Any]:
        async with self._lock:
            if self._document is None or time.monotonic() - self._read_at >= self._fresh_s:
                self._document = await self._read()
                self._read_at = time.monotonic()
            return self._document

    async def _read(self) -> dict[str, Any]:
        workers, workers_problem = await self._workers()
        queues = list(self._app.handlers)
        served = [w for w in workers if set(w.queues) & set(queues)]
        counts = await self._counts()
        rows = []
        for queue, spec in self._app.handlers.items():
            counted = counts[queue]
            rows.append(
                _queue_document(
                    spec,
                    counted if isinstance(counted, QueueStats) else None,
                    counted if isinstance(counted, str) else None,
                    running_in(queue, served),
                    breakers_in(queue, served),
                )
            )
        settings = self._app.settings
        return {
            "app": self._app.name,
            "broker": settings.amqp_url_redacted(),
            "redis": settings.redis_url_redacted() if self._app.needs_store else None,
            "queues": rows,
            "workers": [_worker_document(w) for w in served],
            "workers_problem": workers_problem,
            "read_at": time.time(),
        }

    async def _counts(self) -> dict[str, QueueStats | str]:
        """Each handler queue's counts, or why there are none (not declared yet, the broker
        away), over one connection for all."""
        counts: dict[str, QueueStats | str] = {}
        try:
            async with connected(self._app, "console") as conn:
                for queue in self._app.handlers:
                    delays = handler_retry_delays_ms(self._app, queue)
                    try:
                        counts[queue] = await stats_on(
                            conn, self._app, queue, retry_delays_ms=delays
                        )
                    except ConfigurationError as e:  # not declared yet
                        counts[queue] = str(e)
        except WeclawMQError as e:  # the broker is away
            return dict.fromkeys(self._app.handlers, str(e))
        return counts

    async def _workers(self) -> tuple[list[WorkerRecord], str | None]:
        if not self._app.needs_store:
            return [], "no task store (results off, no handler guarded): workers keep no record"
        registry = registry_of(self._app.store)
        if registry is None:
            return [], "the task store is not Redis: workers keep no record"
        try:
            return await registry.read(), None
        except WeclawMQError as e:
            return [], str(e)

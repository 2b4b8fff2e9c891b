"""Every Prometheus collector weclaw_mq exports, in one injectable registry.

Labels stay low-cardinality: queue names and a fixed set of outcomes, never task ids.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .breaker import CircuitState

if TYPE_CHECKING:
    from .metrics_http import HealthReport, MetricsServer


class Outcome(StrEnum):
    """How a delivery ended: one per settled delivery (``settle.Settler._ended``)."""

    ACKED = "acked"  # result stored, then acked
    RETRIED = "retried"  # moved to a delay queue as the next attempt
    DEAD_LETTERED = "dead_lettered"  # moved to Q.dlq, or rejected there (undecodable properties)
    DUPLICATE = "duplicate"  # a finished task seen again: acked unrun
    DEFERRED = "deferred"  # parked in a delay queue: its twin is running, or Redis is down
    CANCELLED = "cancelled"  # cancelled (App.cancel): acked unrun, or its handler cut short
    # Given back to its queue (a failed move, a result not stored, a hard stop, an error of
    # ours) or left unacked for the broker to return (arrived while stopping).
    REQUEUED = "requeued"


class NotifyOutcome(StrEnum):
    """How publishing one result notification ended (``worker/notify.py``)."""

    PUBLISHED = "published"  # confirmed by the broker, before the task's ack
    FAILED = "failed"  # nacked, unroutable, timed out or lost: the task was not acked


# LLM calls take 20-60 s: buckets reach past two minutes.
HANDLER_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 300)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "weclaw_mq_published", "Publishes by outcome.", ["queue", "outcome"], registry=r
        )
        self.messages = Counter(
            "weclaw_mq_messages",
            "Deliveries settled, by outcome.",
            ["queue", "outcome"],
            registry=r,
        )
        self.handler_seconds = Histogram(
            "weclaw_mq_handler_seconds",
            "Handler run time.",
            ["queue"],
            buckets=HANDLER_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "weclaw_mq_in_flight", "Deliveries being processed now.", ["queue"], registry=r
        )
        self.reconnects = Counter(
            "weclaw_mq_reconnects", "Broker connections re-established.", ["role"], registry=r
        )
        # The local outbox (weclaw_mq.outbox): tasks stored there instead of on the broker,
        # tasks its relay got confirmed, and its size as the relay last read it.
        self.outbox_stored = Counter(
            "weclaw_mq_outbox_stored", "Tasks stored in the local outbox.", ["queue"], registry=r
        )
        self.outbox_relayed = Counter(
            "weclaw_mq_outbox_relayed",
            "Tasks the outbox relay sent and got confirmed.",
            ["queue"],
            registry=r,
        )
        self.outbox_rows = Gauge(
            "weclaw_mq_outbox_rows", "Tasks in the local outbox, not yet on the broker.", registry=r
        )
        self.outbox_oldest_age = Gauge(
            "weclaw_mq_outbox_oldest_age_seconds",
            "Age of the oldest task in the local outbox (0 when empty).",
            registry=r,
        )
        # Tasks a handler's limit held back (weclaw_mq.limits): by the handler queue and the
        # limit's kind only, never by key (a user id per label would grow without bound).
        self.limit_deferrals = Counter(
            "weclaw_mq_limit_deferrals",
            "Tasks deferred by a per-key limit, by handler queue and limit kind.",
            ["queue", "limit"],
            registry=r,
        )
        self.notifications = Counter(
            "weclaw_mq_notifications",
            "Result notifications, by the handler queue and outcome.",
            ["queue", "outcome"],
            registry=r,
        )
        # Circuit breakers (weclaw_mq.breaker), per handler queue in this worker.
        self.breaker_state = Gauge(
            "weclaw_mq_breaker_state",
            "Circuit breaker of a handler queue: 1 for its current state, 0 for the others.",
            ["queue", "state"],
            registry=r,
        )
        self.breaker_opened = Counter(
            "weclaw_mq_breaker_opened",
            "Times a handler queue's circuit breaker opened (failed probes included).",
            ["queue"],
            registry=r,
        )

        # Label lookups take a lock and build a tuple: done once per (queue, outcome), not
        # once per message.
        self._settled: dict[tuple[str, Outcome], Counter] = {}
        self._published: dict[tuple[str, str], Counter] = {}
        self._timing: dict[str, Histogram] = {}

    def settled(self, queue: str, outcome: Outcome) -> Counter:
        child = self._settled.get((queue, outcome))
        if child is None:
            child = self._settled[queue, outcome] = self.messages.labels(queue, outcome.value)
        return child

    def publish_outcome(self, queue: str, outcome: str) -> Counter:
        child = self._published.get((queue, outcome))
        if child is None:
            child = self._published[queue, outcome] = self.published.labels(queue, outcome)
        return child

    def notified(self, queue: str, outcome: NotifyOutcome) -> Counter:
        # Once per finished task of a notify handler: labels looked up each time are cheap
        # next to the confirmed publish they count.
        return self.notifications.labels(queue, outcome.value)

    def limit_deferred(self, queue: str, kind: str) -> Counter:
        return self.limit_deferrals.labels(queue, kind)

    def handler_timing(self, queue: str) -> Histogram:
        child = self._timing.get(queue)
        if child is None:
            child = self._timing[queue] = self.handler_seconds.labels(queue)
        return child

    def circuit_state(self, queue: str, state: CircuitState) -> None:
        for each in CircuitState:
            self.breaker_state.labels(queue, each.value).set(1 if each is state else 0)

    def circuit_opened(self, queue: str) -> Counter:
        return self.breaker_opened.labels(queue)

    def count_in_flight(self, queue: str, running: Callable[[], int]) -> None:
        """The in-flight gauge reads ``running()`` when scraped: no cost per message."""
        self.in_flight.labels(queue).set_function(running)

    def serve(
        self,
        port: int,
        addr: str = "127.0.0.1",
        *,
        health: Callable[[], HealthReport] | None = None,
    ) -> MetricsServer:
        """Serve ``/metrics`` (and ``/healthz`` when given ``health``) on ``addr:port``
        (``settings.metrics_addr``: this host only unless opened on purpose)."""
        # Imported here: the HTTP server is not needed by processes that only publish.
        from .metrics_http import MetricsServer

        return MetricsServer(self.registry, port, addr=addr, health=health)

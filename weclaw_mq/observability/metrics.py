"""Every Prometheus metric weclaw_mq exports, in one injectable registry.

Labels stay low-cardinality: queue names and a fixed set of outcomes, never task ids.

The values live in plain objects of this module: counting one delivery is an attribute add,
without prometheus_client's lock per child, and a worker that serves no metrics port never
imports prometheus_client (about 2.6 MiB of its idle RSS). ``Metrics.registry`` imports it
when first read (the metrics port, tests, a caller's own exporter) and exposes the same
series prometheus_client's ``Counter``/``Gauge``/``Histogram`` would: ``_total`` and
``_created`` for counters, cumulative ``_bucket``, ``_count``, ``_sum`` and ``_created`` for
histograms. Values are changed on the worker's event loop thread only; the metrics server's
thread reads them.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Generic, TypeVar

from weclaw_mq.policy.breaker import CircuitState

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from weclaw_mq.observability.metrics_server import HealthReport, MetricsServer


class Outcome(StrEnum):
    """How a delivery ended: one per settled delivery (``settle.Settler._ended``)."""

    ACKED = "acked"  # result stored, then acked
    RETRIED = "retried"  # moved to a delay queue as the next attempt
    DEAD_LETTERED = "dead_lettered"  # moved to Q.dlq, or rejected there (undecodable properties)
    DUPLICATE = "duplicate"  # a finished task seen again: acked unrun
    # Parked in a delay queue without an attempt: its twin is running, Redis is down, over a
    # per-key limit, not due yet (a delay hop), its circuit breaker opened, or its results
    # queue refused the notification.
    DEFERRED = "deferred"
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
GROUP_PARTS_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000)


class Count:
    """One labelled series of a counter."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class Level:
    """One labelled series of a gauge: a value set, or a function read when scraped."""

    __slots__ = ("function", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.function: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        self.value = float(value)

    def set_function(self, function: Callable[[], float]) -> None:
        self.function = function

    def read(self) -> float:
        return float(self.function()) if self.function is not None else self.value


class Timing:
    """One labelled series of a histogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("bounds", "buckets", "created", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds  # ascending, the last one +Inf
        self.buckets = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bucket whose upper bound is >= amount, as prometheus_client counts it.
        self.buckets[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


S = TypeVar("S", Count, Level, Timing)

# The model label of the usage metrics for a model the App has no price for: handlers name
# models with any string (ctx.usage), and a label each would grow without bound. The priced
# ones are the App's own list; the cost ledger ('weclaw-mq costs --by model') names them all.
UNPRICED_MODEL = "unpriced"


class Family(Generic[S]):
    """A metric: its name, help, label names, and one series per label values."""

    def __init__(
        self,
        kind: str,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        new: Callable[[], S],
    ) -> None:
        self.kind = kind  # "counter", "gauge" or "histogram"
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new: Callable[[], S] = new
        self.children: dict[tuple[str, ...], S] = {}

    def labels(self, *values: str) -> S:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes the labels {self.labelnames}, got {values}")
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self._new()
        return child

    def series(self) -> list[tuple[tuple[str, ...], S]]:
        # A copy: the metrics server's thread reads while the loop may add a child.
        return list(self.children.items())


def _counter(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Family[Count]:
    return Family("counter", name, documentation, labelnames, Count)


def _gauge(name: str, documentation: str, labelnames: Sequence[str] = ()) -> Family[Level]:
    return Family("gauge", name, documentation, labelnames, Level)


def _histogram(
    name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
) -> Family[Timing]:
    bounds = (*(float(b) for b in buckets), float("inf"))
    return Family("histogram", name, documentation, labelnames, lambda: Timing(bounds))


_AnyFamily = Family[Count] | Family[Level] | Family[Timing]


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # In the order they are exported (prometheus_client's: the order of creation).
        self._families: tuple[_AnyFamily, ...] = (
            *self._declare_deliveries(),
            *self._declare_outbox(),
            *self._declare_per_queue(),
            *self._declare_workflows_and_schedules(),
            *self._declare_model_usage(),
        )
        self._registry: CollectorRegistry | None = None
        if registry is not None:  # the caller's: prometheus_client is loaded already
            self._export_to(registry)

        # One dict lookup per message for the labelled series of the hot path.
        self._settled: dict[tuple[str, Outcome], Count] = {}
        self._published: dict[tuple[str, str], Count] = {}
        self._timing: dict[str, Timing] = {}

    def _declare_deliveries(self) -> tuple[_AnyFamily, ...]:
        """Publishes, settled deliveries, handler run time, in-flight deliveries, reconnects."""
        self.published = _counter(
            "weclaw_mq_published", "Publishes by outcome.", ["queue", "outcome"]
        )
        self.messages = _counter(
            "weclaw_mq_messages", "Deliveries settled, by outcome.", ["queue", "outcome"]
        )
        self.handler_seconds = _histogram(
            "weclaw_mq_handler_seconds", "Handler run time.", ["queue"], HANDLER_BUCKETS_S
        )
        self.in_flight = _gauge("weclaw_mq_in_flight", "Deliveries being processed now.", ["queue"])
        self.reconnects = _counter(
            "weclaw_mq_reconnects", "Broker connections re-established.", ["role"]
        )
        return (
            self.published,
            self.messages,
            self.handler_seconds,
            self.in_flight,
            self.reconnects,
        )

    def _declare_outbox(self) -> tuple[_AnyFamily, ...]:
        """The local outbox (weclaw_mq.outbox): tasks stored there instead of on the broker,
        tasks its relay got confirmed, and its size as the relay last read it."""
        self.outbox_stored = _counter(
            "weclaw_mq_outbox_stored", "Tasks stored in the local outbox.", ["queue"]
        )
        self.outbox_relayed = _counter(
            "weclaw_mq_outbox_relayed", "Tasks the outbox relay sent and got confirmed.", ["queue"]
        )
        outbox_rows = _gauge(
            "weclaw_mq_outbox_rows", "Tasks in the local outbox, not yet on the broker."
        )
        outbox_oldest_age = _gauge(
            "weclaw_mq_outbox_oldest_age_seconds",
            "Age of the oldest task in the local outbox (0 when empty).",
        )
        self.outbox_rows = outbox_rows.labels()
        self.outbox_oldest_age = outbox_oldest_age.labels()
        return (self.outbox_stored, self.outbox_relayed, outbox_rows, outbox_oldest_age)

    def _declare_per_queue(self) -> tuple[_AnyFamily, ...]:
        """What a handler queue's policies did: limits, notifications, breakers, held
        deliveries."""
        # Tasks a handler's limit held back (weclaw_mq.policy.limits): by the handler queue and the
        # limit's kind only, never by key (a user id per label would grow without bound).
        self.limit_deferrals = _counter(
            "weclaw_mq_limit_deferrals",
            "Tasks deferred by a per-key limit, by handler queue and limit kind.",
            ["queue", "limit"],
        )
        self.notifications = _counter(
            "weclaw_mq_notifications",
            "Result notifications, by the handler queue and outcome.",
            ["queue", "outcome"],
        )
        # Circuit breakers (weclaw_mq.policy.breaker), per handler queue in this worker.
        self.breaker_state = _gauge(
            "weclaw_mq_breaker_state",
            "Circuit breaker of a handler queue: 1 for its current state, 0 for the others.",
            ["queue", "state"],
        )
        self.breaker_opened = _counter(
            "weclaw_mq_breaker_opened",
            "Times a handler queue's circuit breaker opened (failed probes included).",
            ["queue"],
        )
        # Priority lanes (worker.lanes): deliveries held unstarted while a slot was free, past
        # WECLAW_MQ_HELD_DELIVERY_S, and given back (a stall the lanes must never have).
        self.held_deliveries = _counter(
            "weclaw_mq_held_deliveries",
            "Deliveries held unstarted past the bound while a slot was free, given back.",
            ["queue"],
        )
        return (
            self.limit_deferrals,
            self.notifications,
            self.breaker_state,
            self.breaker_opened,
            self.held_deliveries,
        )

    def _declare_workflows_and_schedules(self) -> tuple[_AnyFamily, ...]:
        """Workflows (weclaw_mq.workflows) and schedules (weclaw_mq.scheduling)."""
        # Workflows: ends by kind and status, group sizes, and the time from a group's start
        # to its callback's publish (its join).
        self.workflows_ended = _counter(
            "weclaw_mq_workflows_ended",
            "Workflows ended, by kind (chain, group) and status.",
            ["kind", "status"],
        )
        group_parts = _histogram(
            "weclaw_mq_group_parts", "Parts of each group started.", [], GROUP_PARTS_BUCKETS
        )
        group_join_seconds = _histogram(
            "weclaw_mq_group_join_seconds",
            "From a group's start to the publish of its callback.",
            [],
            HANDLER_BUCKETS_S,
        )
        self.group_parts = group_parts.labels()
        self.group_join_seconds = group_join_seconds.labels()
        # Schedules: ticks by schedule and outcome (fired, skipped as missed, failed to
        # publish: tried again), and whether this process's scheduler leads.
        self.schedule_ticks = _counter(
            "weclaw_mq_schedule_ticks",
            "Schedule ticks by schedule and outcome (fired, skipped, failed).",
            ["schedule", "outcome"],
        )
        self.scheduler_leader = _gauge(
            "weclaw_mq_scheduler_leader",
            "1 while this process's scheduler holds the lease and fires the ticks, else 0.",
        )
        return (
            self.workflows_ended,
            group_parts,
            group_join_seconds,
            self.schedule_ticks,
            self.scheduler_leader,
        )

    def _declare_model_usage(self) -> tuple[_AnyFamily, ...]:
        """Model usage, costs, caps and fallback attempts."""
        # Model usage handlers report (ctx.usage) in an App with prices (weclaw_mq.policy.costs):
        # by queue and model only; tenants are 'weclaw-mq costs'' (a label each would grow
        # without bound).
        self.tokens = _counter(
            "weclaw_mq_model_tokens",
            "Model tokens handlers reported, by queue, model and kind (input, output).",
            ["queue", "model", "kind"],
        )
        self.cost = _counter(
            "weclaw_mq_model_cost",
            "What the reported tokens cost with the App's prices, by queue and model.",
            ["queue", "model"],
        )
        self.capped = _counter(
            "weclaw_mq_capped_tasks",
            "Tasks whose tenant had reached its daily cap, by queue and the cap's action.",
            ["queue", "action"],
        )
        # Model fallback chains (weclaw_mq.policy.fallback): attempts by the model they called
        # and what that said of it (succeeded, failed, taken_down, blocked by a Retry-After,
        # probe_failed: the one probe of a model whose cool-down ended failed).
        self.model_attempts = _counter(
            "weclaw_mq_model_attempts",
            "Attempts of handlers with a fallback chain, by queue, model and outcome.",
            ["queue", "model", "outcome"],
        )
        return (self.tokens, self.cost, self.capped, self.model_attempts)

    @property
    def registry(self) -> CollectorRegistry:
        """The prometheus_client registry these metrics are exported in, made (and
        prometheus_client imported) on first use when the caller passed none."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            self._export_to(CollectorRegistry())
        assert self._registry is not None
        return self._registry

    def _export_to(self, registry: CollectorRegistry) -> None:
        registry.register(_Exporter(self))
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        """Every metric with its current values, as prometheus_client's collectors expose them."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.samples import Sample
        from prometheus_client.utils import floatToGoString

        for f in self._families:
            labelnames = f.labelnames
            if f.kind == "counter":
                c = CounterMetricFamily(f.name, f.documentation, labels=labelnames)
                for values, count in f.series():
                    assert isinstance(count, Count)
                    c.add_metric(values, count.value, created=count.created)
                yield c
            elif f.kind == "gauge":
                g = GaugeMetricFamily(f.name, f.documentation, labels=labelnames)
                for values, level in f.series():
                    assert isinstance(level, Level)
                    g.add_metric(values, level.read())
                yield g
            else:
                h = HistogramMetricFamily(f.name, f.documentation, labels=labelnames)
                for values, timing in f.series():
                    assert isinstance(timing, Timing)
                    running = 0
                    cumulative: list[tuple[str, float]] = []
                    for bound, n in zip(timing.bounds, list(timing.buckets), strict=True):
                        running += n
                        cumulative.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
                    h.add_metric(values, cumulative, timing.sum)
                    labels = dict(zip(labelnames, values, strict=True))
                    h.samples.append(Sample(f.name + "_created", labels, timing.created))
                yield h

    def settled(self, queue: str, outcome: Outcome) -> Count:
        child = self._settled.get((queue, outcome))
        if child is None:
            child = self._settled[queue, outcome] = self.messages.labels(queue, outcome.value)
        return child

    def publish_outcome(self, queue: str, outcome: str) -> Count:
        child = self._published.get((queue, outcome))
        if child is None:
            child = self._published[queue, outcome] = self.published.labels(queue, outcome)
        return child

    def notified(self, queue: str, outcome: NotifyOutcome) -> Count:
        return self.notifications.labels(queue, outcome.value)

    def limit_deferred(self, queue: str, kind: str) -> Count:
        return self.limit_deferrals.labels(queue, kind)

    def handler_timing(self, queue: str) -> Timing:
        child = self._timing.get(queue)
        if child is None:
            child = self._timing[queue] = self.handler_seconds.labels(queue)
        return child

    def circuit_state(self, queue: str, state: CircuitState) -> None:
        for each in CircuitState:
            self.breaker_state.labels(queue, each.value).set(1 if each is state else 0)

    def circuit_opened(self, queue: str) -> Count:
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
        from weclaw_mq.observability.metrics_server import MetricsServer

        return MetricsServer(self.registry, port, addr=addr, health=health)


class _Exporter:
    """What a prometheus_client registry calls to read ``Metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()

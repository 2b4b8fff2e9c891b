"""``Metrics`` keeps its values in plain objects and exports them only when its registry is
read: what it exposes must be what prometheus_client's own Counter, Gauge and Histogram
expose for the same updates (dashboards and alert rules read those names and buckets)."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from weclaw_mq.observability.metrics import (
    GROUP_PARTS_BUCKETS,
    HANDLER_BUCKETS_S,
    Metrics,
    NotifyOutcome,
    Outcome,
)
from weclaw_mq.policy.breaker import CircuitState

# Handler times on, just past and between bucket bounds, and past the last one.
TIMES = (0.005, 0.01, 0.0100001, 0.3, 1, 2.5, 120, 400)


def ours() -> str:
    m = Metrics()
    m.settled("q", Outcome.ACKED).inc()
    m.settled("q", Outcome.ACKED).inc()
    m.settled("r", Outcome.RETRIED).inc(3)
    m.publish_outcome("q", "confirmed").inc()
    for t in TIMES:
        m.handler_timing("q").observe(t)
    m.count_in_flight("q", lambda: 7)
    m.reconnects.labels("worker").inc()
    m.outbox_rows.set(4)
    m.limit_deferred("q", "rate").inc()
    m.notified("q", NotifyOutcome.PUBLISHED).inc()
    m.circuit_state("q", CircuitState.OPEN)
    m.circuit_opened("q").inc()
    m.workflows_ended.labels("group", "succeeded").inc()
    m.group_parts.observe(40)
    m.schedule_ticks.labels("nightly", "fired").inc()
    m.scheduler_leader.labels().set(1)
    return generate_latest(m.registry).decode()


def prometheus_clients() -> str:
    """The same metrics and updates, made with prometheus_client's collectors."""
    r = CollectorRegistry()
    published = Counter(
        "weclaw_mq_published", "Publishes by outcome.", ["queue", "outcome"], registry=r
    )
    messages = Counter(
        "weclaw_mq_messages", "Deliveries settled, by outcome.", ["queue", "outcome"], registry=r
    )
    seconds = Histogram(
        "weclaw_mq_handler_seconds",
        "Handler run time.",
        ["queue"],
        buckets=HANDLER_BUCKETS_S,
        registry=r,
    )
    in_flight = Gauge(
        "weclaw_mq_in_flight", "Deliveries being processed now.", ["queue"], registry=r
    )
    reconnects = Counter(
        "weclaw_mq_reconnects", "Broker connections re-established.", ["role"], registry=r
    )
    Counter("weclaw_mq_outbox_stored", "Tasks stored in the local outbox.", ["queue"], registry=r)
    Counter(
        "weclaw_mq_outbox_relayed",
        "Tasks the outbox relay sent and got confirmed.",
        ["queue"],
        registry=r,
    )
    rows = Gauge(
        "weclaw_mq_outbox_rows", "Tasks in the local outbox, not yet on the broker.", registry=r
    )
    Gauge(
        "weclaw_mq_outbox_oldest_age_seconds",
        "Age of the oldest task in the local outbox (0 when empty).",
        registry=r,
    )
    deferrals = Counter(
        "weclaw_mq_limit_deferrals",
        "Tasks deferred by a per-key limit, by handler queue and limit kind.",
        ["queue", "limit"],
        registry=r,
    )
    notifications = Counter(
        "weclaw_mq_notifications",
        "Result notifications, by the handler queue and outcome.",
        ["queue", "outcome"],
        registry=r,
    )
    state = Gauge(
        "weclaw_mq_breaker_state",
        "Circuit breaker of a handler queue: 1 for its current state, 0 for the others.",
        ["queue", "state"],
        registry=r,
    )
    opened = Counter(
        "weclaw_mq_breaker_opened",
        "Times a handler queue's circuit breaker opened (failed probes included).",
        ["queue"],
        registry=r,
    )
    Counter(
        "weclaw_mq_held_deliveries",
        "Deliveries held unstarted past the bound while a slot was free, given back.",
        ["queue"],
        registry=r,
    )
    ended = Counter(
        "weclaw_mq_workflows_ended",
        "Workflows ended, by kind (chain, group) and status.",
        ["kind", "status"],
        registry=r,
    )
    parts = Histogram(
        "weclaw_mq_group_parts",
        "Parts of each group started.",
        registry=r,
        buckets=GROUP_PARTS_BUCKETS,
    )
    Histogram(
        "weclaw_mq_group_join_seconds",
        "From a group's start to the publish of its callback.",
        registry=r,
        buckets=HANDLER_BUCKETS_S,
    )
    ended.labels("group", "succeeded").inc()
    parts.observe(40)
    ticks = Counter(
        "weclaw_mq_schedule_ticks",
        "Schedule ticks by schedule and outcome (fired, skipped, failed).",
        ["schedule", "outcome"],
        registry=r,
    )
    leader = Gauge(
        "weclaw_mq_scheduler_leader",
        "1 while this process's scheduler holds the lease and fires the ticks, else 0.",
        registry=r,
    )
    Counter(
        "weclaw_mq_model_tokens",
        "Model tokens handlers reported, by queue, model and kind (input, output).",
        ["queue", "model", "kind"],
        registry=r,
    )
    Counter(
        "weclaw_mq_model_cost",
        "What the reported tokens cost with the App's prices, by queue and model.",
        ["queue", "model"],
        registry=r,
    )
    Counter(
        "weclaw_mq_capped_tasks",
        "Tasks whose tenant had reached its daily cap, by queue and the cap's action.",
        ["queue", "action"],
        registry=r,
    )
    Counter(
        "weclaw_mq_model_attempts",
        "Attempts of handlers with a fallback chain, by queue, model and outcome.",
        ["queue", "model", "outcome"],
        registry=r,
    )
    messages.labels("q", "acked").inc(2)
    messages.labels("r", "retried").inc(3)
    published.labels("q", "confirmed").inc()
    for t in TIMES:
        seconds.labels("q").observe(t)
    in_flight.labels("q").set_function(lambda: 7)
    reconnects.labels("worker").inc()
    rows.set(4)
    deferrals.labels("q", "rate").inc()
    notifications.labels("q", "published").inc()
    for each in CircuitState:
        state.labels("q", each.value).set(1 if each is CircuitState.OPEN else 0)
    opened.labels("q").inc()
    ticks.labels("nightly", "fired").inc()
    leader.set(1)
    return generate_latest(r).decode()


def without_created_times(exposition: str) -> str:
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", exposition)


def test_the_exposition_is_prometheus_clients_for_the_same_updates() -> None:
    expected = without_created_times(prometheus_clients())
    assert "weclaw_mq_handler_seconds_bucket" in expected
    assert without_created_times(ours()) == expected


def test_a_counter_refuses_to_go_down_and_labels_must_match() -> None:
    m = Metrics()
    with pytest.raises(ValueError):
        m.settled("q", Outcome.ACKED).inc(-1)
    with pytest.raises(ValueError):
        m.messages.labels("q")
    assert (
        m.registry.get_sample_value("weclaw_mq_messages_total", {"queue": "q", "outcome": "acked"})
        == 0
    )


def test_a_registry_given_by_the_caller_exports_the_metrics() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.settled("q", Outcome.CANCELLED).inc()
    assert m.registry is registry
    sample = registry.get_sample_value(
        "weclaw_mq_messages_total", {"queue": "q", "outcome": "cancelled"}
    )
    assert sample == 1

"""Priorities as pure functions: the levels, the per-version plan, where a task is routed,
the lane names, and the worker's choice of the next lane (the anti-starvation rule)."""

from __future__ import annotations

import itertools

import pytest

from weclaw_mq import InvalidPriorityError, Priority, WeclawMQError
from weclaw_mq.contract.naming import (
    dlq_name,
    lane_queue_name,
    retry_queue_name,
    source_lane,
    validate_queue_name,
)
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.policy.priority import parse_priority, plan_priorities, priority_from_header, route
from weclaw_mq.worker.lane_priority import pick


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (Priority.URGENT, Priority.URGENT),
        ("normal", Priority.NORMAL),
        ("high", Priority.HIGH),
        ("URGENT", Priority.URGENT),
    ],
)
def test_priorities_are_the_enum_or_its_plain_strings(given: object, expected: Priority) -> None:
    assert parse_priority(given) is expected


@pytest.mark.parametrize("bad", ["critical", "", 2, None, 1.5])
def test_anything_else_is_a_clear_value_error_of_ours(bad: object) -> None:
    with pytest.raises(InvalidPriorityError, match="normal', 'high', 'urgent'") as caught:
        parse_priority(bad)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, WeclawMQError)


def test_a_delivery_without_or_with_a_foreign_priority_header_is_normal() -> None:
    assert priority_from_header(None) is Priority.NORMAL
    assert priority_from_header("bogus") is Priority.NORMAL
    assert priority_from_header(b"urgent") is Priority.URGENT


@pytest.mark.parametrize(
    ("version", "mode"),
    [
        (ServerVersion(3, 10, 8), "lanes"),
        (ServerVersion(3, 13, 7), "lanes"),
        # Two non-strict levels (about 2 high : 1 normal) cannot order three levels.
        (ServerVersion(4, 0, 5), "lanes"),
        (ServerVersion(4, 2, 0), "lanes"),
        (ServerVersion(4, 3, 0), "native"),
        (ServerVersion(5, 0, 0), "native"),
        (None, "lanes"),
    ],
)
def test_quorum_queues_get_lanes_until_4_3_and_native_strict_priorities_from_it(
    version: ServerVersion | None, mode: str
) -> None:
    plan = plan_priorities(version, "quorum")
    assert plan.mode == mode
    # Never x-max-priority on a quorum queue: 3.x refuses it, 4.3 ignores it.
    assert "x-max-priority" not in plan.queue_arguments
    if mode == "lanes":
        assert plan.lanes == (Priority.URGENT, Priority.HIGH, Priority.NORMAL)
    else:
        assert plan.lanes == (Priority.NORMAL,)
        levels = plan.amqp_priority
        assert levels[Priority.URGENT] > levels[Priority.HIGH] > levels[Priority.NORMAL]
        # A message without the property counts as 4: old producers stay NORMAL.
        assert levels[Priority.NORMAL] == 4


@pytest.mark.parametrize("version", [ServerVersion(3, 10, 8), ServerVersion(4, 3, 0), None])
def test_a_classic_queue_uses_x_max_priority_on_every_version(version: ServerVersion) -> None:
    plan = plan_priorities(version, "classic")
    assert plan.mode == "native"
    assert plan.queue_arguments == {"x-max-priority": 2}
    assert plan.amqp_priority[Priority.NORMAL] == 0  # what a message without it gets


def test_an_unknown_queue_type_is_refused() -> None:
    with pytest.raises(InvalidPriorityError, match="queue_type"):
        plan_priorities(None, "stream")


def test_routing_normal_is_q_unchanged_higher_levels_a_lane_or_the_property() -> None:
    v310, v43 = ServerVersion(3, 10, 8), ServerVersion(4, 3, 0)
    assert route("q", Priority.NORMAL, v310) == ("q", None)
    assert route("q", Priority.NORMAL, v43) == ("q", None)
    assert route("q", Priority.HIGH, v310) == ("q.lane.high", None)
    assert route("q", Priority.URGENT, v43) == ("q", 6)
    assert route("q", Priority.URGENT, v310, "classic") == ("q", 2)


def test_lane_names_never_collide_with_another_handlers_derived_queues() -> None:
    assert lane_queue_name("q", "normal") == "q"
    assert lane_queue_name("q", "high") == "q.lane.high"
    # A handler queue may not look like a lane, so no handler "q.lane.high" can exist ...
    with pytest.raises(ConfigurationError, match="derived"):
        validate_queue_name("q.lane.high")
    # ... and a lane's delay queue is not any handler's delay queue or DLQ.
    lane_retry = retry_queue_name(lane_queue_name("q", "urgent"), 5000)
    assert lane_retry == "q.lane.urgent.retry.5s"
    assert lane_retry != retry_queue_name("q", 5000)
    assert dlq_name("q") == "q.dlq"


@pytest.mark.parametrize(
    ("routing_key", "expected"),
    [
        ("q.lane.high", "q.lane.high"),
        ("q.lane.urgent", "q.lane.urgent"),
        ("q", "q"),
        (None, "q"),
        ("q.lane.bogus", "q"),
        ("other.lane.high", "q"),  # another queue's lane: not ours, back to Q
    ],
)
def test_a_retry_goes_to_the_delay_queue_of_the_lane_it_came_from(
    routing_key: str | None, expected: str
) -> None:
    assert source_lane(routing_key, "q") == expected


LANES = ["u", "h", "n"]  # highest first


def test_the_highest_waiting_lane_starts_first() -> None:
    skipped: dict[str, int] = {}
    assert pick(LANES, ["n", "h"], skipped, 8) == "h"
    assert pick(LANES, ["n", "h", "u"], skipped, 8) == "u"
    assert pick(LANES, ["n"], skipped, 8) == "n"
    assert pick(LANES, [], skipped, 8) is None


def test_a_lower_lane_passed_over_k_times_starts_next() -> None:
    skipped: dict[str, int] = {}
    order = [pick(LANES, ["u", "h", "n"], skipped, 3) for _ in range(12)]
    # K=3 urgent starts, then the starved lanes one each (highest starved first).
    assert order[:5] == ["u", "u", "u", "h", "n"]
    # Under a flood of every level, no lane waits more than K + (lanes - 1) starts.
    for lane in LANES:
        positions = [i for i, chosen in enumerate(order) if chosen == lane]
        assert positions, lane
        assert all(b - a <= 3 + 2 for a, b in itertools.pairwise(positions))


def test_a_skip_is_counted_only_while_the_lower_lane_has_a_task_waiting() -> None:
    skipped: dict[str, int] = {}
    for _ in range(10):
        assert pick(LANES, ["u"], skipped, 3) == "u"
    assert pick(LANES, ["u", "n"], skipped, 3) == "u"  # n waited for one start only


def test_the_schedulers_choice_is_picks_in_every_state() -> None:
    # LaneScheduler._choose decides the all-NORMAL steady state without calling pick (fewer
    # calls per delivery): it must give pick's answer and leave the same skip counts.
    from collections import deque
    from typing import Any, cast

    from weclaw_mq.worker.lanes import LaneScheduler

    async def never(*_: object) -> None:
        raise AssertionError("not called")

    limit = 3
    for waiting, pending, counts in itertools.product(
        itertools.product([False, True], repeat=3),
        itertools.product([False, True], repeat=2),
        itertools.product([0, 2, 3], repeat=3),
    ):
        scheduler = LaneScheduler(
            cast(Any, None),
            LANES,
            concurrency=1,
            starvation_limit=limit,
            start=cast(Any, never),
            give_back=never,
            redeclare=never,
        )
        for lane, has in zip(LANES, waiting, strict=True):
            scheduler._waiting[lane] = deque([cast(Any, object())] if has else [])
        scheduler._priorities.pending = {
            lane: 1 for lane, on in zip(LANES[:2], pending, strict=True) if on
        }
        scheduler._priorities.skipped = dict(zip(LANES, counts, strict=True))
        expected_skipped = dict(scheduler._priorities.skipped)
        expected = pick(
            LANES,
            [lane for lane, has in zip(LANES, waiting, strict=True) if has],
            expected_skipped,
            limit,
            scheduler._priorities.pending,
        )
        assert scheduler._choose() == expected
        assert scheduler._priorities.skipped == expected_skipped

"""What a workflow's task carries and how its outcome reads (``weclaw_mq.workflows.plans``)."""

from __future__ import annotations

import pytest

from weclaw_mq.workflows.plans import (
    CHAIN,
    GROUP,
    PASS,
    Plan,
    Stage,
    Tagged,
    callback_payload,
    read_tag,
    reason_of,
)


def group_plan(size: int = 4, on_failure: str = "fail") -> Plan:
    return Plan(
        GROUP, "g1", (Stage("chunks"),), size, "t", None, 2_000, 1_000, Stage("merge"), on_failure
    )


@pytest.mark.parametrize(
    ("tag", "task_id", "expected"),
    [
        ("chain:c.7", "c.7.2", Tagged(CHAIN, "c.7", 2)),
        ("group:g", "g.10", Tagged(GROUP, "g", 10)),
        ("then:g", "g.then", Tagged("then", "g", -1)),
        ("group:g", "g.01", None),  # not the id this index gets
        ("group:g", "other.1", None),
        ("group:g", "g.x", None),
        ("then:g", "g.1", None),
        ("loop:g", "g.1", None),
        ("group:", ".1", None),
        (7, "g.1", None),
    ],
)
def test_a_tag_is_read_only_where_it_fits_the_task_id(
    tag: object, task_id: str, expected: Tagged | None
) -> None:
    assert read_tag(tag, task_id) == expected


def test_a_plan_survives_its_round_trip_through_json() -> None:
    plan = Plan(CHAIN, "c", (Stage("a"), Stage("b", "high")), 2, "t", "s-1", 9, 1)
    assert Plan.from_json(plan.to_json()) == plan


def test_the_callback_gets_results_in_part_order_or_every_end_with_pass() -> None:
    parts = {
        i: {"task_id": f"g1.{i}", "status": "succeeded", "result": i * 2, "error": None}
        for i in (3, 0, 2, 1)
    }
    assert callback_payload(group_plan(), parts) == [0, 2, 4, 6]
    passed = callback_payload(group_plan(on_failure=PASS), parts)
    assert [p["task_id"] for p in passed] == ["g1.0", "g1.1", "g1.2", "g1.3"]
    assert passed[0] == {
        "task_id": "g1.0",
        "status": "succeeded",
        "result": 0,
        "error": None,
        "reason": None,
    }


def test_an_expired_group_names_its_missing_parts_and_counts_the_rest() -> None:
    plan = group_plan(size=30)
    outcome = {
        "status": "expired",
        "by": "deadline",
        "was": "running",
        "missing": [1, 4],
        "missing_count": 5,
    }
    assert reason_of(plan, outcome) == (
        "the group's deadline passed with 5 of 30 parts (chunks) not ended (lost: purged, "
        "expired in the queue, or its queue deleted?): parts 2 (task g1.1), 5 (task g1.4) "
        "and 3 more"
    )


def test_an_expired_group_whose_parts_all_ended_names_its_callback() -> None:
    outcome = {"status": "expired", "by": "deadline", "was": "joined", "missing": {}}
    assert reason_of(group_plan(), outcome) == (
        "the group's deadline passed before its callback (merge, task g1.then) ended"
    )


def test_a_failed_callback_is_named_with_its_reason() -> None:
    outcome = {"status": "dead_lettered", "by": "callback", "index": -1, "reason": "rejected"}
    assert reason_of(group_plan(), outcome) == (
        "its callback (merge, task g1.then) dead_lettered: rejected"
    )

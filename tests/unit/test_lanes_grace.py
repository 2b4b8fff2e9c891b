"""How long lower lanes wait for a higher lane's next task (``LaneScheduler.grace``): 20 ms
on a quick broker, twice the median recent wait on a loaded one, never over 250 ms."""

from __future__ import annotations

from typing import Any

from weclaw_mq.worker.lane_priority import LOOKAHEAD_GRACE_MAX_S, LOOKAHEAD_GRACE_S
from weclaw_mq.worker.lanes import LaneScheduler


async def _nothing(*_: Any) -> None:
    return None


def _scheduler() -> LaneScheduler:
    return LaneScheduler(
        None,  # type: ignore[arg-type]  # never used: no consumer is opened here
        ["Q.lane.urgent", "Q"],
        concurrency=2,
        starvation_limit=8,
        start=lambda _: None,  # type: ignore[arg-type,return-value]
        give_back=_nothing,
        redeclare=_nothing,
    )


def test_a_quick_broker_keeps_the_20_ms_grace() -> None:
    lanes = _scheduler()
    assert lanes.grace == LOOKAHEAD_GRACE_S
    for _ in range(8):
        lanes._priorities.waited(0.002)
    assert lanes.grace == LOOKAHEAD_GRACE_S


def test_a_slow_round_trip_doubles_into_the_grace() -> None:
    lanes = _scheduler()
    for _ in range(8):
        lanes._priorities.waited(0.06)
    assert lanes.grace == 0.12


def test_one_late_arrival_does_not_move_the_median() -> None:
    lanes = _scheduler()
    for _ in range(8):
        lanes._priorities.waited(0.002)
    lanes._priorities.waited(0.2)  # a task published just after the lane emptied
    assert lanes.grace == LOOKAHEAD_GRACE_S


def test_the_grace_is_bounded_and_a_wait_past_the_bound_is_no_sample() -> None:
    lanes = _scheduler()
    for _ in range(8):
        lanes._priorities.waited(0.2)
    assert lanes.grace == LOOKAHEAD_GRACE_MAX_S
    fresh = _scheduler()
    for _ in range(8):
        fresh._priorities.waited(30.0)  # the lane was empty; a task came much later
    assert fresh.grace == LOOKAHEAD_GRACE_S


def test_the_grace_follows_the_latest_waits() -> None:
    lanes = _scheduler()
    for _ in range(16):
        lanes._priorities.waited(0.1)
    for _ in range(16):
        lanes._priorities.waited(0.001)
    assert lanes.grace == LOOKAHEAD_GRACE_S

"""The priority lanes' choice of the next lane (``worker.lane_priority.LanePriorities``),
driven with plain data: the highest waiting lane, the starvation rule, pending lanes and their
grace, and fair lanes in turn. No broker, no event loop."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import pytest

from weclaw_mq.worker.lane_priority import (
    LATENCY_SAMPLES,
    LOOKAHEAD_GRACE_MAX_S,
    LOOKAHEAD_GRACE_S,
    LanePriorities,
    pick,
)

LANES = ["urgent", "high", "normal"]


def _priorities(
    lanes: Sequence[str] = LANES, levels: Sequence[int] | None = None, limit: int = 3
) -> LanePriorities:
    ranks = levels if levels is not None else range(len(lanes))
    return LanePriorities(lanes, dict(zip(lanes, ranks, strict=True)), starvation_limit=limit)


def _waiting(*lanes: str, of: Sequence[str] = LANES) -> dict[str, list[int]]:
    return {lane: [1] if lane in lanes else [] for lane in of}


def test_nothing_waiting_is_no_choice() -> None:
    assert _priorities().choose(_waiting()) is None


def test_the_highest_waiting_lane_starts_first_and_lower_ones_count_a_skip() -> None:
    priorities = _priorities()
    assert priorities.choose(_waiting("high", "normal")) == "high"
    assert priorities.skipped == {"urgent": 0, "high": 0, "normal": 1}


def test_a_lane_passed_over_limit_times_starts_next() -> None:
    priorities = _priorities(limit=2)
    waiting = _waiting("urgent", "normal")
    assert [priorities.choose(waiting) for _ in range(3)] == ["urgent", "urgent", "normal"]
    assert priorities.skipped["normal"] == 0


def test_a_pending_higher_lane_holds_lower_lanes_back() -> None:
    priorities = _priorities()
    mark = priorities.expect("urgent", at=10.0)
    assert mark is not None
    assert priorities.choose(_waiting("normal")) is None
    assert priorities.choose(_waiting("high")) is None
    assert priorities.grace_over("urgent", mark)
    assert priorities.choose(_waiting("normal")) == "normal"


def test_a_starved_lane_does_not_wait_for_a_pending_one() -> None:
    priorities = _priorities(limit=1)
    priorities.skipped["normal"] = 1
    priorities.expect("urgent")
    assert priorities.choose(_waiting("normal")) == "normal"


def test_the_lowest_level_is_never_pending() -> None:
    priorities = _priorities()
    assert priorities.expect("normal", at=1.0) is None
    assert priorities.pending == {}
    assert priorities.expected_at == {}


def test_an_older_grace_does_not_end_a_newer_expectation() -> None:
    priorities = _priorities()
    first = priorities.expect("high", at=1.0)
    second = priorities.expect("high", at=2.0)
    assert first is not None and second is not None
    assert not priorities.grace_over("high", first)
    assert "high" in priorities.pending
    assert priorities.grace_over("high", second)
    assert priorities.pending == {}


def test_an_untimed_expectation_records_no_wait() -> None:
    priorities = _priorities()
    priorities.expect("high")  # its consume is on the way: no time yet
    priorities.delivered("high", 5.0)
    assert priorities.pending == {}
    assert priorities.grace == LOOKAHEAD_GRACE_S


def test_a_delivery_ends_the_wait_and_its_time_moves_the_grace() -> None:
    priorities = _priorities()
    for start in range(8):
        priorities.expect("high", at=float(start))
        priorities.delivered("high", start + 0.06)
    assert priorities.pending == {}
    assert priorities.expected_at == {}
    assert priorities.grace == pytest.approx(0.12)


def test_a_delivery_after_the_grace_still_counts_as_a_wait() -> None:
    priorities = _priorities()
    mark = priorities.expect("high", at=0.0)
    assert mark is not None and priorities.grace_over("high", mark)
    for _ in range(LATENCY_SAMPLES):
        priorities.waited(0.1)
    priorities.expect("high", at=1.0)
    priorities.delivered("high", 1.2)
    assert priorities.grace == pytest.approx(0.2)


def test_the_grace_stays_within_its_bounds() -> None:
    priorities = _priorities()
    for _ in range(8):
        priorities.waited(0.001)
    assert priorities.grace == LOOKAHEAD_GRACE_S
    for _ in range(LATENCY_SAMPLES):
        priorities.waited(LOOKAHEAD_GRACE_MAX_S)
    assert priorities.grace == LOOKAHEAD_GRACE_MAX_S
    priorities.waited(30.0)  # past the bound: the lane was empty, no sample
    assert priorities.grace == LOOKAHEAD_GRACE_MAX_S


def test_fair_lanes_take_turns_by_running_count_then_by_least_recently_served() -> None:
    lanes = ["urgent", "f1", "normal"]
    priorities = _priorities(lanes, levels=[0, 1, 1])
    waiting = _waiting("f1", "normal", of=lanes)
    served = {"f1": 2, "normal": 1}
    assert priorities.choose(waiting, served, lambda: {"f1": 0, "normal": 0}) == "normal"
    assert priorities.choose(waiting, served, lambda: {"f1": 0, "normal": 1}) == "f1"
    assert priorities.skipped == {"urgent": 0, "f1": 0, "normal": 0}  # peers count no skip


def test_the_running_counts_are_asked_only_for_fair_lanes() -> None:
    def never() -> Mapping[str, int]:
        raise AssertionError("asked without fair lanes")

    assert _priorities().choose(_waiting("high", "normal"), None, never) == "high"


def test_choose_is_pick_in_every_state() -> None:
    # choose decides the all-NORMAL steady state without calling pick: the same answer and
    # the same skip counts in every state of three lanes.
    limit = 3
    for waiting, pending, counts in itertools.product(
        itertools.product([False, True], repeat=3),
        itertools.product([False, True], repeat=2),
        itertools.product([0, 2, 3], repeat=3),
    ):
        priorities = _priorities(limit=limit)
        for lane, on in zip(LANES[:2], pending, strict=True):
            if on:
                priorities.expect(lane)
        priorities.skipped = dict(zip(LANES, counts, strict=True))
        expected_skipped = dict(priorities.skipped)
        waiting_lanes = [lane for lane, has in zip(LANES, waiting, strict=True) if has]
        expected = pick(LANES, waiting_lanes, expected_skipped, limit, priorities.pending)
        assert priorities.choose(_waiting(*waiting_lanes)) == expected
        assert priorities.skipped == expected_skipped

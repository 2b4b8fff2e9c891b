"""A worker's fair lanes (``worker.lane_fairness.FairLanes``), driven with plain data: each
lane's peers, the turns' serials, and which idle consumer may be withdrawn (one armed at least
``EMPTY_LANE_S`` ago). No broker, no event loop."""

from __future__ import annotations

from weclaw_mq.worker.lane_fairness import EMPTY_LANE_S, FairLanes

# Priorities above three fair lanes of the NORMAL level.
RANKS = {"urgent": 0, "high": 1, "f1": 2, "f2": 2, "normal": 2}


def test_peers_are_the_other_lanes_of_a_level() -> None:
    fair = FairLanes(RANKS, memory=32)
    assert fair.peers["normal"] == {"f1", "f2"}
    assert fair.peers["f1"] == {"f2", "normal"}
    assert fair.peers["urgent"] == frozenset()


def test_lanes_of_their_own_levels_are_not_fair() -> None:
    fair = FairLanes({"urgent": 0, "high": 1, "normal": 2}, memory=32)
    assert fair.served is None
    assert all(not peers for peers in fair.peers.values())
    fair.started("normal")  # nothing to remember
    assert fair.served is None


def test_each_start_makes_its_lane_the_one_served_most_recently() -> None:
    fair = FairLanes(RANKS, memory=32)
    for lane in ["f1", "normal", "f2", "f1"]:
        fair.started(lane)
    assert fair.served is not None
    assert sorted(fair.served, key=fair.served.__getitem__) == ["normal", "f2", "f1"]


def test_only_a_consumer_idle_for_the_empty_lane_time_is_withdrawable() -> None:
    fair = FairLanes(RANKS, memory=32)
    idle = {"f1": {"a", "b"}}
    fair.armed("a", 10.0, idle)
    fair.armed("b", 10.1, idle)
    assert fair.withdrawable(idle["f1"], 10.0 + EMPTY_LANE_S / 2) is None
    assert fair.withdrawable(idle["f1"], 10.0 + EMPTY_LANE_S) == "a"
    assert fair.withdrawable(idle["f1"], 11.0) == "a"  # the first by tag, every run alike
    assert fair.withdrawable({"b"}, 11.0) == "b"


def test_a_consumer_never_armed_is_not_withdrawable() -> None:
    fair = FairLanes(RANKS, memory=32)
    assert fair.withdrawable({"unknown"}, 100.0) is None


def test_rearming_restarts_the_idle_time() -> None:
    fair = FairLanes(RANKS, memory=32)
    idle = {"f1": {"a"}}
    fair.armed("a", 0.0, idle)
    fair.armed("a", 1.0, idle)  # it ran a task meanwhile
    assert fair.withdrawable({"a"}, 1.0 + EMPTY_LANE_S / 2) is None


def test_past_its_memory_it_forgets_the_consumers_no_longer_idle() -> None:
    fair = FairLanes(RANKS, memory=2)
    fair.armed("a", 0.0, {"f1": {"a"}})
    fair.armed("b", 0.0, {"f1": {"a", "b"}})
    fair.armed("c", 0.0, {"f1": {"c"}})  # a and b run tasks now
    assert fair.withdrawable({"a", "b"}, 1.0) is None
    assert fair.withdrawable({"c"}, 1.0) == "c"

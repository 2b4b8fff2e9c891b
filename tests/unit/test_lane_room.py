"""Where a lane's new consumer finds room under the cap (``worker.lane_room.take_room``),
driven with plain data: the ending consumer first, then an idle one of the lowest lane with
another look-ahead (a fair peer's only when old enough, withdrawn), then a surplus waiting
task; nothing while room is already on its way. No broker, no event loop."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sized

from weclaw_mq.worker.lane_room import Room, take_room

LANES = ["urgent", "high", "normal"]


def _take(
    lane_in_need: str,
    idle: Mapping[str, Collection[str]],
    waiting: Mapping[str, Sized] | None = None,
    opening: Mapping[str, int] | None = None,
    lanes: list[str] = LANES,
    **rest: object,
) -> tuple[Room | None, bool]:
    return take_room(
        lane_in_need,
        lanes,
        idle={lane: idle.get(lane, set()) for lane in lanes},
        waiting={lane: (waiting or {}).get(lane, []) for lane in lanes},
        opening={lane: (opening or {}).get(lane, 0) for lane in lanes},
        **rest,  # type: ignore[arg-type]
    )


def test_the_ending_consumer_goes_first_when_its_lane_keeps_a_lookahead() -> None:
    idle = {"normal": {"e", "x"}, "high": {"h1", "h2"}}
    room = _take("urgent", idle, ending=("e", "normal"))
    assert room == (Room("ending", "normal", "e"), False)


def test_the_ending_consumer_stays_when_it_is_its_lanes_only_lookahead() -> None:
    idle = {"normal": {"e"}, "high": {"h1", "h2"}}
    assert _take("urgent", idle, ending=("e", "normal")) == (Room("idle", "high", "h1"), False)


def test_an_idle_consumer_of_the_lowest_lane_with_another_lookahead() -> None:
    idle = {"normal": {"n2", "n1"}, "high": {"h1", "h2"}}
    assert _take("urgent", idle) == (Room("idle", "normal", "n1"), False)  # the oldest tag


def test_a_waiting_task_or_an_opening_consumer_is_a_lookahead_too() -> None:
    idle = {"normal": {"n1"}, "high": {"h1"}}
    assert _take("urgent", idle) == (None, False)
    assert _take("urgent", idle, waiting={"high": [1]}) == (Room("idle", "high", "h1"), False)
    assert _take("urgent", idle, opening={"normal": 1}) == (Room("idle", "normal", "n1"), False)


def test_a_surplus_waiting_task_of_the_lowest_such_lane_goes_back() -> None:
    waiting = {"high": [1, 2], "normal": [3, 4]}
    assert _take("urgent", {}, waiting) == (Room("surplus", "normal"), False)
    assert _take("urgent", {}, {"high": [1, 2], "normal": [3]}) == (Room("surplus", "high"), False)


def test_nothing_is_taken_while_room_is_on_its_way() -> None:
    idle = {"normal": {"e", "n1"}}
    assert _take("urgent", idle, ending=("e", "normal"), leaving=True) == (None, False)
    assert _take("urgent", idle, withdrawing=True) == (None, False)
    # the ending consumer may still go while a withdrawal is under way
    room = _take("urgent", idle, ending=("e", "normal"), withdrawing=True)
    assert room == (Room("ending", "normal", "e"), False)


FAIR = ["urgent", "f1", "normal"]


def test_a_fair_peer_gives_room_only_by_a_withdrawal_of_an_old_idle_consumer() -> None:
    idle = {"normal": {"n1", "n2"}}
    old = {"normal": "n2"}
    room = _take("f1", idle, lanes=FAIR, peers={"normal"}, withdrawable=old.get)
    assert room == (Room("withdraw", "normal", "n2"), False)


def test_a_young_idle_peer_is_passed_over_and_asks_for_a_retry() -> None:
    idle = {"normal": {"n1", "n2"}, "urgent": {"u1", "u2"}}
    room = _take("f1", idle, lanes=FAIR, peers={"normal"}, withdrawable={}.get)
    assert room == (Room("idle", "urgent", "u1"), True)
    assert _take("f1", {"normal": {"n1", "n2"}}, lanes=FAIR, peers={"normal"}) == (None, True)


def test_a_peers_waiting_tasks_are_never_given_back() -> None:
    waiting = {"normal": [1, 2, 3]}
    assert _take("f1", {}, waiting, lanes=FAIR, peers={"normal"}) == (None, False)
    assert _take("urgent", {}, waiting, lanes=FAIR) == (Room("surplus", "normal"), False)

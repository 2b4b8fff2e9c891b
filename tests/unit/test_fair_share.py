"""Fair share's pure parts: the Fair options, lane names and levels, the turn rule in ``pick``,
the memory book's rules, and fair share in TestBroker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from weclaw_mq import App, ConfigurationError, Priority
from weclaw_mq.contract.naming import fair_lane_index, fair_lane_name, source_lane
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.policy.fair_share import (
    Fair,
    hashed_lane,
    least_loaded,
    next_in_turn,
    tenant_text,
)
from weclaw_mq.policy.priority import CLASSIC, QUORUM, plan_priorities, route
from weclaw_mq.settings import Settings
from weclaw_mq.testing import TestBroker
from weclaw_mq.wire.topology import QueueSpec
from weclaw_mq.worker.lane_priority import pick


class Ask(BaseModel):
    tenant: str


@pytest.mark.parametrize("lanes", [1, 0, 65, True, 2.5, "4"])
def test_fair_refuses_a_lane_count_out_of_range(lanes: Any) -> None:
    with pytest.raises(ConfigurationError, match="lanes must be an int from 2 to 64"):
        Fair(lanes=lanes)


def test_fair_refuses_a_key_that_is_not_a_function() -> None:
    with pytest.raises(ConfigurationError, match="key must be a function"):
        Fair(key="tenant")  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "text"), [("acme", "acme"), (42, "42"), (0, "0")])
def test_a_tenant_is_a_str_or_an_int(value: object, text: str) -> None:
    assert tenant_text(value) == text


@pytest.mark.parametrize("value", [None, "", 1.5, True, {"a": 1}])
def test_any_other_tenant_is_refused(value: object) -> None:
    with pytest.raises(ConfigurationError, match="non-empty str or an int"):
        tenant_text(value)


def test_the_least_loaded_lane_is_the_emptiest_and_q_on_a_tie() -> None:
    assert least_loaded([0, 0, 0]) == 0
    assert least_loaded([5, 0, 0]) == 1
    assert least_loaded([5, 3, 4]) == 1
    assert least_loaded([2, 2, 1, 1]) == 2


def test_a_hashed_lane_is_in_range_and_the_same_in_every_process() -> None:
    lanes = [hashed_lane(f"tenant-{i}", 4) for i in range(200)]
    assert set(lanes) == {0, 1, 2, 3}
    # crc32, not hash(): fixed values, whatever PYTHONHASHSEED says.
    assert [hashed_lane(t, 4) for t in ("acme", "globex")] == [
        hashed_lane("acme", 4),
        hashed_lane("globex", 4),
    ]
    import zlib

    assert hashed_lane("acme", 7) == zlib.crc32(b"acme") % 7


def test_next_in_turn_is_the_lane_served_least_recently() -> None:
    assert next_in_turn(["a", "b"], {}) == "a"
    assert next_in_turn(["a", "b"], {"a": 1}) == "b"
    assert next_in_turn(["a", "b", "c"], {"a": 3, "b": 1, "c": 2}) == "b"


def test_next_in_turn_is_the_lane_with_the_fewest_running_first() -> None:
    # "b" runs nothing: it starts next, however recently it was served.
    assert next_in_turn(["a", "b"], {"a": 1, "b": 9}, {"a": 3, "b": 0}) == "b"
    # Even shares: the slot goes to the lane served least recently.
    assert next_in_turn(["a", "b"], {"a": 1, "b": 9}, {"a": 2, "b": 2}) == "a"


def test_fair_lane_names_and_indexes() -> None:
    assert fair_lane_name("q", 0) == "q"
    assert fair_lane_name("q", 3) == "q.lane.f3"
    assert [fair_lane_index(n, "q") for n in ("q", "q.lane.f3", "q.lane.f12")] == [0, 3, 12]
    for other in ("q.lane.high", "q.lane.f", "q.lane.f0", "q.lane.f03", "p.lane.f1", "q.lane.fx"):
        assert fair_lane_index(other, "q") is None, other
    # A retry goes back to the fair lane it came from (its routing key).
    assert source_lane("q.lane.f2", "q") == "q.lane.f2"
    assert source_lane("q.lane.f0", "q") == "q"


def test_the_fair_lanes_are_the_normal_level_with_q_last() -> None:
    plain = QueueSpec("q", (), 3)
    assert plain.lane_levels(None) == [("q", 0)]
    fair = QueueSpec("q", (), 3, fair_lanes=3)
    assert fair.lane_levels(None) == [("q.lane.f1", 0), ("q.lane.f2", 0), ("q", 0)]
    both = QueueSpec("q", (), 3, priorities=True, fair_lanes=3)
    assert both.lane_levels(None) == [
        ("q.lane.urgent", 0),
        ("q.lane.high", 1),
        ("q.lane.f1", 2),
        ("q.lane.f2", 2),
        ("q", 2),
    ]
    assert both.lane_queues(None) == [lane for lane, _ in both.lane_levels(None)]


@pytest.mark.parametrize(
    ("version", "queue_type"),
    [(ServerVersion(4, 3, 0), QUORUM), (None, CLASSIC), (ServerVersion(3, 10, 8), QUORUM)],
)
def test_a_fair_handler_takes_priority_lanes_on_every_broker(
    version: ServerVersion | None, queue_type: str
) -> None:
    assert plan_priorities(version, queue_type, fair=True).mode == "lanes"
    assert route("q", Priority.URGENT, version, queue_type, fair=True) == ("q.lane.urgent", None)
    spec = QueueSpec("q", (), 3, priorities=True, fair_lanes=2, queue_type=queue_type)
    assert spec.lane_queues(version) == ["q.lane.urgent", "q.lane.high", "q.lane.f1", "q"]


def test_without_fair_share_a_native_plan_stays_native() -> None:
    assert plan_priorities(ServerVersion(4, 3, 0), QUORUM).mode == "native"
    assert route("q", Priority.URGENT, None, CLASSIC) == ("q", 2)


LEVELS = {"u": 0, "h": 1, "f1": 2, "f2": 2, "q": 2}
LANES = list(LEVELS)


def test_pick_takes_the_fair_lanes_in_turn() -> None:
    served: dict[str, int] = {}
    skipped: dict[str, int] = {}
    order = []
    for serial in range(1, 7):
        choice = pick(LANES, ["f1", "f2", "q"], skipped, 8, (), LEVELS, served)
        assert choice is not None
        served[choice] = serial
        order.append(choice)
    assert order == ["f1", "f2", "q", "f1", "f2", "q"]
    # Lanes of one level do not count skips against each other.
    assert skipped == {"f1": 0, "f2": 0, "q": 0}
    # The lane with the fewest running tasks goes first.
    assert pick(LANES, ["f1", "f2", "q"], {}, 8, (), LEVELS, served, {"f1": 2, "q": 1}) == "f2"


def test_pick_serves_priorities_before_any_fair_lane() -> None:
    skipped: dict[str, int] = {}
    assert pick(LANES, ["q", "f2", "h"], skipped, 8, (), LEVELS, {}) == "h"
    assert skipped["q"] == skipped["f2"] == 1
    # A starved fair lane still gets its turn past the limit.
    skipped = {"q": 3}
    assert pick(LANES, ["q", "u"], skipped, 3, (), LEVELS, {}) == "q"


def test_a_pending_lane_holds_back_lower_levels_only() -> None:
    # f1's next task may be on its way: q, of the same level, does not wait for it...
    assert pick(LANES, ["q"], {}, 8, ["f1"], LEVELS, {}) == "q"
    # ...but it waits for a HIGH task that may be on its way.
    assert pick(LANES, ["q"], {}, 8, ["h"], LEVELS, {}) is None


def _fair_app() -> tuple[App, list[str]]:
    app = App("fair", settings=Settings(_env_file=None, concurrency=1))  # type: ignore[call-arg]
    started: list[str] = []

    @app.handler("fair-q", tenant=lambda task: task.tenant, fair=True)
    async def answer(task: Ask) -> None:
        started.append(task.tenant)
        await asyncio.sleep(0)

    return app, started


async def test_test_broker_serves_fair_lanes_in_turn() -> None:
    app, started = _fair_app()
    async with TestBroker(app) as broker:
        await app.publish_many("fair-q", [Ask(tenant="big") for _ in range(20)])
        await app.publish("fair-q", Ask(tenant="small"))
        await broker.run_until_idle()
    assert len(started) == 21
    assert started.index("small") <= 1, started


def test_a_fair_handler_must_know_its_tenants() -> None:
    app = App("fair", settings=Settings(_env_file=None))  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="give tenant="):

        @app.handler("fair-q", fair=True)
        async def answer(task: Ask) -> None: ...

    with pytest.raises(ConfigurationError, match="must be a Fair or True"):

        @app.handler("fair-q2", tenant=lambda t: t.tenant, fair=4)  # type: ignore[arg-type]
        async def other(task: Ask) -> None: ...


async def test_a_key_function_that_fails_refuses_the_publish() -> None:
    app = App("fair", settings=Settings(_env_file=None))  # type: ignore[call-arg]

    @app.handler("fair-q", fair=Fair(key=lambda task: None))
    async def answer(task: Ask) -> None: ...

    with pytest.raises(ConfigurationError, match="non-empty str or an int"):
        await app.publish("fair-q", Ask(tenant="x"))

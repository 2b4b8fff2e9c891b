"""Schedules' pure part (``policy.schedules``): where ticks fall (intervals, cron in a time zone
across DST), what a scheduler does with the ticks due since the last it handled under each
``missed`` policy and while paused, and what ``App.schedule`` refuses at import."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import BaseModel

from weclaw_mq import App, ConfigurationError
from weclaw_mq.policy.schedules import Plan, Schedule, plan

T0 = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)


def every_second(**options: object) -> Schedule:
    return Schedule("s", "q", every_s=1, **options)  # type: ignore[arg-type]


def test_a_schedule_seen_first_starts_from_now_without_firing() -> None:
    assert plan(every_second(), None, T0 + timedelta(seconds=0.4), paused=False) == Plan(
        None, 0, T0
    )


def test_an_on_time_tick_fires_and_the_older_missed_ones_are_skipped() -> None:
    now = T0 + timedelta(seconds=5.3)
    assert plan(every_second(), T0, now, paused=False) == Plan(
        T0 + timedelta(seconds=5), 4, T0 + timedelta(seconds=5)
    )
    assert plan(every_second(), T0 + timedelta(seconds=5), now, paused=False).mark is None


def test_late_ticks_are_all_skipped_or_run_once_as_the_policy_says() -> None:
    now = T0 + timedelta(seconds=30.5)
    latest = T0 + timedelta(seconds=30)
    skip = every_second(grace_s=0.1)
    catch_up = every_second(grace_s=0.1, missed="catch_up")
    assert plan(skip, T0, now, paused=False) == Plan(None, 30, latest)
    assert plan(catch_up, T0, now, paused=False) == Plan(latest, 29, latest, late=True)


def test_a_paused_schedule_skips_its_ticks_so_a_resume_does_not_catch_up() -> None:
    catch_up = every_second(missed="catch_up")
    now = T0 + timedelta(seconds=10.2)
    assert plan(catch_up, T0, now, paused=True) == Plan(None, 10, T0 + timedelta(seconds=10))


def test_cron_ticks_follow_the_zone_across_dst() -> None:
    nightly = Schedule("n", "q", cron="30 2 * * *", tz="Europe/Berlin")
    # 2026-03-29 02:30 does not exist in Berlin: that night's tick is the first after the gap.
    ticks = []
    moment = datetime(2026, 3, 27, 12, 0, tzinfo=UTC)
    for _ in range(3):
        moment = nightly.next_after(moment)
        ticks.append(moment.astimezone(UTC).isoformat())
    assert ticks == [
        "2026-03-28T01:30:00+00:00",  # 02:30 CET
        "2026-03-29T01:00:00+00:00",  # 03:00 CEST, the clock jumped over 02:30
        "2026-03-30T00:30:00+00:00",  # 02:30 CEST
    ]
    # 2026-10-25 02:30 happens twice in Berlin: a fixed-hour tick fires the first time only,
    # an hour-wildcard expression counts real time and fires at both.
    autumn = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)
    first = nightly.next_after(autumn)
    assert first.astimezone(UTC).isoformat() == "2026-10-25T00:30:00+00:00"
    assert nightly.next_after(first).astimezone(UTC).isoformat() == "2026-10-26T01:30:00+00:00"
    half_hourly = Schedule("h", "q", cron="30 * * * *", tz="Europe/Berlin")
    second = half_hourly.next_after(first)
    assert second.astimezone(UTC).isoformat() == "2026-10-25T01:30:00+00:00"
    # Two days of nightly ticks missed: counted one by one, the latest fires when on time.
    last = datetime(2026, 3, 28, 1, 30, tzinfo=UTC)
    now = datetime(2026, 3, 30, 0, 30, 5, tzinfo=UTC)
    assert plan(nightly, last, now, paused=False).skipped == 1


def test_every_replica_derives_the_same_task_id_and_payload_for_a_tick() -> None:
    a, b = every_second(), every_second()
    tick = T0 + timedelta(seconds=3)
    assert a.task_id_for(tick) == b.task_id_for(tick) == f"schedule:s:{int(tick.timestamp())}000"
    assert a.task_for(tick) == {"schedule": "s", "tick": "2026-12-03T12:00:03+00:00"}
    custom = every_second(payload=lambda at: {"day": at.date().isoformat()})
    assert custom.task_for(tick) == {"day": "2026-12-03"}


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"name": "a b", "every_s": 1}, "use letters, digits"),
        ({"name": "s"}, "give one of cron= or every_s="),
        ({"name": "s", "every_s": 1, "cron": "* * * * *"}, "give one of cron= or every_s="),
        ({"name": "s", "every_s": 0.01}, "every_s must be a number of seconds from 0.1"),
        ({"name": "s", "cron": "61 * * * *"}, "is not a cron expression"),
        ({"name": "s", "cron": "* * * * * *"}, "cron takes five fields"),
        ({"name": "s", "every_s": 1, "tz": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
        ({"name": "s", "every_s": 1, "missed": "twice"}, "missed must be one of skip, catch_up"),
    ],
)
def test_a_schedule_that_cannot_work_is_refused_with_what_to_fix(
    options: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigurationError, match=says):
        Schedule(queue="q", **options)  # type: ignore[arg-type]


class Rescore(BaseModel):
    day: str


def test_app_schedule_checks_the_name_and_a_fixed_payload_against_the_handler() -> None:
    app = App("t")

    @app.handler("rescore")
    async def rescore(task: Rescore) -> None:
        return None

    with pytest.raises(ConfigurationError, match="refuses its payload"):
        app.schedule("nightly", queue="rescore", cron="0 3 * * *")  # the default payload
    app.schedule(
        "nightly",
        queue="rescore",
        cron="0 3 * * *",
        payload=lambda at: {"day": at.date().isoformat()},
    )
    with pytest.raises(ConfigurationError, match="registered twice"):
        app.schedule("nightly", queue="rescore", every_s=60)

    @app.handler("unguarded", idempotent=False)
    async def unguarded(task: dict[str, str]) -> None:
        return None

    with pytest.warns(UserWarning, match="would run twice"):
        app.schedule("often", queue="unguarded", every_s=5)
    assert list(app.schedules) == ["nightly", "often"]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"cron": "0 0 30 2 *"}, "never fires"),  # February has no 30th
        ({"cron": "0 0 31 4 *", "tz": "Europe/Berlin"}, "never fires"),  # nor April a 31st
        ({"every_s": 1e300}, "every_s must be a number of seconds from 0.1 to"),
        ({"every_s": 367 * 24 * 3600}, "a rarer tick takes cron="),
    ],
)
def test_a_schedule_that_cannot_fire_is_refused_when_it_is_declared(
    options: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigurationError, match=says):
        Schedule("s", "q", **options)  # type: ignore[arg-type]
    app = App("t")
    with pytest.raises(ConfigurationError, match=says):
        app.schedule("s", queue="q", **options)  # type: ignore[arg-type]
    assert not app.schedules
    # Rare is not never: a leap day's tick fires every four years.
    assert Schedule("leap", "q", cron="0 0 29 2 *").next_after(T0).month == 2

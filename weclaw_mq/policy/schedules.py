"""Schedules: when their ticks fall, and what a scheduler does with the ticks it finds due.

A ``Schedule`` publishes one task to a handler queue per tick: a cron expression evaluated in
its time zone, or a fixed interval counted from the Unix epoch (so every replica agrees on
the ticks without talking). A tick is fired at most once (``scheduling.scheduler`` holds the
lease, derives the task id from the schedule and the tick, and marks the tick fired in
Redis); what happens to ticks nobody fired on time is the schedule's ``missed`` policy:

- ``"skip"``: a tick is fired only on time (within ``grace_s`` of its time); the ticks missed
  (no scheduler ran, a leader died and its lease had to lapse) are counted as skipped.
- ``"catch_up"``: the missed ticks are run once: the latest of them fires, late, and the
  older ones are counted as skipped.

Everything here is pure: the scheduler asks ``plan`` with the last tick it marked and the
time, and carries the answer out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from weclaw_mq.errors import ConfigurationError

MissedPolicy = Literal["skip", "catch_up"]
MISSED_POLICIES: tuple[MissedPolicy, ...] = ("skip", "catch_up")

# A schedule's name goes into Redis keys and task ids.
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
# How late a tick may still fire under "skip" when the schedule says nothing.
DEFAULT_GRACE_S = 10.0
# Ticks counted one by one between the last fired and now, at most: a cron schedule whose
# scheduler was away for years is not walked tick by tick (the count then says "at least").
MAX_TICKS_WALKED = 10_000
# The longest interval: ticks stay countable from the epoch (rarer ticks take a cron).
MAX_EVERY_S = 366 * 24 * 3600.0

# What a tick publishes: a value, or a function of the tick's time.
Payload = Any | Callable[[datetime], Any]


@dataclass(frozen=True)
class Schedule:
    """A task published to ``queue`` on every tick.

    Args:
        name: Unique in its App: letters, digits and ``_.:-``, at most 100.
        queue: The handler queue the tick's task goes to.
        cron: A five-field cron expression (``"0 3 * * *"``), evaluated in ``tz``.
        every_s: Or a fixed interval in seconds, counted from the Unix epoch.
        tz: The IANA time zone of ``cron`` (``"Europe/Berlin"``); DST is the zone's own.
        missed: ``"skip"`` or ``"catch_up"`` (the module's docstring says what each does).
        grace_s: How late a tick may still fire on time.
        payload: The task: a value, or a function of the tick's time (aware, in ``tz``);
            default ``{"schedule": name, "tick": "<ISO 8601 time of the tick>"}``.
    """

    name: str
    queue: str
    cron: str | None = None
    every_s: float | None = None
    tz: str = "UTC"
    missed: MissedPolicy = "skip"
    grace_s: float = DEFAULT_GRACE_S
    payload: Payload = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigurationError(
                f"schedule name {self.name!r}: use letters, digits and _.:- (at most 100)"
            )
        if (self.cron is None) == (self.every_s is None):
            raise ConfigurationError(f"schedule {self.name!r}: give one of cron= or every_s=")
        if self.every_s is not None and not (
            isinstance(self.every_s, int | float)
            and math.isfinite(self.every_s)
            and 0.1 <= self.every_s <= MAX_EVERY_S
        ):
            raise ConfigurationError(
                f"schedule {self.name!r}: every_s must be a number of seconds from 0.1 to "
                f"{MAX_EVERY_S:.0f} (366 days; a rarer tick takes cron=), got {self.every_s!r}"
            )
        if self.cron is not None and not (
            isinstance(self.cron, str) and croniter.is_valid(self.cron)
        ):
            raise ConfigurationError(
                f"schedule {self.name!r}: {self.cron!r} is not a cron expression "
                "(five fields: minute hour day-of-month month day-of-week)"
            )
        if self.cron is not None and len(self.cron.split()) != 5:
            raise ConfigurationError(
                f"schedule {self.name!r}: cron takes five fields (minute hour day-of-month "
                f"month day-of-week), got {self.cron!r}"
            )
        try:
            ZoneInfo(self.tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise ConfigurationError(
                f"schedule {self.name!r}: unknown time zone {self.tz!r} (an IANA name such "
                "as 'Europe/Berlin')"
            ) from None
        if self.missed not in MISSED_POLICIES:
            raise ConfigurationError(
                f"schedule {self.name!r}: missed must be one of {', '.join(MISSED_POLICIES)}, "
                f"got {self.missed!r}"
            )
        if not (isinstance(self.grace_s, int | float) and 0 < self.grace_s < math.inf):
            raise ConfigurationError(f"schedule {self.name!r}: grace_s must be > 0 seconds")
        self._check_it_fires()

    def _check_it_fires(self) -> None:
        """A cron that parses may still name no real day (``0 0 30 2 *``): its next tick is
        asked for now, at import, not by the scheduler at 3 a.m."""
        now = datetime.now(UTC)
        try:
            self.next_after(now)
            self.last_at_or_before(now)
        except Exception as e:
            raise ConfigurationError(
                f"schedule {self.name!r}: {self.every} never fires: no date matches it "
                f"({type(e).__name__}: {e})"
            ) from None

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)

    @property
    def every(self) -> str:
        """The schedule as a person reads it: its cron and zone, or its interval."""
        if self.cron is not None:
            return f"cron {self.cron} ({self.tz})"
        return f"every {self.every_s:g} s"

    def next_after(self, moment: datetime) -> datetime:
        """The first tick strictly after ``moment`` (aware), in the schedule's zone."""
        if self.every_s is not None:
            step_ms = round(self.every_s * 1000)
            at_ms = _ms(moment)
            return _at(((at_ms // step_ms) + 1) * step_ms, self.zone)
        assert self.cron is not None
        it = croniter(self.cron, moment.astimezone(self.zone))
        tick: datetime = it.get_next(datetime)
        while self._repeated(tick):
            tick = it.get_next(datetime)
        return tick

    def last_at_or_before(self, moment: datetime) -> datetime:
        """The latest tick at or before ``moment`` (aware), in the schedule's zone."""
        if self.every_s is not None:
            step_ms = round(self.every_s * 1000)
            return _at((_ms(moment) // step_ms) * step_ms, self.zone)
        assert self.cron is not None
        later = moment.astimezone(self.zone) + timedelta(microseconds=1)
        it = croniter(self.cron, later)
        tick: datetime = it.get_prev(datetime)
        while self._repeated(tick):
            tick = it.get_prev(datetime)
        return tick

    def _repeated(self, tick: datetime) -> bool:
        """A fixed-hour cron tick in the hour the clock repeats (autumn's DST change), the
        second time: it fires once, at the first (as cron does). Hour-wildcard expressions
        (``*/30 * * * *``) keep both: they count real time."""
        assert self.cron is not None
        return (
            tick.fold == 1
            and tick.replace(fold=0).utcoffset() != tick.utcoffset()
            and not self.cron.split()[1].startswith("*")
        )

    def task_for(self, tick: datetime) -> Any:
        """The payload of the task this tick publishes."""
        if self.payload is None:
            return {"schedule": self.name, "tick": tick.astimezone(self.zone).isoformat()}
        if callable(self.payload):
            return self.payload(tick.astimezone(self.zone))
        return self.payload

    def task_id_for(self, tick: datetime) -> str:
        """The tick's task id: the same on every replica, so a second publish of one tick is
        the same task (the guard runs it once)."""
        return f"schedule:{self.name}:{_ms(tick)}"


@dataclass(frozen=True)
class Plan:
    """What a scheduler does now with one schedule.

    Args:
        fire: The tick to publish now, or None.
        skipped: How many due ticks are passed over (missed, or run together by catch-up).
        mark: The tick to record as the last one handled (fired or skipped), or None when
            nothing changed.
        late: Whether ``fire`` is past its grace (a catch-up run).
    """

    fire: datetime | None
    skipped: int
    mark: datetime | None
    late: bool = False


NOTHING = Plan(None, 0, None)


def plan(schedule: Schedule, last: datetime | None, now: datetime, *, paused: bool) -> Plan:
    """What to do with ``schedule`` at ``now``, the last handled tick being ``last``.

    A schedule seen for the first time (``last`` None) starts from now: the latest tick at or
    before now is recorded as handled, and not fired. A paused schedule's due ticks are
    recorded as skipped, so a resume does not catch up its pause.
    """
    if last is None:
        return Plan(None, 0, schedule.last_at_or_before(now))
    due = _due(schedule, last, now)
    if not due.count:
        return NOTHING
    latest = due.latest
    assert latest is not None
    if paused:
        return Plan(None, due.count, latest)
    on_time = (now - latest).total_seconds() <= schedule.grace_s
    if on_time or schedule.missed == "catch_up":
        return Plan(latest, due.count - 1, latest, late=not on_time)
    return Plan(None, due.count, latest)


@dataclass(frozen=True)
class _Due:
    count: int
    latest: datetime | None


def _due(schedule: Schedule, last: datetime, now: datetime) -> _Due:
    """The ticks after ``last`` and at or before ``now``: how many, and the latest."""
    latest = schedule.last_at_or_before(now)
    if latest <= last:
        return _Due(0, None)
    if schedule.every_s is not None:
        step_ms = round(schedule.every_s * 1000)
        return _Due((_ms(latest) - _ms(last)) // step_ms, latest)
    count, tick = 0, last
    while count < MAX_TICKS_WALKED:
        tick = schedule.next_after(tick)
        if tick > now:
            break
        count += 1
    return _Due(max(count, 1), latest)


def _ms(moment: datetime) -> int:
    return math.floor(moment.timestamp() * 1000)


def _at(ms: int, zone: ZoneInfo) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC).astimezone(zone)


def from_ms(ms: int, schedule: Schedule) -> datetime:
    """A tick recorded as epoch milliseconds, in the schedule's zone."""
    return _at(ms, schedule.zone)


def to_ms(tick: datetime) -> int:
    """A tick as the epoch milliseconds it is recorded as."""
    return _ms(tick)

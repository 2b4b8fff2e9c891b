"""The scheduler: fires an App's schedules, each tick exactly once however many replicas run.

Every replica (``weclaw-mq scheduler MODULE:APP``, or workers started with ``--schedules``)
runs a ``Scheduler``; they compete for one lease in Redis (``state.schedule_book``), and only
its holder fires. For each schedule the holder asks the pure ``policy.schedules.plan`` what is
due since the tick it last marked, publishes the tick's task (confirmed by the broker) with a
task id derived from the schedule and the tick, and only then marks the tick in Redis, in a
script that checks the lease. So:

- a replica that dies after the publish and before the mark leaves the tick unmarked; the
  next holder publishes it again under the same task id, and the guard of its handler runs it
  once (a handler with ``idempotent=False`` may then run a tick twice: it is warned about);
- a replica that lost its lease (a stall past ``lease_s``) marks nothing, and its publish, if
  any, is that same task again;
- while no replica holds the lease (the holder was killed: it lapses within ``lease_s``), the
  ticks that fall are missed, and the schedule's ``missed`` policy decides (skip them, or run
  them once).

A graceful stop gives the lease up at once, so a standby takes over without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError, StateCommandError, StateUnavailableError
from weclaw_mq.policy.failures import describe
from weclaw_mq.policy.schedules import Schedule, from_ms, plan, to_ms
from weclaw_mq.state import TaskState
from weclaw_mq.state.schedule_book import ScheduleBook, ScheduleRecord, book_of

log = logging.getLogger("weclaw_mq.scheduler")


# A round that met Redis failing is tried again after this, doubled each time up to a
# lease renewal (lease_s / 3): Redis away costs a few retries, not a log line a tick.
FIRST_RETRY_S = 0.5
# A scheduler that died of an unforeseen error starts again after this, doubled each time
# up to RESTART_MAX_S (a worker's schedules never stop firing silently).
FIRST_RESTART_S = 1.0
RESTART_MAX_S = 60.0


class Scheduler:
    """Fires ``app``'s schedules while it holds the app's scheduler lease.

    Args:
        app: The App whose schedules (``App.schedule``) it fires.
        lease_s: How long the lease lasts unrenewed (renewed every third of it): how long
            the ticks of a killed holder go unfired; default ``settings.scheduler_lease_s``.
    """

    def __init__(self, app: App, *, lease_s: float | None = None) -> None:
        self.app = app
        self.lease_s = lease_s if lease_s is not None else app.settings.scheduler_lease_s
        self.owner = uuid.uuid4().hex
        self.leading = False
        self.restarts = 0  # how often ``run_restarting`` started it again after it died
        self._dead = False  # it died and waits to be started again
        self._stop = asyncio.Event()
        self._book: ScheduleBook | None = None
        self._said: bool | None = None  # whether it last said it leads
        self._redis_failures = 0  # rounds in a row that met Redis failing
        self._failing: dict[str, str] = {}  # schedule -> its failure, logged once per streak
        self._paused: set[str] = set()  # schedules said to be paused (said once)

    @property
    def book(self) -> ScheduleBook:
        if self._book is None:
            self._book = book_of(self.app.store, self.app.name)
        return self._book

    def stop(self) -> None:
        """``run`` gives the lease up and returns after the tick it is firing, if any."""
        self._stop.set()

    @property
    def state(self) -> str:
        """What it does now, for a worker's ``/healthz``: ``leading``, ``standing_by``,
        ``redis_failing`` (waiting Redis out) or ``restarting`` (it died)."""
        if self._dead:
            return "restarting"
        if self._redis_failures:
            return "redis_failing"
        return "leading" if self.leading else "standing_by"

    async def run(self) -> None:
        """Hold or wait for the lease and fire what is due, until ``stop``.

        A schedule that fails is logged and tried again next round while the others fire;
        Redis failing (down, or refusing a command) is retried with backoff.

        Raises:
            ConfigurationError: The App keeps no Redis task store.
        """
        schedules = self.app.schedules
        if not schedules:
            log.warning("app %r has no schedules: the scheduler has nothing to fire", self.app.name)
        book = self.book
        self.app.metrics.scheduler_leader.labels().set_function(lambda: float(self.leading))
        try:
            while not self._stop.is_set():
                await self._round(book, schedules)
                wait_s = self._wait_s(schedules)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), wait_s)
        finally:
            if self.leading:
                with contextlib.suppress(Exception):  # it lapses by itself otherwise
                    await book.resign(self.owner)
                log.info("scheduler of %r stopped; lease given up", self.app.name)
            self.leading = False

    async def run_restarting(self) -> None:
        """``run``, started again after a bounded backoff each time it dies of an unforeseen
        error (logged at ERROR with its traceback), until ``stop``: what a worker runs.

        Raises:
            ConfigurationError: The App keeps no Redis task store (a restart cannot help).
        """
        delay_s = FIRST_RESTART_S
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            started = loop.time()
            self._dead = False
            try:
                await self.run()
                return
            except ConfigurationError:
                raise
            except Exception:
                self._dead = True
                if loop.time() - started > RESTART_MAX_S:
                    delay_s = FIRST_RESTART_S  # it ran a good while: a new streak
                self.restarts += 1
                log.exception(
                    "the scheduler of %r died (restart %d): starting it again in %.0f s",
                    self.app.name,
                    self.restarts,
                    delay_s,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay_s)
            delay_s = min(delay_s * 2, RESTART_MAX_S)

    async def _round(self, book: ScheduleBook, schedules: Mapping[str, Schedule]) -> None:
        try:
            leading = await book.lead(self.owner, self.lease_s)
        except (StateUnavailableError, StateCommandError) as e:
            self.leading = False
            self._redis_failed(e)
            return
        if leading != self._said:  # at the first round, and at every change
            self._said = leading
            log.info(
                "scheduler of %r (replica %s) %s",
                self.app.name,
                self.owner[:8],
                "leads: it fires the ticks" if leading else "stands by: another replica leads",
            )
        self.leading = leading
        if leading:
            try:
                await self.fire_due(book, schedules)
            except (StateUnavailableError, StateCommandError) as e:
                self._redis_failed(e)
                return
        if self._redis_failures:
            log.info("scheduler of %r: Redis answers again", self.app.name)
            self._redis_failures = 0

    def _redis_failed(self, error: StateUnavailableError | StateCommandError) -> None:
        """Logged at the first round of a streak; the rounds after wait longer each time."""
        self._redis_failures += 1
        if self._redis_failures == 1:
            log.log(
                logging.ERROR if isinstance(error, StateCommandError) else logging.WARNING,
                "scheduler of %r: Redis failed (%s); firing nothing, trying again with backoff",
                self.app.name,
                error,
            )

    def _wait_s(self, schedules: Mapping[str, Schedule]) -> float:
        """Until the next tick of any schedule, or the lease's renewal, whichever is first;
        after Redis failed, a backoff instead."""
        renew_s = self.lease_s / 3
        if self._redis_failures:
            return min(renew_s, FIRST_RETRY_S * 2.0 ** min(self._redis_failures - 1, 16))
        if not self.leading or not schedules:
            return renew_s
        now = datetime.now(UTC)
        ticks = []
        for schedule in schedules.values():
            with contextlib.suppress(Exception):  # its failure is fire_due's to report
                ticks.append(schedule.next_after(now))
        if not ticks:
            return renew_s
        return max(0.0, min(renew_s, (min(ticks) - now).total_seconds()))

    async def fire_due(self, book: ScheduleBook, schedules: Mapping[str, Schedule]) -> None:
        """One pass over every schedule: publish what is due, then mark it (lease checked).

        A schedule that fails is logged (ERROR, once until it works again) and the others
        still fire.

        Raises:
            StateUnavailableError, StateCommandError: Redis failed reading the records, or
                did not answer marking a tick (the round is tried again).
        """
        records = await book.read(list(schedules))
        for name, schedule in schedules.items():
            if self._stop.is_set():
                return
            try:
                await self._fire(book, name, schedule, records[name])
            except StateUnavailableError:
                raise  # Redis away: no schedule can fire, the round waits and retries
            except Exception as e:
                self._failed(name, e)
            else:
                if self._failing.pop(name, None) is not None:
                    log.info("schedule %r works again", name)

    def _failed(self, name: str, error: Exception) -> None:
        self.app.metrics.schedule_ticks.labels(name, "failed").inc()
        said = describe(error)
        if self._failing.get(name) == said:
            return
        self._failing[name] = said
        log.error(
            "schedule %r failed (%s): tried again next round; the other schedules go on",
            name,
            said,
            exc_info=error,
        )

    async def _fire(
        self, book: ScheduleBook, name: str, schedule: Schedule, record: ScheduleRecord
    ) -> None:
        """Publish ``schedule``'s due tick, if any, then mark it."""
        self._say_paused(name, record.paused)
        now = datetime.now(UTC)
        last = None if record.last_tick_ms is None else from_ms(record.last_tick_ms, schedule)
        step = plan(schedule, last, now, paused=record.paused)
        if step.mark is None:
            return
        task_id = ""
        if step.fire is not None:
            try:
                task_id = await self.app.publish(
                    schedule.queue,
                    schedule.task_for(step.fire),
                    task_id=schedule.task_id_for(step.fire),
                )
            except Exception as e:  # tried again next round, until the tick is missed
                self.app.metrics.schedule_ticks.labels(name, "failed").inc()
                log.error(
                    "schedule %r: the tick of %s was not published (%s); trying again",
                    name,
                    step.fire.isoformat(),
                    describe(e),
                )
                return
        marked = await book.mark(self.owner, name, to_ms(step.mark), task_id, step.skipped)
        if not marked:
            # The lease is another's now (it marks), or the tick was marked before.
            log.info("schedule %r: tick %s was not marked here", name, step.mark.isoformat())
            return
        if step.skipped:
            self.app.metrics.schedule_ticks.labels(name, "skipped").inc(step.skipped)
            if not record.paused:  # a pause's skips were said once, when it was seen
                log.warning(
                    "schedule %r: %d tick(s) missed and skipped (missed=%r)",
                    name,
                    step.skipped,
                    schedule.missed,
                )
        if step.fire is not None:
            self.app.metrics.schedule_ticks.labels(name, "fired").inc()
            log.info(
                "schedule %r fired the tick of %s%s as task %s",
                name,
                step.fire.isoformat(),
                " (late: catching up)" if step.late else "",
                task_id,
            )

    def _say_paused(self, name: str, paused: bool) -> None:
        """A pause is logged once when this scheduler first sees it, not at every tick."""
        if paused and name not in self._paused:
            self._paused.add(name)
            log.warning(
                "schedule %r is paused: its ticks are skipped until it is resumed "
                "('weclaw-mq schedules resume')",
                name,
            )
        elif not paused and name in self._paused:
            self._paused.discard(name)
            log.info("schedule %r is resumed: it fires from its next tick", name)


@dataclass(frozen=True)
class ScheduleView:
    """One schedule as ``weclaw-mq schedules list`` shows it."""

    name: str
    queue: str
    every: str
    missed: str
    paused: bool
    next_tick: datetime | None  # None while paused
    last_tick: datetime | None  # the last handled, fired or skipped
    last_task_id: str | None
    last_status: str | None  # the last fired task's status, when results are on
    fired: int
    skipped: int


async def describe_schedules(app: App) -> tuple[list[ScheduleView], bool]:
    """Every schedule of ``app`` with its state in Redis, and whether a scheduler leads now."""
    book = book_of(app.store, app.name)
    schedules = app.schedules
    records = await book.read(list(schedules))
    leader = await book.leader()
    now = datetime.now(UTC)
    views = []
    for name, schedule in schedules.items():
        record = records[name]
        status = await _status(app, record)
        views.append(
            ScheduleView(
                name=name,
                queue=schedule.queue,
                every=schedule.every,
                missed=schedule.missed,
                paused=record.paused,
                next_tick=None if record.paused else schedule.next_after(now),
                last_tick=None
                if record.last_tick_ms is None
                else from_ms(record.last_tick_ms, schedule),
                last_task_id=record.last_task_id,
                last_status=status,
                fired=record.fired,
                skipped=record.skipped,
            )
        )
    return views, leader is not None


async def _status(app: App, record: ScheduleRecord) -> str | None:
    if record.last_task_id is None or not app.settings.results_enabled:
        return None
    state: TaskState | None = await app.status(record.last_task_id)
    return None if state is None else state.status.value


async def pause(app: App, name: str, paused: bool) -> None:
    """Pause (``True``) or resume schedule ``name`` of ``app``, for every replica at once.

    Raises:
        ConfigurationError: ``app`` has no schedule ``name``.
    """
    if name not in app.schedules:
        known = ", ".join(app.schedules) or "none"
        raise ConfigurationError(f"app {app.name!r} has no schedule {name!r} (known: {known})")
    await book_of(app.store, app.name).pause(name, paused)

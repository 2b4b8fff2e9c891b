"""A schedule's faults stay its own (issue 38 item 3), with a real worker firing the schedules
(``--schedules``) on the real broker and Redis: a schedule that fails is logged at ERROR
while the others keep firing, Redis refusing the schedule book's commands is survived, a
scheduler that dies is started again, and a paused schedule says so once, not every tick."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import close_apps, settings_for, wait_until
from tests.integration.scheduler_processes import Ticking
from tests.integration.scheduler_processes import ticking as ticking  # the fixture
from tests.private_servers import PrivateRedis
from weclaw_mq import App, Worker
from weclaw_mq.contract.naming import schedule_key
from weclaw_mq.policy.schedules import Schedule
from weclaw_mq.scheduling.scheduler import Scheduler
from weclaw_mq.state.schedule_book import book_of

SCHEDULER_LOG = "weclaw_mq.scheduler"


class Unforeseen(Schedule):
    """A schedule whose ticks cannot be computed, which registration did not foresee (as
    ``every_s=1e300`` once was not): every question about its ticks raises."""

    def _check_it_fires(self) -> None:
        pass

    def next_after(self, moment: datetime) -> datetime:
        raise OverflowError("date value out of range")

    def last_at_or_before(self, moment: datetime) -> datetime:
        raise OverflowError("date value out of range")


def scheduler_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == SCHEDULER_LOG and r.levelno == level
    ]


async def test_a_failing_schedule_is_logged_once_and_the_others_keep_firing(
    ticking: Ticking,
    start_worker: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    redis_url: str,
) -> None:
    caplog.set_level(logging.INFO, logger=SCHEDULER_LOG)
    app = ticking.app
    # First in the App's order: before, it ended the worker's scheduler and nothing fired.
    good = app.schedules["every-second"]
    app._schedules.clear()
    app._schedules["broken"] = Unforeseen("broken", ticking.queue, every_s=1)
    app._schedules["every-second"] = good
    try:
        await start_worker(app, schedules=True)
        await wait_until(lambda: len(ticking.runs) >= 3, 30, "three ticks of the good schedule")
        errors = [m for m in scheduler_records(caplog, logging.ERROR) if "'broken'" in m]
        assert len(errors) == 1, errors  # once, not once a round
        assert "OverflowError" in errors[0] and "the other schedules go on" in errors[0]
        assert set(ticking.ran().values()) == {1}
    finally:
        client = aioredis.from_url(redis_url)
        await client.delete(schedule_key(app.name, "broken"))
        await client.aclose()


async def test_a_scheduler_that_dies_is_started_again_by_its_worker(
    ticking: Ticking,
    start_worker: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=SCHEDULER_LOG)
    original = Scheduler._round
    died: list[Scheduler] = []

    async def dies_once(self: Scheduler, *args: Any) -> None:
        if not died:
            died.append(self)
            raise RuntimeError("an unforeseen bug in a round")
        await original(self, *args)

    monkeypatch.setattr(Scheduler, "_round", dies_once)
    worker = await start_worker(ticking.app, schedules=True)
    await wait_until(lambda: len(ticking.runs) >= 2, 30, "ticks fired after the restart")
    (scheduler,) = died
    assert scheduler.restarts == 1
    assert worker.health().as_json()["scheduler"] == "leading"  # /healthz shows it
    (said,) = [m for m in scheduler_records(caplog, logging.ERROR) if "died" in m]
    assert "starting it again" in said


async def test_a_paused_schedule_is_logged_once_not_at_every_tick(
    ticking: Ticking,
    start_worker: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=SCHEDULER_LOG)
    app = ticking.app
    book = book_of(app.store, app.name)
    await start_worker(app, schedules=True)
    await wait_until(lambda: len(ticking.runs) >= 1, 30, "a tick fired")
    seen = len(caplog.records)  # what the pause logs, from here on
    await book.pause("every-second", True)
    before = (await book.read(["every-second"]))["every-second"].skipped

    async def skipped_three() -> bool:
        record = (await book.read(["every-second"]))["every-second"]
        return record.skipped >= before + 3

    await wait_until(skipped_three, 30, "three ticks skipped while paused")
    warnings = [
        r.getMessage()
        for r in caplog.records[seen:]
        if r.name == SCHEDULER_LOG and r.levelno == logging.WARNING
    ]
    assert warnings == [
        "schedule 'every-second' is paused: its ticks are skipped until it is resumed "
        "('weclaw-mq schedules resume')"
    ]
    await book.pause("every-second", False)
    count = len(ticking.runs)
    await wait_until(lambda: len(ticking.runs) > count, 30, "a tick after the resume")
    assert any("is resumed" in m for m in scheduler_records(caplog, logging.INFO))


async def test_redis_refusing_the_schedule_book_is_survived_and_firing_resumes(
    private_redis: PrivateRedis,
    broker_url: str,
    qname: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=SCHEDULER_LOG)
    admin = aioredis.from_url(private_redis.url)
    # A user that may not read hashes: the book's read fails (NOPERM) after its lease held.
    await admin.execute_command("ACL", "SETUSER", "sched", "on", ">pw", "~*", "&*", "+@all")
    await admin.execute_command("ACL", "SETUSER", "sched", "-hgetall")
    url = private_redis.url.replace("unix://", "unix://sched:pw@", 1)
    app = App(f"sched-{qname}", settings=settings_for(broker_url, url, scheduler_lease_s=3.0))
    runs: list[str] = []

    @app.handler(qname)
    async def tick(task: dict[str, str]) -> None:
        runs.append(task["tick"])

    app.schedule("every-second", queue=qname, every_s=1)
    worker = Worker(app, schedules=True)
    running = asyncio.create_task(worker.run())
    try:
        await wait_until(
            lambda: any("no permissions" in m for m in scheduler_records(caplog, logging.ERROR)),
            30,
            "the refused read logged",
        )
        assert not running.done()
        await admin.execute_command("ACL", "SETUSER", "sched", "+hgetall")
        await wait_until(lambda: len(runs) >= 2, 30, "ticks fired once Redis allows the read")
        assert any("Redis answers again" in m for m in scheduler_records(caplog, logging.INFO))
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)
        await admin.aclose()
        await close_apps([app], broker_url, private_redis.url)


async def test_redis_gone_between_a_publish_and_its_mark_is_waited_out(
    private_redis: PrivateRedis, broker_url: str, qname: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SCHEDULER_LOG)
    # Results off: the publish itself writes nothing to Redis, so the mark is what meets it.
    app = App(
        f"sched-{qname}",
        settings=settings_for(broker_url, private_redis.url, results_enabled=False),
    )
    stopped: list[datetime] = []

    def payload(tick: datetime) -> dict[str, str]:
        if not stopped:  # the first tick: Redis goes between its publish and its mark
            stopped.append(tick)
            private_redis.stop()
        return {"tick": tick.isoformat()}

    @app.handler(qname)
    async def tick(task: dict[str, str]) -> None:
        return None

    app.schedule("every-second", queue=qname, every_s=1, payload=payload)
    await app.declare()
    scheduler = Scheduler(app, lease_s=3.0)
    running = asyncio.create_task(scheduler.run())
    book = book_of(app.store, app.name)

    async def fired() -> bool:
        return (await book.read(["every-second"]))["every-second"].fired >= 1

    try:
        await wait_until(lambda: bool(stopped), 30, "a tick published as Redis goes")
        # Before, the mark's StateUnavailableError ended the scheduler for good.
        await wait_until(
            lambda: (
                running.done()
                or any("Redis failed" in m for m in scheduler_records(caplog, logging.WARNING))
            ),
            30,
            "the failed mark logged",
        )
        assert not running.done() and scheduler.state == "redis_failing"
        private_redis.start()
        await wait_until(fired, 30, "a tick fired and marked once Redis is back")
        assert scheduler.state == "leading" and not running.done()
    finally:
        scheduler.stop()
        await asyncio.wait_for(running, 30)
        await close_apps([app], broker_url, private_redis.url)

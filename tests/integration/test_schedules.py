"""Schedules on the real broker and Redis (issue 30 item 3): each tick fires exactly once
however many scheduler replicas run, a killed leader's lease lapses and a standby goes on,
the missed ticks are skipped or run once as the schedule says, a tick published twice runs
once, pause and resume work for every replica, and the CLI lists them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from datetime import UTC, datetime, timedelta
from typing import Any

import redis.asyncio as aioredis

from tests.conftest import outcome_count, wait_until
from tests.integration.processes import REPO_ROOT, run_cli, settings_env
from tests.integration.scheduler_processes import LEADS, LEASE_S, MODULE, STANDS_BY, Ticking
from tests.integration.scheduler_processes import ticking as ticking  # the fixture
from weclaw_mq import Worker
from weclaw_mq.contract.naming import schedule_key
from weclaw_mq.policy.schedules import Schedule, to_ms
from weclaw_mq.scheduling.scheduler import Scheduler
from weclaw_mq.state.schedule_book import book_of


async def test_two_replicas_fire_each_tick_once_and_a_killed_leader_is_replaced(
    ticking: Ticking,
) -> None:
    first = ticking.spawn()
    await first.wait_for_log(LEADS, 20, "the first scheduler leading")
    second = ticking.spawn()
    await second.wait_for_log(STANDS_BY, 20, "the second scheduler standing by")
    await wait_until(lambda: len(ticking.runs) >= 3, 20, "three ticks run")

    first.kill()  # kill -9: its lease is not given up, it lapses
    killed_at = len(ticking.runs)
    await second.wait_for_log(LEADS, 3 * LEASE_S + 10, "the standby taking over")
    await wait_until(lambda: len(ticking.runs) >= killed_at + 3, 20, "three ticks more")
    second.signal(signal.SIGTERM)
    assert await second.wait_exit(20) == 0, second.describe()

    book = book_of(ticking.app.store, ticking.app.name)
    assert await book.leader() is None  # a graceful stop gave the lease up
    ran = ticking.ran()
    assert set(ran.values()) == {1}, ran  # no tick ran twice
    record = (await book.read(["every-second"]))["every-second"]
    ticks = sorted(datetime.fromisoformat(t) for t in ran)
    assert all(t.microsecond == 0 for t in ticks)
    assert record.fired == len(ticks)
    # Every tick from the first fired to the last handled was fired or skipped: none lost.
    assert record.last_tick_ms is not None
    span = (record.last_tick_ms - to_ms(ticks[0])) // 1000 + 1
    assert record.fired + record.skipped == span, (record, ticks)
    assert record.skipped >= 1  # the ticks of the failover, skipped (missed="skip")


async def test_a_tick_published_twice_runs_once(ticking: Ticking) -> None:
    app = ticking.app
    schedule = app.schedules["every-second"]
    scheduler = Scheduler(app, lease_s=5)
    book = scheduler.book
    assert await book.lead(scheduler.owner, 5)
    await wait_until(lambda: datetime.now(UTC).microsecond < 500_000, 2, "early in a second")
    tick = schedule.last_at_or_before(datetime.now(UTC))
    await book.mark(scheduler.owner, "every-second", to_ms(tick - timedelta(seconds=1)), "", 0)
    # A replica published this tick and died before marking it: the tick is unmarked.
    task_id = await app.publish(
        ticking.queue, schedule.task_for(tick), task_id=schedule.task_id_for(tick)
    )
    assert (await app.result(task_id, timeout_s=10)).status.value == "succeeded"
    # The next leader finds it unmarked and publishes it again: the same task, acked unrun.
    await scheduler.fire_due(book, {"every-second": schedule})
    record = (await book.read(["every-second"]))["every-second"]
    assert record.last_task_id == task_id and record.fired == 1
    await wait_until(
        lambda: outcome_count(app, ticking.queue, "duplicate") == 1, 10, "the copy acked unrun"
    )
    assert ticking.ran()[tick.isoformat()] == 1
    await book.resign(scheduler.owner)


async def test_missed_ticks_are_run_once_by_catch_up_and_skipped_by_skip(
    ticking: Ticking, redis_url: str
) -> None:
    app = ticking.app
    queue = ticking.queue
    scheduler = Scheduler(app, lease_s=5)
    book = scheduler.book
    assert await book.lead(scheduler.owner, 5)
    schedules = {
        # The latest of the 60 is within its grace (10 s): it fires on time, 59 are skipped.
        "on-time": Schedule("on-time", queue, every_s=1, missed="skip"),
        # A grace of 0.1 s: the latest is late too.
        "catch-up": Schedule("catch-up", queue, every_s=1, missed="catch_up", grace_s=0.1),
        "skip-late": Schedule("skip-late", queue, every_s=1, missed="skip", grace_s=0.1),
    }
    try:
        # Past the latest tick's 0.1 s grace, and far from the next one.
        await wait_until(
            lambda: 200_000 <= datetime.now(UTC).microsecond < 700_000, 2, "mid-second"
        )
        # Each schedule last handled the tick a minute before the latest: 60 fell since.
        latest = schedules["on-time"].last_at_or_before(datetime.now(UTC))
        for name in schedules:
            assert await book.mark(
                scheduler.owner, name, to_ms(latest - timedelta(seconds=60)), "", 0
            )
        await scheduler.fire_due(book, schedules)
        records = await book.read(list(schedules))
        assert (records["on-time"].fired, records["on-time"].skipped) == (1, 59)
        assert (records["catch-up"].fired, records["catch-up"].skipped) == (1, 59)
        assert (records["skip-late"].fired, records["skip-late"].skipped) == (0, 60)
        for name in ("on-time", "catch-up"):
            task_id = records[name].last_task_id
            assert task_id is not None
            assert (await app.result(task_id, timeout_s=10)).status.value == "succeeded"
    finally:
        await book.resign(scheduler.owner)
        client = aioredis.from_url(redis_url)
        await client.delete(*(schedule_key(app.name, name) for name in schedules))
        await client.aclose()


async def test_pause_and_resume_from_the_cli_and_list_shows_the_last_status(
    ticking: Ticking,
) -> None:
    env = {
        **settings_env(ticking.app.settings),
        "TEST_APP": ticking.app.name,
        "TEST_QUEUE": ticking.queue,
        "TEST_MISSED": "skip",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ticking.folder), str(REPO_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    worker = Worker(ticking.app, schedules=True)  # a worker that fires the schedules too
    run = asyncio.create_task(worker.run())
    try:
        await wait_until(lambda: len(ticking.runs) >= 2, 20, "two ticks fired by the worker")
        paused = await run_cli("schedules", "pause", f"{MODULE}:app", "every-second", env=env)
        assert paused.code == 0 and "paused" in paused.stdout, paused
        await asyncio.sleep(0)
        before = len(ticking.runs)
        book = book_of(ticking.app.store, ticking.app.name)
        record = (await book.read(["every-second"]))["every-second"]
        await wait_until(
            lambda: _skipped_more(book, record.skipped, 2), 10, "two ticks skipped while paused"
        )
        assert len(ticking.runs) <= before + 1  # at most the tick in flight as it paused
        listed = await run_cli("schedules", "list", f"{MODULE}:app", "--json", env=env)
        document = json.loads(listed.stdout)
        (entry,) = document["schedules"]
        assert entry["paused"] is True and entry["next_tick"] is None
        assert entry["last_status"] == "succeeded" and document["leader"] is True
        resumed = await run_cli("schedules", "resume", f"{MODULE}:app", "every-second", env=env)
        assert resumed.code == 0
        count = len(ticking.runs)
        await wait_until(lambda: len(ticking.runs) >= count + 2, 20, "ticks again after resume")
        unknown = await run_cli("schedules", "pause", f"{MODULE}:app", "nightly", env=env)
        assert unknown.code == 3
        assert "has no schedule 'nightly' (known: every-second)" in unknown.stderr
    finally:
        worker.stop()
        await asyncio.wait_for(run, 30)
    assert set(ticking.ran().values()) == {1}


async def _skipped_more(book: Any, before: int, more: int) -> bool:
    record = (await book.read(["every-second"]))["every-second"]
    return bool(record.skipped >= before + more)

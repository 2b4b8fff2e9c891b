"""The schedule drill (issue 30): three ``weclaw-mq scheduler`` replicas on a 1-second schedule
for three minutes, the leader killed with ``kill -9`` twice (a new replica started in its
place each time): every tick runs at most once, every tick from the first fired to the last
recorded is either fired or counted as skipped (missed while the dead leader's lease lapsed,
``missed="skip"``), and nothing else. Marked slow: ``make drill`` runs it, ``make test`` does not.

``WECLAW_SCHEDULE_DRILL_S`` shortens or lengthens the run (default 180 s).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from datetime import datetime

import pytest

from tests.conftest import outcome_count, wait_until
from tests.drills.conftest import DrillReport
from tests.integration.processes import WorkerProcess
from tests.integration.scheduler_processes import LEADS, LEASE_S, Ticking
from tests.integration.scheduler_processes import ticking as ticking  # the fixture
from weclaw_mq.policy.schedules import to_ms
from weclaw_mq.state.schedule_book import book_of

pytestmark = [pytest.mark.drill, pytest.mark.slow]

RUN_S = float(os.environ.get("WECLAW_SCHEDULE_DRILL_S", "180"))
REPLICAS = 3
KILLS = 2
LEAD_LINE = re.compile(r"\(replica (\w+)\) " + re.escape(LEADS))


def _leader(processes: list[WorkerProcess], token: str | None) -> WorkerProcess | None:
    """The live process whose log says it leads as replica ``token``'s first 8 characters."""
    if token is None:
        return None
    for process in processes:
        if process.popen.poll() is None and token[:8] in LEAD_LINE.findall(process.log()):
            return process
    return None


@pytest.mark.timeout(RUN_S + 120)
async def test_three_replicas_fire_each_tick_once_while_the_leader_is_killed_twice(
    ticking: Ticking, drill_report: DrillReport
) -> None:
    book = book_of(ticking.app.store, ticking.app.name)
    replicas = [ticking.spawn() for _ in range(REPLICAS)]
    started = time.monotonic()
    await wait_until(book.leader, 30, "a replica leading")
    kill_at = [started + RUN_S * (i + 1) / (KILLS + 1) for i in range(KILLS)]
    killed = 0
    while time.monotonic() < started + RUN_S:
        if killed < KILLS and time.monotonic() >= kill_at[killed]:
            leader = _leader(replicas, await book.leader())
            assert leader is not None, "no live replica says it leads"
            leader.kill()  # kill -9: its lease lapses by itself
            replicas.append(ticking.spawn())  # three replicas again
            killed += 1
        await asyncio.sleep(1.0)  # the drill's pace between checks, not a synchronisation
    alive = [process for process in replicas if process.popen.poll() is None]
    for process in alive:
        process.signal(signal.SIGTERM)
    for process in alive:
        assert await process.wait_exit(30) == 0, process.describe()
    seconds = time.monotonic() - started

    ran = ticking.ran()
    record = (await book.read(["every-second"]))["every-second"]
    first = min(ran)
    assert record.last_tick_ms is not None
    span = (record.last_tick_ms - to_ms(datetime.fromisoformat(first))) // 1000 + 1
    twice = sum(1 for n in ran.values() if n > 1)
    drill_report.add(
        "schedule: 3 replicas, leader kill -9 x2",
        published=record.fired,
        confirmed=record.fired,
        processed=len(ran),
        lost=span - record.fired - record.skipped,
        duplicated=twice,
        seconds=seconds,
        queue="schedule every 1 s",
        notes=f"{record.skipped} ticks skipped while a lease lapsed; "
        f"{outcome_count(ticking.app, ticking.queue, 'duplicate'):.0f} copies acked unrun",
    )
    assert killed == KILLS
    assert twice == 0, ran  # no tick ran twice
    assert len(ran) == record.fired  # every fired tick ran
    assert record.fired + record.skipped == span, record  # none unaccounted
    # Each kill costs at most the lease and a standby's round, plus the restart's slack.
    assert record.skipped <= KILLS * (LEASE_S + LEASE_S / 3 + 3), record

"""Worker processes killed with SIGKILL or stopped with SIGTERM lose no task.

Every worker here is a real ``weclaw-mq worker`` process on the real broker; the handler
records its starts and finishes in a file, so the counts survive the process.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from tests.broker_ctl import abroker_ctl
from tests.conftest import wait_until
from tests.integration.processes import (
    OpenFleet,
    WorkerFleet,
    ready_count,
    ready_count_is,
    take_one,
)
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name

DELIVERY_LIMIT = 2
CRASH = "crash-the-worker"
GUARD_LEASE_S = 1.5


@pytest.fixture
async def fleet(open_fleet: OpenFleet) -> AsyncIterator[WorkerFleet]:
    async with open_fleet(
        delivery_limit=DELIVERY_LIMIT,
        max_retries=1,
        retry_delay_s=0.1,
        shutdown_grace_s=10,
        # A killed worker's claims must lapse soon for its tasks to run again here, yet
        # outlast the broker's hand-over of a task to another running worker (milliseconds),
        # as the 30 s default does in production.
        guard_lease_s=GUARD_LEASE_S,
    ) as fleet:
        yield fleet


async def test_task_in_a_killed_worker_is_redelivered_and_finished_by_the_next(
    fleet: WorkerFleet, broker_url: str
) -> None:
    first = await fleet.start_consuming(concurrency=2, sleep_s=2.0)
    task_ids = {await fleet.app.publish(fleet.queue, {"text": f"job {i}"}) for i in range(2)}
    await wait_until(
        lambda: fleet.task_ids("started") == task_ids, 10, "both tasks to start in the first worker"
    )

    first.kill()

    assert first.popen.returncode == -signal.SIGKILL
    assert fleet.task_ids("finished") == set(), "the killed worker finished nothing"
    second = await fleet.start_consuming(concurrency=2, sleep_s=0.1)
    await wait_until(
        lambda: fleet.task_ids("finished") == task_ids, 15, "every task to finish after the kill"
    )
    finished = fleet.events("finished")
    assert {e.pid for e in finished} == {second.pid}
    # A clean stop settles everything it holds: the queue is then empty, not just quiet.
    second.signal(signal.SIGTERM)
    assert await second.wait_exit() == 0, second.describe()
    assert await ready_count(broker_url, fleet.queue) == 0


async def test_task_that_kills_every_worker_ends_in_the_dlq_after_the_delivery_limit(
    fleet: WorkerFleet, broker_url: str
) -> None:
    # Two workers, as in production: when one dies, the broker hands its task to the other at
    # once, while the dead worker's guard lease still holds; a restart alone could be slower
    # than the lease and would test a luckier path.
    workers = [fleet.start(crash_on=CRASH) for _ in range(2)]
    await asyncio.gather(*(w.wait_consuming() for w in workers))
    poison = await fleet.app.publish(fleet.queue, {"text": CRASH})
    dlq = dlq_name(fleet.queue)
    deaths = 0

    async def dead_lettered_or_restarted() -> bool:
        nonlocal deaths
        if await ready_count(broker_url, dlq) > 0:
            return True
        for i, worker in enumerate(workers):
            if worker.popen.poll() is not None:
                assert worker.popen.returncode == -signal.SIGKILL, worker.describe()
                deaths += 1
                assert deaths <= DELIVERY_LIMIT + 2, (
                    f"the poison task killed {deaths} workers and never reached {dlq}"
                )
                workers[i] = fleet.start(crash_on=CRASH)
        return False

    await wait_until(dead_lettered_or_restarted, 30, f"the poison task to reach {dlq}")

    dead = await take_one(broker_url, dlq)
    assert dead is not None
    assert dead.message_id == poison
    assert "delivery_limit" in death_reasons(dead.headers or {}), dead.headers
    # Dead-lettered on the return that pushes the count past the limit, not later.
    assert len(fleet.events("started")) <= DELIVERY_LIMIT + 1
    assert fleet.events("finished") == []
    # The queue works again: a live worker handles the next task.
    workers = [w if w.popen.poll() is None else fleet.start(crash_on=CRASH) for w in workers]
    await asyncio.gather(*(w.wait_consuming() for w in workers))
    normal = await fleet.app.publish(fleet.queue, {"text": "fine"})
    await wait_until(lambda: normal in fleet.task_ids("finished"), 10, "the next task to finish")
    assert all(w.popen.poll() is None for w in workers)


def death_reasons(headers: Mapping[str, Any]) -> set[str]:
    """Every dead-letter reason a message carries: RabbitMQ's own headers and ours."""
    found = [headers.get(h.X_FIRST_DEATH_REASON), headers.get(h.DEAD_LETTER_REASON)]
    for death in headers.get(h.X_DEATH) or []:
        found.append(death.get("reason"))
    return {r.decode() if isinstance(r, bytes) else str(r) for r in found if r is not None}


async def test_sigterm_lets_in_flight_tasks_finish_and_ack_before_exit_zero(
    fleet: WorkerFleet, broker_url: str
) -> None:
    worker = await fleet.start_consuming(concurrency=3, sleep_s=1.5)
    task_ids = {await fleet.app.publish(fleet.queue, {"text": f"job {i}"}) for i in range(3)}
    await wait_until(lambda: fleet.task_ids("started") == task_ids, 10, "all three tasks to start")

    worker.signal(signal.SIGTERM)

    assert await worker.wait_exit(15) == 0, worker.describe()
    assert fleet.task_ids("finished") == task_ids
    assert len(fleet.events("finished")) == 3
    assert await ready_count(broker_url, fleet.queue) == 0, "every task was acked before exit"


async def test_task_not_started_at_sigterm_stays_queued_for_the_next_worker(
    fleet: WorkerFleet, broker_url: str
) -> None:
    worker = await fleet.start_consuming(concurrency=1, sleep_s=1.5)
    first = await fleet.app.publish(fleet.queue, {"text": "first"})
    second = await fleet.app.publish(fleet.queue, {"text": "second"})
    await wait_until(lambda: fleet.task_ids("started") == {first}, 10, "the first task to start")

    worker.signal(signal.SIGTERM)

    assert await worker.wait_exit(15) == 0, worker.describe()
    assert fleet.task_ids("finished") == {first}
    assert second not in fleet.task_ids("started")
    # Held as the NORMAL lane's look-ahead, it was given back at the stop; the queue applies
    # a return asynchronously, so it shows as ready a moment later.
    try:
        await wait_until(
            lambda: ready_count_is(broker_url, fleet.queue, 1), 30, "the second task in the queue"
        )
    except AssertionError as e:  # where it is instead: the broker's counts and the worker's log
        counts = await abroker_ctl(
            "list_queues", "name", "messages_ready", "messages_unacknowledged", "consumers"
        )
        mine = [line for line in counts.splitlines() if fleet.queue in line]
        raise AssertionError(f"{e}; broker: {mine}; {worker.describe()}") from e
    await fleet.start_consuming(concurrency=1, sleep_s=0.0)
    await wait_until(
        lambda: fleet.task_ids("finished") == {first, second}, 10, "the next worker to finish it"
    )

"""kill -9 of a worker holding tasks of every priority lane (running and waiting): none lost."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.conftest import wait_until
from tests.integration.processes import ready_count, worker_fleet
from weclaw_mq import Priority
from weclaw_mq.contract.naming import lane_queue_name

PER_LEVEL = 3


async def test_a_killed_worker_holding_tasks_of_every_lane_loses_none(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> None:
    async with worker_fleet(
        queue=qname,
        work_dir=tmp_path,
        broker_url=broker_url,
        redis_url=redis_url,
        # The killed worker's claims lapse soon, so its running tasks run again here.
        guard_lease_s=1.0,
        retry_delay_s=0.1,
    ) as fleet:
        first = await fleet.start_consuming(concurrency=2, sleep_s=60.0)
        task_ids: set[str] = set()
        for level in (Priority.NORMAL, Priority.HIGH, Priority.URGENT):
            task_ids |= {
                await fleet.app.publish(qname, {"text": f"{level.value} {i}"}, priority=level)
                for i in range(PER_LEVEL)
            }
        lanes = [qname, lane_queue_name(qname, "high"), lane_queue_name(qname, "urgent")]

        async def holds_some_of_every_lane() -> bool:
            return all([await ready_count(broker_url, lane) < PER_LEVEL for lane in lanes])

        # Two running (the URGENT ones) and one waiting in each lane: concurrency + lanes.
        await wait_until(holds_some_of_every_lane, 10, "the worker to hold tasks of every lane")
        await wait_until(lambda: len(fleet.task_ids("started")) == 2, 10, "two tasks to start")

        first.kill()

        assert first.popen.returncode == -signal.SIGKILL
        assert fleet.task_ids("finished") == set()
        await fleet.start_consuming(concurrency=4, sleep_s=0.0)
        await wait_until(lambda: fleet.task_ids("finished") == task_ids, 20, "every task to finish")

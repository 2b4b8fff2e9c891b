"""SIGTERM ends a worker process within ``shutdown_grace_s`` plus a few seconds, whatever its
handlers do, and leaves every unfinished task to the broker.

Real ``weclaw-mq worker`` processes on the real broker (see ``processes.py``)."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator

import pytest

from tests.conftest import wait_until
from tests.integration.processes import OpenFleet, WorkerFleet, ready_count_is
from weclaw_mq.cli.run_worker import FORCED_EXIT_CODE, HARD_EXIT_MARGIN_S

GRACE_S = 0.5


@pytest.fixture
async def fleet(open_fleet: OpenFleet) -> AsyncIterator[WorkerFleet]:
    async with open_fleet(
        shutdown_grace_s=GRACE_S,
        # The handler's own timeout is far away: only the stop bounds it here.
        handler_timeout_s=600,
        # A stopped worker's claim must lapse soon for the next worker to run the task.
        guard_lease_s=1.5,
    ) as fleet:
        yield fleet


@pytest.mark.parametrize("mode", ["ignore_cancel", "block"])
async def test_sigterm_exits_in_bounded_time_and_leaves_the_unfinished_task_queued(
    fleet: WorkerFleet, broker_url: str, mode: str
) -> None:
    # "ignore_cancel" swallows every cancellation; "block" holds the event loop in a
    # synchronous call, so no coroutine of the worker runs until it returns.
    worker = await fleet.start_consuming(sleep_s=300, mode=mode)
    task_id = await fleet.app.publish(fleet.queue, {"text": "never finishes"})
    await wait_until(lambda: fleet.task_ids("started") == {task_id}, 10, "the task to start")

    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    bound_s = GRACE_S + HARD_EXIT_MARGIN_S + 5  # the margin, plus a slow shared machine
    code = await worker.wait_exit(bound_s)

    took_s = time.monotonic() - started
    assert code == FORCED_EXIT_CODE, worker.describe()
    assert took_s < bound_s, f"exited {took_s:.1f} s after SIGTERM"
    assert fleet.task_ids("finished") == set()
    # Nothing lost: the broker holds the task again for the next worker.
    await wait_until(
        lambda: ready_count_is(broker_url, fleet.queue, 1), 10, "the task to be back in its queue"
    )

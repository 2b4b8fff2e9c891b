"""A long run outlives the broker's consumer timeout (``long_running=True``).

On the drills' private node, ``consumer_timeout`` is lowered (10 s here, 20 s in the slow run)
and two worker processes each get one task that runs far longer: the same handler registered
with ``long_running=True`` and without (the control). Asserted: the long run finishes in one
run, its worker's session never lost; the control's delivery is timed out by the broker (its
channel closed, the worker's session lost), which shows the timeout was in force. RabbitMQ
3.10 checks the timeout once a minute, so a run must last well over a minute past it to be
sure to meet it. The 4-hour run of issue 40 is ``RUN_S=14400`` by hand (``make drill``)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.conftest import delete_queues, forget_task_keys, wait_until
from tests.drills.conftest import RabbitNode, drill_settings
from tests.integration.fixture_apps.long_app import LongJob, build_app
from tests.integration.fixture_apps.steps_app import read_calls
from tests.integration.processes import queue_names, spawn_cli_worker
from weclaw_mq import TaskStatus

STEP_S = 2.0
DEFAULT_CONSUMER_TIMEOUT_MS = 1_800_000
# What a worker logs when the broker closed its channel (the timeout's close).
LOST = "broker connection lost"


async def _outlives(
    node: RabbitNode, redis_url: str, tmp_path: Path, *, run_s: float, timeout_ms: int
) -> None:
    await node.ctl("eval", f"application:set_env(rabbit, consumer_timeout, {timeout_ms}).")
    settings = drill_settings(node.url, redis_url, long_run_watch_s=4, guard_heartbeat_ttl_s=1)
    job = LongJob(steps=int(run_s / STEP_S), step_s=STEP_S)
    apps, workers = [], []
    try:
        for long_running in (True, False):
            queue = f"drill-long-{'on' if long_running else 'off'}-{uuid.uuid4().hex[:8]}"
            record_dir = tmp_path / queue
            record_dir.mkdir()
            app = build_app(
                queue, settings=settings, record_dir=record_dir, long_running=long_running
            )
            await app.declare()
            apps.append((app, queue, record_dir))
            worker = spawn_cli_worker(
                "tests.integration.fixture_apps.long_app:app",
                settings=settings,
                app_env={
                    "TEST_QUEUE": queue,
                    "TEST_RECORD_DIR": str(record_dir),
                    "TEST_LONG_RUNNING": "1" if long_running else "0",
                },
                log_path=tmp_path / f"{queue}.log",
            )
            workers.append(worker)
            await worker.wait_consuming(60)
        (long_app, long_queue, long_dir), (_, _, control_dir) = apps
        long_worker, control = workers
        task_id = await long_app.publish(long_queue, job)
        await apps[1][0].publish(apps[1][1], job)

        final = await long_app.result(task_id, timeout_s=run_s + 120)
        assert final.status is TaskStatus.SUCCEEDED, (final, long_worker.describe())
        starts = [c for c in read_calls(long_dir) if c.startswith("start ")]
        assert len(starts) == 1, (starts, long_worker.describe())
        assert LOST not in long_worker.log(), long_worker.describe()
        # The control held its delivery past the timeout: the broker closed its channel.
        await wait_until(lambda: LOST in control.log(), 120, "the control's channel closed")
        control_starts = [c for c in read_calls(control_dir) if c.startswith("start ")]
        print(
            f"long run of {run_s:.0f} s against consumer_timeout {timeout_ms / 1000:.0f} s: "
            f"1 run, succeeded; the control's delivery timed out "
            f"({len(control_starts)} run(s) began)"
        )
    finally:
        for worker in workers:
            worker.kill()
        await node.ctl(
            "eval", f"application:set_env(rabbit, consumer_timeout, {DEFAULT_CONSUMER_TIMEOUT_MS})."
        )
        for app, queue, _ in apps:
            await app.close()
            await delete_queues(node.url, queue_names(app))
            await forget_task_keys(redis_url, [queue])


@pytest.mark.timeout(400)
async def test_a_long_run_outlives_a_10_s_consumer_timeout(
    node: RabbitNode, drill_redis_url: str, tmp_path: Path
) -> None:
    await _outlives(node, drill_redis_url, tmp_path, run_s=100, timeout_ms=10_000)


@pytest.mark.slow
@pytest.mark.timeout(int(os.environ.get("RUN_S", "300")) + 600)
async def test_a_long_run_of_5_minutes_outlives_a_20_s_consumer_timeout(
    node: RabbitNode, drill_redis_url: str, tmp_path: Path
) -> None:
    run_s = float(os.environ.get("RUN_S", "300"))
    await _outlives(node, drill_redis_url, tmp_path, run_s=run_s, timeout_ms=20_000)

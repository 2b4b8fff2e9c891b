"""Drill: 500 tasks wait in their queue while the broker goes down and comes back.

Two ways down, on the private node: the RabbitMQ application stopped and started
(``rabbitmqctl stop_app`` / ``start_app``), and the whole VM killed with SIGKILL and started
again. The tasks are persistent messages in a durable quorum queue, confirmed only once on
disk, so a worker started after the restart must run all 500 of them, each once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.conftest import settings_for, wait_until
from tests.drills import drill_app
from tests.drills.conftest import DrillRun, RabbitNode, drill_settings
from tests.integration.processes import ready_count, ready_count_is
from weclaw_mq import BrokerUnavailableError, Settings
from weclaw_mq.publishing.connection import BrokerEndpoints

TASKS = 500
CONCURRENCY = 20


async def _assert_broker_down(settings_url: str, redis_url: str) -> None:
    endpoints = BrokerEndpoints(settings_for(settings_url, redis_url))
    with pytest.raises(BrokerUnavailableError):
        conn = await endpoints.connect(name="drill-probe")
        await conn.close()


@pytest.mark.drill
@pytest.mark.parametrize(
    "how",
    [
        pytest.param("stop_app/start_app", id="stop_app-start_app"),
        pytest.param("kill -9 and restart", id="kill9-restart"),
    ],
)
async def test_tasks_queued_before_a_broker_restart_all_run_after_it(
    how: str,
    node: RabbitNode,
    drill_redis_url: str,
    new_drill_run: Callable[[str, Settings], DrillRun],
) -> None:
    run = new_drill_run("restart", drill_settings(node.url, drill_redis_url))
    ids = run.task_ids(TASKS)
    try:
        await run.app.declare()
        # publish_jobs raises unless every publish was confirmed.
        await drill_app.publish_jobs(run.app, run.queue, ids)
        await run.app.close()
        depth_before = await ready_count(node.url, run.queue)
        assert depth_before == TASKS

        down_at = time.perf_counter()
        if how == "stop_app/start_app":
            await node.stop_app()
            await _assert_broker_down(node.url, drill_redis_url)
            await node.start_app()
        else:
            await node.kill9()
            await _assert_broker_down(node.url, drill_redis_url)
            await node.start()
        down_s = time.perf_counter() - down_at
        # Right after a restart a quorum queue reports only what it has replayed of its log
        # so far (0 or 388 of 500 measured after kill -9): wait for the full count.
        await wait_until(
            lambda: ready_count_is(node.url, run.queue, TASKS),
            30,
            f"the queue to hold {TASKS} again",
        )
        depth_after = TASKS

        await run.start_worker(concurrency=CONCURRENCY)
        exit_code, stuck = await run.finish(node.url, TASKS, drain_within_s=20)

        row = run.report(
            f"broker restart ({how})",
            published=TASKS,
            confirmed=set(ids),
            notes=f"queue depth {depth_before} before, {depth_after} after; down {down_s:.1f} s",
        )
        assert set(run.ran()) <= set(ids), "the worker ran tasks nobody published"
        run.assert_clean(row, exit_code, stuck)
    finally:
        await run.clean_up(node)

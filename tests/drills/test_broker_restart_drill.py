"""Drill: 500 tasks wait in their queue while the broker goes down and comes back.

Two ways down, on the private node: the RabbitMQ application stopped and started
(``rabbitmqctl stop_app`` / ``start_app``), and the whole VM killed with SIGKILL and started
again. The tasks are persistent messages in a durable quorum queue, confirmed only once on
disk, so a worker started after the restart must run all 500 of them, each once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import delete_queues, settings_for, wait_until
from tests.drills import drill_app
from tests.drills.conftest import DrillReport, RabbitNode
from tests.integration.processes import WorkerProcess, queue_names, ready_count
from weclaw_mq import BrokerUnavailableError
from weclaw_mq.connection import BrokerEndpoints

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
    tmp_path: Path,
    drill_report: DrillReport,
    forget_tasks: Callable[[str, list[str]], None],
) -> None:
    started = time.perf_counter()
    queue = f"drill-restart-{uuid.uuid4().hex[:8]}"
    effects = tmp_path / "effects.log"
    settings = settings_for(
        node.url,
        drill_redis_url,
        result_ttl_s=600,
        done_ttl_s=600,
        shutdown_grace_s=drill_app.GRACE_S,
        guard_lease_s=2,
        retry_delay_s=0.2,
        reconnect_max_delay_s=1,
    )
    app = drill_app.build_app(queue, settings=settings, effects=effects)
    ids = [str(uuid.uuid4()) for _ in range(TASKS)]
    forget_tasks(queue, ids)
    worker: WorkerProcess | None = None
    try:
        await app.declare()
        # publish_jobs raises unless every publish was confirmed.
        await drill_app.publish_jobs(app, queue, ids)
        await app.close()
        depth_before = await ready_count(node.url, queue)
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
            lambda: _depth_is(node.url, queue, TASKS), 30, f"the queue to hold {TASKS} again"
        )
        depth_after = TASKS

        worker = drill_app.spawn_worker(
            queue=queue,
            settings=settings,
            effects=effects,
            log_path=tmp_path / "worker.log",
            concurrency=CONCURRENCY,
        )
        await worker.wait_consuming()
        await wait_until(
            lambda: len(drill_app.read_effects(effects)) >= TASKS, 60, f"{TASKS} tasks to run"
        )
        await wait_until(
            lambda: _queue_empty(node.url, queue), 20, "the queue to drain (acks to arrive)"
        )
        exit_code, stuck = await drill_app.stop_worker(worker)

        ran = drill_app.read_effects(effects)
        row = drill_report.add_counts(
            f"broker restart ({how})",
            published=TASKS,
            confirmed=set(ids),
            effects=ran,
            seconds=time.perf_counter() - started,
            notes=f"queue depth {depth_before} before, {depth_after} after; down {down_s:.1f} s",
        )
        assert set(ran) <= set(ids), "the worker ran tasks nobody published"
        assert row.lost == 0, f"{row.lost} task(s) lost"
        assert row.duplicated == 0, f"{row.duplicated} duplicate run(s)"
        assert exit_code == 0, worker.describe()
        assert stuck == 0, drill_app.stuck_at_stop(stuck)
    finally:
        if worker is not None:
            worker.kill()
        await app.close()
        await node.restore()
        await delete_queues(node.url, queue_names(app))


async def _queue_empty(url: str, queue: str) -> bool:
    return await ready_count(url, queue) == 0


async def _depth_is(url: str, queue: str, expected: int) -> bool:
    return await ready_count(url, queue) == expected

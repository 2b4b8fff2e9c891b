"""``weclaw-mq inspect`` against the real broker and Redis: what each live worker runs now.

Workers run in this process (``start_worker``) or as ``weclaw-mq worker`` processes
(``open_fleet``); ``inspect`` runs as the installed script, on the fixture app whose queue
the test names, so it lists the workers of that queue only (Redis is shared). The registry is
also read directly (``WorkerRegistry``) to wait for a beat without sleeping.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import settings_for, wait_until
from tests.integration.fixture_apps.guard_app import APP_PATH as GUARD_APP
from tests.integration.processes import (
    FIXTURE_APP,
    OpenFleet,
    one_error_line,
    run_cli,
    settings_env,
)
from weclaw_mq import App, Worker
from weclaw_mq.state.redis_clients import open_client
from weclaw_mq.state.worker_registry import WorkerRecord, WorkerRegistry, registry_of

# Short beats: a test waits a fraction of a second for the record to follow the worker.
BEAT_S = 0.1


@dataclass
class Inspecting:
    """One test's apps and workers, the registry as ``inspect`` reads it (a client of its own,
    no store), and the CLI's environment."""

    make_app: Callable[..., App]
    start_worker: Callable[..., Any]
    registry: WorkerRegistry
    broker_url: str
    redis_url: str
    record_dir: Path

    def env(self, queue: str, **overrides: Any) -> dict[str, str]:
        """The environment of ``weclaw-mq inspect`` on the fixture app of ``queue``."""
        settings = settings_for(self.broker_url, self.redis_url, **overrides)
        return {
            **settings_env(settings),
            "TEST_QUEUE": queue,
            "TEST_RECORD_DIR": str(self.record_dir),
        }

    async def record(self, worker_id: str) -> WorkerRecord | None:
        return next((r for r in await self.registry.read() if r.worker_id == worker_id), None)

    async def until(
        self, worker_id: str, holds: Callable[[WorkerRecord], bool], what: str
    ) -> WorkerRecord:
        """The record of ``worker_id`` once a beat makes ``holds`` true of it."""
        seen: list[WorkerRecord] = []

        async def beaten() -> bool:
            record = await self.record(worker_id)
            if record is not None and holds(record):
                seen.append(record)
            return bool(seen)

        await wait_until(beaten, what=what)
        return seen[0]


@pytest.fixture
async def inspecting(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    broker_url: str,
    redis_url: str,
    tmp_path: Path,
) -> AsyncIterator[Inspecting]:
    client = open_client(settings_for(broker_url, redis_url))
    try:
        yield Inspecting(
            make_app, start_worker, WorkerRegistry(client), broker_url, redis_url, tmp_path
        )
    finally:
        await client.aclose()


async def inspect_json(env: dict[str, str]) -> dict[str, Any]:
    result = await run_cli("inspect", FIXTURE_APP, "--json", env=env)
    assert result.code == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def gated(app: App, queue: str) -> tuple[asyncio.Event, asyncio.Event]:
    """A handler on ``queue`` that runs until released: (started, release)."""
    started, release = asyncio.Event(), asyncio.Event()

    @app.handler(queue)
    async def hold(task: dict[str, int]) -> None:
        started.set()
        await release.wait()

    return started, release


async def test_inspect_lists_a_running_task_while_it_runs_and_not_after(
    inspecting: Inspecting, qname: str
) -> None:
    app = inspecting.make_app("inspect-running", worker_beat_s=BEAT_S)
    started, release = gated(app, qname)
    worker: Worker = await inspecting.start_worker(app, concurrency=3)
    task_id = await app.publish(qname, {"n": 1})
    await wait_until(started.is_set, what="the handler to start")
    await inspecting.until(
        worker.worker_id,
        lambda r: [t.running_s is not None for t in r.tasks] == [True],
        "a beat that lists the running task",
    )
    env = inspecting.env(qname)
    shown = await inspect_json(env)

    assert shown["app"] == "fixture" and shown["queues"] == [qname]
    assert shown["unserved_queues"] == []
    (me,) = shown["workers"]  # Redis is shared: only the workers of this test's queue
    assert me["worker_id"] == worker.worker_id
    assert (me["host"], me["pid"], me["app"]) == (socket.gethostname(), os.getpid(), app.name)
    assert (me["queues"], me["concurrency"], me["state"]) == ([qname], 3, "consuming")
    assert (me["in_flight"], me["more"]) == (1, 0)
    assert 0 <= me["last_beat_s"] < 5 and me["uptime_s"] > 0
    assert me["beat_s"] == BEAT_S and me["ttl_s"] == pytest.approx(3 * BEAT_S)
    assert me["started_at"].startswith(("19", "20"))  # an ISO time
    (task,) = me["tasks"]
    assert (task["task_id"], task["queue"], task["attempt"]) == (task_id, qname, 1)
    assert 0 <= task["running_s"] < 60

    table = await run_cli("inspect", FIXTURE_APP, env=env)
    assert table.code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == "1 live worker(s) of app 'fixture':"
    assert any(line.startswith(worker.worker_id) and qname in line for line in lines), lines
    assert (
        f"worker {worker.worker_id} ({socket.gethostname()} pid {os.getpid()}): runs 1 task(s)"
        in lines
    )
    row = next(line for line in lines if line.strip().startswith(task_id))
    assert row.split()[1:3] == [qname, "1"], row

    release.set()
    await wait_until(lambda: worker.in_flight == 0, what="the task to end")

    await inspecting.until(worker.worker_id, lambda r: r.in_flight == 0, "a beat after it ended")
    (me,) = (await inspect_json(env))["workers"]
    assert (me["in_flight"], me["tasks"], me["more"]) == (0, [], 0)
    table = await run_cli("inspect", FIXTURE_APP, env=env)
    assert task_id not in table.stdout and "): runs no task" in table.stdout


async def test_a_worker_stopped_gracefully_disappears_at_once(
    inspecting: Inspecting, qname: str
) -> None:
    # A long beat: only the stop's delete can make the record go within the test.
    app = inspecting.make_app("inspect-stop", worker_beat_s=60)
    gated(app, qname)
    worker = Worker(app)
    running = asyncio.create_task(worker.run())
    try:
        await inspecting.until(worker.worker_id, lambda r: True, "the worker's first beat")
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)

    assert await inspecting.record(worker.worker_id) is None


async def test_a_worker_killed_without_stopping_disappears_after_its_ttl(
    inspecting: Inspecting, open_fleet: OpenFleet, qname: str
) -> None:
    beat_s = 1.0
    async with open_fleet(worker_beat_s=beat_s) as fleet:
        process = await fleet.start_consuming()

        async def listed() -> WorkerRecord | None:
            mine = (r for r in await inspecting.registry.read() if qname in r.queues)
            return next((r for r in mine if r.pid == process.pid), None)

        await wait_until(listed, what="the worker process's beat")
        process.kill()
        # SIGKILL deletes nothing: the record is still there, until its TTL (3 beats) ends.
        record = await listed()
        assert record is not None and record.queues == (qname,), record
        loop = asyncio.get_running_loop()
        killed_at = loop.time()
        await wait_until(
            lambda: _absent(listed),
            timeout_s=3 * beat_s + 10,
            what="the killed worker's record to lapse",
        )
        assert loop.time() - killed_at <= 3 * beat_s + 2.0  # its TTL, not the wait's bound

        shown = await inspect_json(inspecting.env(qname))
        assert shown["workers"] == [] and shown["unserved_queues"] == [qname]
        table = await run_cli("inspect", FIXTURE_APP, env=inspecting.env(qname))
        assert table.stdout.strip() == (
            f"no live worker consumes the queues of app 'fixture' ({qname})"
        )


async def _absent(listed: Callable[[], Any]) -> bool:
    return await listed() is None


async def test_a_record_lists_at_most_the_concurrency_and_counts_the_rest(
    inspecting: Inspecting, qname: str
) -> None:
    # Concurrency 1 over two queues: two tasks in flight, one listed.
    app = inspecting.make_app("inspect-bounded", worker_beat_s=BEAT_S)
    first, second = f"{qname}-a", f"{qname}-b"
    started_a, release_a = gated(app, first)
    started_b, release_b = gated(app, second)
    worker: Worker = await inspecting.start_worker(app, concurrency=1)
    task_a = await app.publish(first, {"n": 1})
    await wait_until(started_a.is_set, what="the first handler to start")
    await app.publish(second, {"n": 2})
    await wait_until(started_b.is_set, what="the second handler to start")

    record = await inspecting.until(worker.worker_id, lambda r: r.in_flight == 2, "both tasks")
    assert (len(record.tasks), record.more) == (1, 1)
    assert record.tasks[0].task_id == task_a  # the longest-running first

    table = await run_cli("inspect", FIXTURE_APP, env=inspecting.env(first))
    assert table.code == 0, table.stderr
    assert "  ... and 1 more (a record lists at most 1)" in table.stdout.splitlines()
    release_a.set()
    release_b.set()


async def test_without_redis_no_record_is_written_and_inspect_says_why_in_one_line(
    inspecting: Inspecting, qname: str
) -> None:
    app = inspecting.make_app("inspect-off", results_enabled=False, worker_beat_s=BEAT_S)
    done = asyncio.Event()

    @app.handler(qname, idempotent=False)
    async def work(task: dict[str, int]) -> None:
        done.set()

    assert app.store is None and registry_of(app.store) is None  # no Redis at all
    await inspecting.start_worker(app)
    await app.publish(qname, {"n": 1})
    await wait_until(done.is_set, what="the task to run")
    # A worker's first beat leaves before it connects: one of this worker would be there.
    assert not [r for r in await inspecting.registry.read() if qname in r.queues]

    # The guard app's handler claims nothing with GUARD_APP_IDEMPOTENT=0.
    env = {
        **settings_env(
            settings_for(inspecting.broker_url, inspecting.redis_url, results_enabled=False)
        ),
        "GUARD_APP_QUEUE": qname,
        "GUARD_APP_RECORD_KEY": f"{qname}:unused",
        "GUARD_APP_IDEMPOTENT": "0",
    }
    for args in (["inspect", GUARD_APP], ["inspect", GUARD_APP, "--json"]):
        result = await run_cli(*args, env=env)
        line = one_error_line(result)
        assert result.code == 1 and result.stdout == ""
        assert "results are off (WECLAW_MQ_RESULTS_ENABLED=false)" in line, line
        assert "keep no record" in line, line


async def test_inspect_of_an_app_that_cannot_be_loaded_is_one_line(
    broker_url: str, redis_url: str
) -> None:
    env = settings_env(settings_for(broker_url, redis_url))
    result = await run_cli("inspect", "no_such_module_xyz:app", env=env)

    line = one_error_line(result)
    assert result.code == 3 and "no_such_module_xyz" in line, line


async def test_a_worker_whose_app_closes_redis_during_its_stop_ends_its_run_normally(
    make_app: Callable[..., App],
    qname: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The record's delete fails as a closing pipe fails it (its waiter's future cancelled,
    not the worker's task): the run still ends without raising (a test that closed its app
    under a stopping worker saw CancelledError end the run)."""
    app = make_app("inspect-closed-under-stop")
    gated(app, qname)
    worker = Worker(app)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 20)

    async def leave_on_a_closed_pipe(self: WorkerRegistry, worker_id: str) -> None:
        dropped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        dropped.cancel()  # what StatePipe.close does to every caller still waiting
        await dropped

    monkeypatch.setattr(WorkerRegistry, "leave", leave_on_a_closed_pipe)
    worker.stop()
    await asyncio.wait_for(running, 30)
    assert running.done() and not running.cancelled() and running.exception() is None


@pytest.mark.on_private_redis
class TestAWorkerGoneAfterAKill9:
    """A Redis of this test's own: a running record is judged only once it is older than
    the longest beat of the live workers in its Redis, and on the shared one another
    test's worker beats every 60 s (a clean-clone CI read ``worker_gone`` False)."""

    async def test_status_says_a_running_task_is_on_a_worker_that_is_gone_after_a_kill_9(
        self, inspecting: Inspecting, open_fleet: OpenFleet, qname: str
    ) -> None:
        from datetime import UTC, datetime

        from tests.integration.fixture_apps.worker_app import read_events

        beat_s = 0.2
        async with open_fleet(worker_beat_s=beat_s) as fleet:
            app = fleet.app
            process = await fleet.start_consuming(sleep_s=120)
            task_id = await app.publish(qname, {"text": "long"})
            await wait_until(
                lambda: any(e.task_id == task_id for e in read_events(fleet.record_dir)),
                20,
                "the task started",
            )
            # Older than the registry's records live: judged against the beats from here on.
            grace_s = beat_s * 4

            async def old_enough() -> bool:
                state = await app.status(task_id)
                assert state is not None
                return (datetime.now(UTC) - state.updated_at).total_seconds() > grace_s * 2

            await wait_until(old_enough, 20, "the running record older than the beats")
            alive = await app.status(task_id)
            assert alive is not None and alive.status.value == "running" and not alive.worker_gone

            process.kill()

            async def gone() -> bool:
                state = await app.status(task_id)
                return state is not None and state.worker_gone

            await wait_until(gone, 3 * beat_s + 20, "status to say the worker is gone")
            state = await app.status(task_id)
            assert state is not None and state.status.value == "running"  # the truth, not rewritten
            stored = await app.store.get(task_id)
            assert stored is not None and not stored.worker_gone
            shown = await run_cli(
                "status", task_id, env=inspecting.env(qname, worker_beat_s=beat_s)
            )
            assert shown.code == 0, shown.stderr
            document = json.loads(shown.stdout)
            assert (document["status"], document["worker_gone"]) == ("running", True)
            env = inspecting.env(qname, worker_beat_s=beat_s)
            listed = (await inspect_json(env))["on_gone_workers"]
            assert [(t["task_id"], t["queue"]) for t in listed] == [(task_id, qname)]
            table = await run_cli("inspect", FIXTURE_APP, env=env)
            assert "1 task(s) recorded running on a worker that is gone" in table.stdout
            assert task_id in table.stdout

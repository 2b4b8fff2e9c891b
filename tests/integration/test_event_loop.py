"""``weclaw-mq worker --loop uvloop``: a real worker on uvloop, and a clear line without it."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.conftest import wait_until
from tests.integration.processes import OpenFleet, one_error_line, run_cli
from weclaw_mq.worker import event_loop


async def test_a_worker_on_uvloop_runs_tasks_to_their_result(open_fleet: OpenFleet) -> None:
    async with open_fleet() as fleet:
        worker = fleet.start(concurrency=4, extra_args=["--loop", "uvloop"])
        await worker.wait_consuming()
        assert "event loop: uvloop" in worker.log()
        ids = await fleet.publish_jobs(8)
        await fleet.assert_all_succeed(ids)
        worker.signal(signal.SIGTERM)
        assert await worker.wait_exit(30) == 0, worker.describe()


async def test_the_setting_chooses_uvloop_for_the_supervisors_children_too(
    open_fleet: OpenFleet,
) -> None:
    async with open_fleet(event_loop="uvloop") as fleet:
        supervisor = fleet.start(extra_args=["--processes", "2"])
        await wait_until(
            lambda: (
                supervisor.log().count("event loop: uvloop") >= 2
                or supervisor.popen.poll() is not None
            ),
            30,
            "two children on uvloop",
        )
        assert supervisor.popen.poll() is None, supervisor.describe()
        supervisor.signal(signal.SIGTERM)
        assert await supervisor.wait_exit(30) == 0, supervisor.describe()


async def test_uvloop_asked_for_but_not_installed_is_one_line_and_exit_3(
    tmp_path: Path,
) -> None:
    # A module named uvloop that cannot be imported: what a machine without the extra has.
    (tmp_path / "uvloop.py").write_text("raise ImportError('No module named uvloop')\n")
    done = await run_cli(
        "worker",
        "tests.integration.fixture_apps.worker_app:app",
        "--loop",
        "uvloop",
        env={
            "PYTHONPATH": str(tmp_path),
            "TEST_QUEUE": "never-declared",
            "TEST_RECORD_DIR": str(tmp_path),
        },
    )
    line = one_error_line(done)
    assert done.code == 3, done
    assert "uvloop is not installed" in line and event_loop.HOW_TO_GET_UVLOOP in line, line


async def test_an_unknown_loop_is_a_usage_error() -> None:
    done = await run_cli("worker", "tests.integration.fixture_apps.worker_app:app", "--loop", "x")
    assert done.code == 2 and "Traceback" not in done.stderr, done
    assert "'x' is not one of asyncio, uvloop" in done.stderr

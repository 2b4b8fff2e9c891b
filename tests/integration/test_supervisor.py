"""``weclaw-mq worker --processes N``: real worker processes under the supervisor.

The supervisor forwards SIGTERM to every child (each drains), restarts a child that was killed
(its messages went back to the queue: nothing is lost), and gives up with the child's own
error when a child cannot start or keeps dying.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.conftest import delete_queues, settings_for, wait_until
from tests.integration.fixture_apps.worker_app import build_app
from tests.integration.processes import (
    CONSUMING_MARK,
    FIXTURE_APP,
    OpenFleet,
    WorkerFleet,
    WorkerProcess,
    all_empty,
    queue_names,
    run_cli,
)
from tests.private_servers import children_of, running
from weclaw_mq import TaskStatus
from weclaw_mq.cli.supervisor import Supervisor, SupervisorError, parse_processes, spawning


async def _start_supervised(fleet: WorkerFleet, processes: int, **kwargs: object) -> WorkerProcess:
    supervisor = fleet.start(extra_args=["--processes", str(processes)], **kwargs)  # type: ignore[arg-type]
    await wait_until(
        lambda: (
            supervisor.log().count(CONSUMING_MARK) >= processes
            or supervisor.popen.poll() is not None
        ),
        30,
        f"{processes} worker processes consuming",
    )
    assert supervisor.popen.poll() is None, supervisor.describe()
    return supervisor


async def test_sigterm_drains_every_child_and_the_supervisor_exits_0(
    open_fleet: OpenFleet, broker_url: str, qname: str
) -> None:
    async with open_fleet() as fleet:
        supervisor = await _start_supervised(fleet, 2, concurrency=2, sleep_s=1.5)
        ids = await fleet.publish_jobs(4)
        await wait_until(lambda: len(fleet.events("started")) == 4, 20, "4 tasks started")
        # Two processes share the work: prefetch 2 each, so neither can hold all 4.
        assert len({e.pid for e in fleet.events("started")}) == 2, fleet.events()

        supervisor.signal(signal.SIGTERM)
        assert await supervisor.wait_exit(30) == 0, supervisor.describe()

        # Every task that was in flight finished and was acked before its process ended.
        assert fleet.task_ids("finished") == set(ids)
        for task_id in ids:
            state = await fleet.app.status(task_id)
            assert state is not None and state.status is TaskStatus.SUCCEEDED, state
        assert await all_empty(broker_url, [qname]), "a message was left on the queue"


def _command_line(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


async def test_children_are_forked_from_the_supervisor_that_loaded_the_app(
    open_fleet: OpenFleet,
) -> None:
    async with open_fleet() as fleet:
        supervisor = await _start_supervised(fleet, 2, concurrency=2)
        children = children_of(supervisor.pid)
        assert len(children) == 2, children
        # Forked, not exec'd: a child is the supervisor's interpreter, app loaded (a fresh
        # `python -m weclaw_mq.cli worker ... --processes 1` imported everything again).
        for pid in children:
            assert _command_line(pid) == _command_line(supervisor.pid), pid
        # Each child has its own broker connection: both take tasks and finish them.
        ids = await fleet.publish_jobs(4)
        await fleet.assert_all_succeed(ids)
        supervisor.signal(signal.SIGTERM)
        assert await supervisor.wait_exit(30) == 0, supervisor.describe()


async def test_a_killed_child_is_started_again_and_nothing_is_lost(
    open_fleet: OpenFleet, broker_url: str, qname: str
) -> None:
    # The killed child's claims lapse after the lease; then its tasks run elsewhere.
    async with open_fleet(guard_lease_s=2.0) as fleet:
        supervisor = await _start_supervised(fleet, 2, concurrency=2, sleep_s=0.5)
        ids = await fleet.publish_jobs(12)
        await wait_until(lambda: len(fleet.events("started")) >= 2, 20, "tasks started")
        victim = fleet.events("started")[0].pid
        os.kill(victim, signal.SIGKILL)  # a child of the supervisor this test started
        await wait_until(
            lambda: supervisor.log().count(CONSUMING_MARK) >= 3, 30, "the killed child restarted"
        )
        await wait_until(lambda: fleet.task_ids("finished") >= set(ids), 60, "every task finished")

        async def all_succeeded() -> bool:
            # A handler's "finished" comes before its result is stored: the record follows.
            states = [await fleet.app.status(task_id) for task_id in ids]
            return all(s is not None and s.status is TaskStatus.SUCCEEDED for s in states)

        await wait_until(all_succeeded, 10, "every task's record succeeded")
        # (Whether the restarted child got one of the 12 is a race with the survivor: not asked.)
        assert "worker process" in supervisor.log() and "died" in supervisor.log()

        supervisor.signal(signal.SIGTERM)
        assert await supervisor.wait_exit(30) == 0, supervisor.describe()
        assert await all_empty(broker_url, [qname])


async def test_an_app_that_cannot_be_loaded_ends_the_supervisor_before_any_child() -> None:
    # The supervisor loads the app once, before it forks: the load error is its own.
    result = await run_cli("worker", "no_such_module_here:app", "--processes", "2")
    assert result.code == 3, result
    assert "Traceback" not in result.stderr
    assert "worker process" not in result.stderr, result.stderr  # no child was started
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("weclaw-mq: error: cannot import "), result.stderr
    assert "no_such_module_here" in last, last


async def test_a_child_that_cannot_start_ends_the_supervisor_with_its_error(
    tmp_path: Path, qname: str, broker_url: str, redis_url: str
) -> None:
    # Child 0's metrics port is taken (child 1 gets the next one): a setting to fix, exit 3.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = await run_cli(
            "worker",
            FIXTURE_APP,
            "--processes",
            "2",
            "--metrics-port",
            str(port),
            env={"TEST_QUEUE": qname, "TEST_RECORD_DIR": str(tmp_path)},
        )
    # Child 1 (the next port is free) may have declared its queues before the stop.
    declared = build_app(qname, settings=settings_for(broker_url, redis_url), record_dir=tmp_path)
    await delete_queues(broker_url, queue_names(declared))
    assert result.code == 3, result
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("weclaw-mq: error: worker process 0 failed (exit 3): "), result.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in last, last


def test_a_child_that_keeps_dying_ends_the_supervisor_non_zero() -> None:
    """A real child process that dies each time it starts: restarted with backoff, then the
    supervisor gives up with its error (the backoff shortened so the test takes a second)."""
    script = (
        "import sys; print('weclaw-mq: error: the model API key is wrong', file=sys.stderr); "
        "sys.exit(1)"
    )
    out = io.StringIO()
    supervisor = Supervisor(
        spawning(lambda i: [sys.executable, "-c", script]), 1, stderr=out, first_backoff_s=0.01
    )
    with pytest.raises(SupervisorError) as raised:
        supervisor.run()
    assert raised.value.exit_code == 1
    assert "died 6 times" in str(raised.value)
    assert str(raised.value).endswith("the model API key is wrong")
    assert out.getvalue().count("the model API key is wrong") == 6


@pytest.mark.parametrize(("text", "expected"), [("1", 1), ("4", 4), (" 2 ", 2)])
def test_processes_counts(text: str, expected: int) -> None:
    assert parse_processes(text) == expected


def test_processes_auto_is_the_usable_cores() -> None:
    assert parse_processes("auto") >= 1


@pytest.mark.parametrize("text", ["0", "-1", "two", ""])
def test_processes_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError):
        parse_processes(text)


async def test_children_stop_when_the_supervisor_is_killed(open_fleet: OpenFleet) -> None:
    async with open_fleet() as fleet:
        supervisor = await _start_supervised(fleet, 2)
        children = children_of(supervisor.pid)
        assert len(children) == 2, children
        supervisor.kill()  # SIGKILL: no chance to forward anything
        # The kernel's parent-death signal (SIGTERM) makes each child drain and exit.
        await wait_until(
            lambda: not any(running(pid) for pid in children), 30, "orphaned workers to exit"
        )

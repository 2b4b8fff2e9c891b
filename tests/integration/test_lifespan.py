"""Startup hooks and resources on the real broker and Redis (issue 28 item 2): a worker process
opens them once before its first task, its handlers (async and plain def) use them, and
SIGTERM closes them after the drain; a startup hook that raises stops the worker with one line
naming the user's file and line (exit 3), closing what had opened; the test kit opens them too.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import close_apps, settings_for
from tests.integration.processes import REPO_ROOT, spawn_cli_worker
from weclaw_mq import App, Context, TaskStatus
from weclaw_mq.errors import ResourceUnavailableError
from weclaw_mq.testing import TestBroker

MODULE = "lifespan_app"
# The user's module: each step and each use is one line of the record file, with the id of
# the client object, so the test can tell one client from two.
APP_SOURCE = """
import os
from pathlib import Path

from weclaw_mq import App, Context

app = App("lifespan-test")
RECORD = Path(os.environ["TEST_RECORD"])


def note(line: str) -> None:
    with RECORD.open("a") as f:
        f.write(line + "\\n")


class Client:
    closed = False


@app.on_startup
def load_settings() -> None:
    note("startup")
    FAIL_HERE


@app.resource
async def client():
    made = Client()
    note(f"open {id(made)}")
    yield made
    made.closed = True
    note(f"close {id(made)}")


@app.on_shutdown
async def say_goodbye() -> None:
    note("shutdown")


@app.handler(os.environ["TEST_QUEUE"])
async def work(task: dict, ctx: Context) -> int:
    used = ctx.use(client)
    assert not used.closed
    note(f"used {id(used)}")
    return id(used)


@app.handler(os.environ["TEST_QUEUE"] + "-sync")
def work_in_thread(task: dict, ctx: Context) -> int:
    used = ctx.use(client)
    note(f"used {id(used)}")
    return id(used)
"""


class Folder:
    def __init__(self, root: Path, queue: str) -> None:
        self.src = root / "src"
        self.src.mkdir()
        self.record = root / "record.log"
        self.queue = queue

    def write(self, fail: bool) -> None:
        body = APP_SOURCE.replace(
            "    FAIL_HERE", '    raise KeyError("missing")' if fail else "    pass"
        )
        (self.src / f"{MODULE}.py").write_text(body)

    def lines(self) -> list[str]:
        return self.record.read_text().splitlines() if self.record.exists() else []


@pytest.fixture
async def producer(broker_url: str, redis_url: str, qname: str) -> AsyncIterator[App]:
    """The same two handlers, declared here and published to; it never consumes."""
    app = App("lifespan-producer", settings=settings_for(broker_url, redis_url))

    @app.handler(qname)
    async def work(task: dict[str, int]) -> None:
        raise AssertionError("the producer never consumes")

    @app.handler(f"{qname}-sync")
    def work_in_thread(task: dict[str, int]) -> None:
        raise AssertionError("the producer never consumes")

    await app.declare()
    try:
        yield app
    finally:
        await close_apps([app], broker_url, redis_url)


def _spawn(folder: Folder, app: App, tmp_path: Path, qname: str) -> Any:
    return spawn_cli_worker(
        f"{MODULE}:app",
        settings=app.settings,
        app_env={
            "TEST_QUEUE": qname,
            "TEST_RECORD": str(folder.record),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            ),
            "WECLAW_MQ_BROKER_LOAD_CHECK": "false",
        },
        log_path=tmp_path / "worker.log",
        concurrency=4,
        cwd=folder.src,
    )


async def test_a_resource_is_opened_once_used_by_handlers_and_closed_on_sigterm(
    producer: App, qname: str, tmp_path: Path
) -> None:
    folder = Folder(tmp_path, qname)
    folder.write(fail=False)
    worker = _spawn(folder, producer, tmp_path, qname)
    try:
        await worker.wait_consuming()
        ids = [await producer.publish(qname, {"n": n}) for n in range(4)]
        ids += [await producer.publish(f"{qname}-sync", {"n": n}) for n in range(4)]
        finals = [await producer.result(t, timeout_s=30) for t in ids]
        worker.signal(signal.SIGTERM)
        assert await worker.wait_exit(30) == 0, worker.describe()
    finally:
        worker.kill()

    assert all(f.status is TaskStatus.SUCCEEDED for f in finals), finals
    lines = folder.lines()
    opened = [line for line in lines if line.startswith("open ")]
    assert len(opened) == 1, lines  # once per worker process
    client_id = opened[0].removeprefix("open ")
    assert {f.result for f in finals} == {int(client_id)}  # one client for all eight
    assert lines == [
        "startup",
        f"open {client_id}",
        *[f"used {client_id}"] * 8,
        "shutdown",  # registered after the resource: it runs first
        f"close {client_id}",
    ]


async def test_a_failing_startup_hook_is_one_line_with_the_users_file_and_line_and_exit_3(
    producer: App, qname: str, tmp_path: Path
) -> None:
    folder = Folder(tmp_path, qname)
    folder.write(fail=True)
    worker = _spawn(folder, producer, tmp_path, qname)
    try:
        code = await worker.wait_exit(30)
    finally:
        worker.kill()

    log = worker.log()
    assert code == 3, worker.describe()
    assert "Traceback" not in log, log
    error = [line for line in log.splitlines() if "error:" in line]
    assert error == ["weclaw-mq: error: startup load_settings failed: KeyError: 'missing'"], log
    module = folder.src / f"{MODULE}.py"
    assert f'  File "{module}", line ' in log and "in load_settings" in log, log
    assert '\n    raise KeyError("missing")\n' in log, log
    # Nothing opened after the failing hook, and the worker never consumed.
    assert folder.lines() == ["startup"]


async def test_the_test_kit_opens_resources_for_its_handlers(
    make_app: Callable[..., App], qname: str
) -> None:
    app = make_app()
    events: list[str] = []

    @app.resource
    async def model() -> AsyncIterator[dict[str, str]]:
        events.append("open")
        yield {"name": "tiny-model"}
        events.append("close")

    @app.handler(qname)
    async def answer(task: dict[str, str], ctx: Context) -> str:
        return f"{ctx.use(model)['name']}: {task['q']}"

    async with TestBroker(app) as broker:
        task_id = await app.publish(qname, {"q": "hi"})
        await broker.run_until_idle()
        state = await app.status(task_id)
        assert events == ["open"]
    assert state is not None and state.result == "tiny-model: hi"
    assert events == ["open", "close"]
    with pytest.raises(ResourceUnavailableError, match="is not open"):
        app.use(model)

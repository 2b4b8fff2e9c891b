"""The tutorial (docs/tutorial/) runs as its pages say, on the real RabbitMQ and Redis.

Every file its pages include from docs/examples/ is run here as it is: the handlers by a
Worker in this event loop (step 3: by the installed ``weclaw-mq worker``), the FastAPI apps
by uvicorn on a free port, read over HTTP with httpx (step 4's page also in headless
Chromium), and step 5's test file by pytest in a process of its own, as a user runs it. The
commands step 3's page shows are run as the installed script, and what the page says they
print is asserted; a command the test runs that the page does not show fails the test.

The example files read ``TUTORIAL_QUEUE`` (their default queue name otherwise), so each test
runs them on a queue of its own, deleted with its Redis keys at teardown.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from tests.conftest import delete_queues, forget_task_keys, load_module, settings_for, wait_until
from tests.integration.browser import chromium  # noqa: F401
from tests.integration.dead_endpoints import closed_port
from tests.integration.live_server import frames, read_events, serving
from tests.integration.processes import CliResult, WorkerProcess, run_cli, spawn_cli_worker
from weclaw_mq import App
from weclaw_mq.wire.topology import queue_declarations

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
TUTORIAL = EXAMPLES / "tutorial"
PAGES = ROOT / "docs" / "tutorial"
# The tutorial's modules, imported by name as the pages' files import each other.
MODULES = (
    "first_handler",
    "publish_first",
    "replies_api",
    "flaky_handler",
    "stream_handler",
    "stream_api",
)
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@dataclass
class Tutorial:
    """The tutorial's files on this test's queue (``TUTORIAL_QUEUE``) and services."""

    queue: str
    env: dict[str, str]  # for child processes: the settings, the queue, the files' folders
    loaded: list[ModuleType] = field(default_factory=list)

    def load(self, name: str) -> ModuleType:
        """Import a tutorial module by name, fresh (with this test's queue)."""
        module = importlib.import_module(name)
        self.loaded.append(module)
        return module

    def load_copy(self, name: str) -> ModuleType:
        """A second, independent copy of a module: the worker's process has its own App."""
        path = next(p for p in (EXAMPLES / f"{name}.py", TUTORIAL / f"{name}.py") if p.exists())
        module = load_module(path, f"worker_{name}")
        self.loaded.append(module)
        return module

    def apps(self) -> list[App]:
        return [m.app for m in self.loaded if isinstance(getattr(m, "app", None), App)]


def forget_modules() -> None:
    for name in MODULES:
        sys.modules.pop(name, None)


@pytest.fixture
async def tutorial(
    monkeypatch: pytest.MonkeyPatch, qname: str, broker_url: str, redis_url: str
) -> AsyncIterator[Tutorial]:
    env = {
        "TUTORIAL_QUEUE": qname,
        "WECLAW_MQ_AMQP_URL": broker_url,
        "WECLAW_MQ_REDIS_URL": redis_url,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MODEL_API_KEY", raising=False)
    folders = [str(EXAMPLES), str(TUTORIAL)]
    for folder in reversed(folders):
        monkeypatch.syspath_prepend(folder)
    path = os.pathsep.join([*folders, *filter(None, [os.environ.get("PYTHONPATH")])])
    forget_modules()
    tut = Tutorial(qname, {**env, "PYTHONPATH": path})
    try:
        yield tut
    finally:
        forget_modules()
        names: set[str] = set()
        for app in tut.apps():
            await app.close()
            for spec in app.handlers.values():
                names.update(n for n, _ in queue_declarations(spec.queue_spec()))
        await delete_queues(broker_url, sorted(names))
        await forget_task_keys(redis_url, [qname])


def page(name: str) -> str:
    return (PAGES / name).read_text(encoding="utf-8")


# -- step 1: a handler, a worker, a publish, a result --------------------------------------


async def test_step_1_publish_first_prints_the_task_id_and_the_reply(
    tutorial: Tutorial, start_worker: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    worker_side = tutorial.load_copy("first_handler")
    publish_first = tutorial.load("publish_first")
    await worker_side.app.declare()
    await start_worker(worker_side.app)

    await publish_first.main()

    printed = capsys.readouterr().out
    assert re.fullmatch(rf"{UUID} succeeded \{{'reply': 'echo: Write a haiku'\}}\n", printed)
    assert "succeeded {'reply': 'echo: Write a haiku'}" in page("index.md")


# -- step 2: publish from FastAPI, read the status ------------------------------------------


async def test_step_2_post_answers_202_at_once_and_get_reads_the_status_then_the_reply(
    tutorial: Tutorial, start_worker: Callable[..., Any]
) -> None:
    replies_api = tutorial.load("replies_api")
    worker_side = tutorial.load_copy("first_handler")

    async with serving(replies_api.api) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        # No worker runs yet: the answer does not wait for one.
        posted = await client.post("/replies", json={"text": "Write a haiku"})
        task_id = posted.json()["task_id"]
        queued = await client.get(f"/replies/{task_id}")
        not_a_prompt = await client.post("/replies", json={"prompt": "Write a haiku"})
        unknown = await client.get("/replies/no-such-task")

        await start_worker(worker_side.app)
        await replies_api.mq.result(task_id, queue=tutorial.queue, timeout_s=30)
        done = await client.get(f"/replies/{task_id}")

    assert posted.status_code == 202, posted.text
    assert posted.json() == {"task_id": task_id} and re.fullmatch(UUID, task_id)
    assert queued.json() == {
        "task_id": task_id,
        "status": "queued",
        "attempt": 0,
        "result": None,
        "error": None,
    }
    assert done.json() == {
        "task_id": task_id,
        "status": "succeeded",
        "attempt": 1,
        "result": {"reply": "echo: Write a haiku"},
        "error": None,
    }
    assert not_a_prompt.status_code == 422
    assert unknown.status_code == 404
    assert unknown.json() == {"detail": "no task no-such-task"}
    text = page("02-fastapi.md")
    for answer in (queued, done, unknown):
        assert answer.text.replace(task_id, "TASK_ID") in text, answer.text


# -- step 3: retries, the DLQ, requeue after the fix ----------------------------------------


@dataclass
class Shell:
    """Runs the page's commands as the installed script, keeping each as the page writes it:
    the queue under its default name, the task id as $TASK_ID."""

    tutorial: Tutorial
    ran: list[str] = field(default_factory=list)
    task_id: str = "$TASK_ID"

    async def run(self, *args: str, expect_code: int = 0) -> CliResult:
        result = await run_cli(*args, env=self.tutorial.env)
        self.ran.append(self.as_on_page(args))
        assert result.code == expect_code, f"{args}: {result.stdout}{result.stderr}"
        return result

    def as_on_page(self, args: tuple[str, ...]) -> str:
        words = ["weclaw-mq"]
        for arg in args:
            arg = arg.replace(self.tutorial.queue, "ai-flaky").replace(self.task_id, "$TASK_ID")
            words.append(f"'{arg}'" if " " in arg else arg)
        return " ".join(words)

    def worker(self, log: Path, **env: str) -> WorkerProcess:
        self.ran.append("weclaw-mq worker flaky_handler:app")
        settings = settings_for(
            self.tutorial.env["WECLAW_MQ_AMQP_URL"], self.tutorial.env["WECLAW_MQ_REDIS_URL"]
        )
        return spawn_cli_worker(
            "flaky_handler:app",
            settings=settings,
            app_env={**self.tutorial.env, **env},
            log_path=log,
        )


def json_fields(state: dict[str, Any], queue: str) -> list[str]:
    """The lines ``weclaw-mq status`` prints for ``state``'s fields that do not change from
    run to run (not the id, the times, or the nested result), as a page shows them."""
    fixed = {
        k: "ai-flaky" if k == "queue" else v
        for k, v in state.items()
        if k not in ("task_id", "result", "expires_at", "updated_at")
    }
    assert state["queue"] == queue
    return [line.removesuffix(",") for line in json.dumps(fixed, indent=2).splitlines()[1:-1]]


def table(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.strip()]


async def test_step_3_a_failing_task_is_retried_dead_lettered_and_requeued_after_the_fix(
    tutorial: Tutorial, tmp_path: Path
) -> None:
    tutorial.load("flaky_handler")  # its queues are deleted at teardown
    queue = tutorial.queue
    sh = Shell(tutorial)
    workers: list[WorkerProcess] = []
    try:
        declared = await sh.run("declare", "flaky_handler:app")
        delay_queues = {"weclaw_mq.delay.1s", "weclaw_mq.delay.2s"}
        assert {queue, f"{queue}.dlq", *delay_queues} <= set(declared.stdout.split())
        workers.append(sh.worker(tmp_path / "worker-1.log"))  # MODEL_API_KEY is not set
        await workers[0].wait_consuming()

        published = await sh.run("publish", queue, "--data", '{"text": "Write a haiku"}')
        sh.task_id = task_id = published.stdout.strip()
        failed = json.loads((await sh.run("status", task_id, "--wait", "30")).stdout)
        listed = await sh.run("dlq", "list", queue)
        shown = await sh.run("dlq", "show", queue, task_id)

        workers[0].signal(signal.SIGINT)  # Ctrl-C; the fix: a worker started with the key
        assert await workers[0].wait_exit() == 0, workers[0].describe()
        workers.append(sh.worker(tmp_path / "worker-2.log", MODEL_API_KEY="sk-tutorial"))
        await workers[1].wait_consuming()
        dry_run = await sh.run("dlq", "requeue", queue, "--dry-run")
        requeued = await sh.run("dlq", "requeue", queue)
        fixed = json.loads((await sh.run("status", task_id, "--wait", "30")).stdout)
        left = await sh.run("dlq", "list", queue)
    finally:
        for worker in workers:
            worker.kill()

    text = page("03-retries.md")
    error = "ModelUnavailable: 401 from the model: MODEL_API_KEY is not set"
    assert {k: failed[k] for k in ("status", "attempt", "reason", "error", "result")} == {
        "status": "dead_lettered",
        "attempt": 3,
        "reason": "retries_exhausted",
        "error": error,
        "result": None,
    }
    # The worker's log: the schedule of the retry policy, then the DLQ.
    log = workers[0].log()
    for line in (
        f"retried: attempt 1 failed ({error}); retrying in 1 s",
        f"retried: attempt 2 failed ({error}); retrying in 2 s",
        f"dead_lettered: dead-lettered after attempt 3: retries_exhausted ({error})",
    ):
        assert line in log, log
        assert line in text, line
    rows = table(listed.stdout)
    assert rows[0] == ["TASK_ID", "REASON", "ERROR_TYPE", "ATTEMPTS", "LAST_FAILURE"]
    assert [row[:4] for row in rows[1:]] == [
        [task_id, "retries_exhausted", "ModelUnavailable", "3"]
    ]
    assert table(dry_run.stdout)[:2] == rows[:2]
    # Every field of the dead letter: its body, the error and its traceback.
    assert f"task_id: {task_id}" in shown.stdout
    assert 'body: {"text": "Write a haiku"}' in shown.stdout
    assert "error_type: ModelUnavailable" in shown.stdout
    assert f"error_message: {error.split(': ', 1)[1]}" in shown.stdout
    traceback = shown.stdout.split("traceback:\n", 1)[1]
    assert traceback.startswith("Traceback") and error in traceback
    for said in (
        dry_run.stdout.splitlines()[-1],
        requeued.stdout.strip(),
    ):
        assert said.replace(queue, "ai-flaky") in text, said
    assert requeued.stdout.strip() == (
        f"moved 1 message(s) from {queue}.dlq to {queue}; skipped 0, failed 0, left 0"
    )
    assert {k: fixed[k] for k in ("status", "attempt", "reason", "error", "result")} == {
        "status": "succeeded",
        "attempt": 1,
        "reason": None,
        "error": None,
        "result": {"reply": "echo: Write a haiku"},
    }
    assert table(left.stdout) == [rows[0]]
    # The page's two JSON documents: these fields as status printed them.
    for state in (failed, fixed):
        missing_fields = [f for f in json_fields(state, queue) if f not in text]
        assert not missing_fields, missing_fields
    missing = [command for command in sh.ran if command not in text]
    assert not missing, f"03-retries.md does not show {missing}"


# -- step 4: a reply streamed to a web page -------------------------------------------------


async def test_step_4_the_reply_streams_as_server_sent_events_and_ends_with_its_final_event(
    tutorial: Tutorial, start_worker: Callable[..., Any]
) -> None:
    stream_api = tutorial.load("stream_api")
    worker_side = tutorial.load_copy("stream_handler")

    async with serving(stream_api.api) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        html = await client.get("/")
        await start_worker(worker_side.app)
        posted = await client.post("/replies", json={"text": "Write a haiku"})
        task_id = posted.json()["task_id"]
        url = f"/replies/{task_id}/events"
        events = await read_events(client, url)  # until the response ends
        # A reconnecting EventSource sends the last id it saw: the events after it, no more.
        resumed = await read_events(client, url, headers={"Last-Event-ID": events[2].id})
        again = await read_events(client, url)
        # Asked for before its task exists: the response waits for it.
        early_id = f"early-{task_id}"
        async with (
            asyncio.timeout(20),
            client.stream("GET", f"/replies/{early_id}/events") as response,
        ):
            assert response.status_code == 200  # the endpoint answered: the task is unknown
            assert await stream_api.mq.status(early_id) is None
            await stream_api.mq.publish(tutorial.queue, {"text": "Write a haiku"}, task_id=early_id)
            early = [frame async for frame in frames(response)]

    assert posted.status_code == 202, posted.text
    assert [e.event for e in events] == ["attempt", *["chunk"] * 4, "final"]
    assert events[0].data == {"attempt": 1}
    assert [e.data for e in events if e.event == "chunk"] == ["echo: ", "Write ", "a ", "haiku "]
    assert events[-1].data == {"status": "succeeded", "result": {"reply": "echo: Write a haiku"}}
    assert resumed == events[3:]
    assert again == events
    assert [(e.event, e.data) for e in early] == [(e.event, e.data) for e in events]
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert html.text == (TUTORIAL / "stream_page.html").read_text(encoding="utf-8")
    text = page("04-streaming.md")
    for frame in events:
        shown = f"event: {frame.event}\ndata: {json.dumps(frame.data)}"
        assert shown in text, shown


PAGE_JS = """return [document.getElementById("reply").textContent,
document.getElementById("status").textContent];"""


async def test_step_4_the_page_shows_the_reply_growing_then_its_status_in_a_browser(
    tutorial: Tutorial,
    start_worker: Callable[..., Any],
    chromium: webdriver.Chrome,  # noqa: F811
) -> None:
    stream_api = tutorial.load("stream_api")
    worker_side = tutorial.load_copy("stream_handler")
    await start_worker(worker_side.app)
    reply = "echo: Write a haiku about queues "  # the words, each with the space after it
    shown: list[tuple[str, str]] = []

    async def succeeded() -> bool:
        text, status = await asyncio.to_thread(chromium.execute_script, PAGE_JS)
        shown.append((text, status))
        assert reply.startswith(text), shown  # never a word twice, none missing
        return bool(status == "succeeded")

    async with serving(stream_api.api) as base_url:
        await asyncio.to_thread(chromium.get, f"{base_url}/")
        await asyncio.to_thread(chromium.find_element(By.CSS_SELECTOR, "#ask button").click)
        await wait_until(succeeded, timeout_s=20, what="the page to show the final status")

    assert shown[-1] == (reply, "succeeded")
    # Word by word: the page showed part of the reply while the worker was writing it.
    partial = [text for text, _ in shown if 0 < len(text) < len(reply)]
    assert partial, shown


# -- step 5: the handler's tests, with the test kit ------------------------------------------

# This venv's plugins that a user's run does not have and that are slow to load.
QUIET_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:xdist")


def test_step_5_the_pages_test_file_passes_under_pytest_as_a_user_runs_it(tmp_path: Path) -> None:
    # The user's folder: step 1's handler and the page's test file, nothing of this repository
    # (no conftest, no pytest settings).
    for source in (EXAMPLES / "first_handler.py", TUTORIAL / "test_first_handler.py"):
        shutil.copy(source, tmp_path / source.name)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WECLAW_MQ_") and k != "TUTORIAL_QUEUE"
    }
    # Nothing answers at either URL: the tests need no RabbitMQ and no Redis.
    env["WECLAW_MQ_AMQP_URL"] = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    env["WECLAW_MQ_REDIS_URL"] = f"redis://127.0.0.1:{closed_port()}/0"

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *QUIET_PLUGINS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert run.returncode == 0, run.stdout + run.stderr
    summary = re.search(r"^3 passed in ([0-9.]+)s", run.stdout, re.M)
    assert summary is not None, run.stdout
    # The retries' 35 s of delays are not waited (the page: "in far less than those 35 s").
    assert float(summary[1]) < 5, run.stdout
    assert "3 passed in " in page("05-testing.md")


SOURCES = (".py", ".html")


def test_every_file_of_the_tutorials_examples_is_on_a_page() -> None:
    # A page shows a file inline, after the marker naming it (tests/unit/test_docs_code_blocks
    # holds the copy equal to the file).
    included = set(
        re.findall(
            r"<!-- code: docs/examples/([^ :]+?)(?::[^ ]+)? -->",
            "".join(p.read_text(encoding="utf-8") for p in PAGES.glob("*.md")),
        )
    )
    # Every example is shown, and every file shown is one of them (each run by a test above).
    # (docs/examples/howto/ belongs to the how-to pages and their own test.)
    files = {
        str(p.relative_to(EXAMPLES))
        for p in [*EXAMPLES.glob("*"), *(EXAMPLES / "tutorial").rglob("*")]
        if p.suffix in SOURCES
    }
    assert files == included

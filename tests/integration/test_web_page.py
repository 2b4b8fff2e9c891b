"""The example chat page (``producers/static/index.html``) in headless Chromium, against the
API served for real with a demo worker: a reply streams in, survives a reload in the middle,
and a reply that finished while the page was closed is there when it is opened again; a
reply whose worker process is killed with SIGKILL at 90 % is finished by a new worker
process, shown once, with no word twice and none missing."""

from __future__ import annotations

import asyncio
import itertools
import math
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from consumers import demo
from producers.api import create_app
from tests.conftest import settings_for, wait_until
from tests.integration.browser import chromium  # noqa: F401
from tests.integration.live_app import (  # noqa: F401
    LiveApi,
    forget_sessions,
    live_api,
    steady_llm,
)
from tests.integration.live_server import read_events, serving
from tests.integration.processes import WorkerProcess, spawn_cli_worker
from weclaw_mq import App, TaskStatus
from weclaw_mq.streaming.emitter import emitted_chunks
from weclaw_mq.streaming.events import id_key

# Slow enough that the page can be reloaded, or closed, while the reply is being written.
WORD_S = "0.06"
TURNS_JS = """
return [...document.querySelectorAll('.turn')].map((t) => ({
  task: t.dataset.task,
  reply: t.querySelector('.reply').textContent,
  status: t.querySelector('.status').textContent,
}));
"""


class Page:
    """The chat page in the browser; every Selenium call runs off the event loop, which
    serves the API and runs the worker meanwhile."""

    def __init__(self, driver: webdriver.Chrome, url: str) -> None:
        self.driver = driver
        self.url = url

    async def open(self) -> str:
        """Load the page; its session id (kept in localStorage)."""
        await asyncio.to_thread(self.driver.get, self.url)
        session: str = await asyncio.to_thread(
            self.driver.execute_script, "return localStorage.getItem('weclaw.session');"
        )
        return session

    async def close(self) -> None:
        await asyncio.to_thread(self.driver.get, "about:blank")

    async def reload(self) -> None:
        await asyncio.to_thread(self.driver.refresh)

    async def ask(self, text: str) -> None:
        def type_and_send() -> None:
            self.driver.find_element(By.ID, "text").send_keys(text)
            self.driver.find_element(By.CSS_SELECTOR, "#ask button").click()

        await asyncio.to_thread(type_and_send)

    async def turns(self) -> list[dict[str, Any]]:
        turns: list[dict[str, Any]] = await asyncio.to_thread(self.driver.execute_script, TURNS_JS)
        return turns

    async def wait_for(self, index: int, what: str, check: Any) -> dict[str, Any]:
        """Wait until turn ``index`` passes ``check``; returns it as it was then."""
        seen: dict[str, Any] = {}

        async def passes() -> bool:
            turns = await self.turns()
            if len(turns) <= index:
                return False
            seen.update(turns[index])
            return bool(check(turns[index]))

        await wait_until(passes, timeout_s=20, what=what)
        return seen

    async def screenshot(self, path: Path) -> None:
        assert await asyncio.to_thread(self.driver.save_screenshot, str(path)), path


def words(turn: dict[str, Any]) -> int:
    return len(turn["reply"].split())


class Streaming:
    """A check for ``Page.wait_for``: true once the reply succeeded; until then every text
    the page shows must be a beginning of ``reply`` (no word twice, none missing in
    between). ``longest`` is the most words seen while it was still being written."""

    def __init__(self, reply: str) -> None:
        self.reply = reply
        self.longest = 0

    def __call__(self, turn: dict[str, Any]) -> bool:
        if turn["status"] == "succeeded":
            return True
        assert self.reply.startswith(turn["reply"]), turn
        self.longest = max(self.longest, words(turn))
        return False


async def test_the_page_streams_a_reply_through_a_reload_and_keeps_one_finished_while_closed(
    live_api: LiveApi,  # noqa: F811
    chromium: webdriver.Chrome,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("DEMO_LLM_WORD_S", WORD_S)
    page = Page(chromium, live_api.base_url + "/")
    first, second = "Why ack after the work?", "What does a dead-letter queue hold?"
    live_api.sessions.append(await page.open())

    # The reply streams in: a few words are there while it is still being written.
    await page.ask(first)
    before = await page.wait_for(0, "the first words of the reply", lambda t: words(t) >= 4)
    assert before["status"] == "writing", before
    assert demo.reply_to(first).startswith(before["reply"]), before

    # Reloaded mid-reply: the page shows at once what it had, then the rest streams in.
    await page.reload()
    restored = await page.wait_for(0, "the conversation after the reload", lambda t: True)
    assert restored["reply"].startswith(before["reply"]), (before, restored)
    await page.screenshot(tmp_path / "after-reload.png")
    streaming = Streaming(demo.reply_to(first))
    done = await page.wait_for(0, "the finished reply", streaming)
    assert done["reply"] == demo.reply_to(first), done
    # It went on streaming after the reload, not only filled in by the final event.
    assert streaming.longest > words(restored), (streaming.longest, restored)

    # Closed mid-reply: the reply finishes meanwhile, and is there when the page comes back.
    await page.ask(second)
    started = await page.wait_for(1, "the second reply to start", lambda t: words(t) >= 2)
    await page.close()
    final = await live_api.worker_app.result(started["task"], timeout_s=20)
    assert final.status is TaskStatus.SUCCEEDED
    await page.open()
    waiting = await page.wait_for(1, "the reply that waited", lambda t: t["status"] == "succeeded")
    assert waiting["reply"] == demo.reply_to(second), waiting
    assert (await page.turns())[0]["reply"] == demo.reply_to(first)

    await page.screenshot(tmp_path / "page.png")


# -- a worker killed with kill -9 at 90 % of a reply (a process of its own) -------------------

# Every rendering of the first turn, recorded as it happens: render() rebuilds the turn on
# each event, and each SSE event is a task of its own, so each state is seen (polling could
# miss one that showed a word twice for a moment).
RECORD_JS = """
window.shown = [];
new MutationObserver(() => {
  const turn = document.querySelector('.turn');
  if (turn) window.shown.push([turn.querySelector('.reply').textContent,
                               turn.querySelector('.status').textContent]);
}).observe(document.getElementById('turns'), {childList: true, subtree: true});
"""
# The kill comes once the page shows this share of the reply's words.
KILL_AT = 0.9
# Slow enough that the last 4 of the 47 words (0.6 s) are not all written within the page's
# lag behind the worker (tens of ms) plus the time the kill takes.
KILL_WORD_S = "0.15"


@dataclass
class ProcessDemo:
    """The API served here (``client`` has its base URL) and ``start_worker()``, which
    starts a demo worker process (``weclaw-mq worker consumers.demo:app``) and waits until
    it consumes."""

    base_url: str
    client: httpx.AsyncClient
    api_app: App
    start_worker: Callable[[], Awaitable[WorkerProcess]]
    sessions: list[str]


@pytest.fixture
async def process_demo(
    make_app: Callable[..., App], qname: str, broker_url: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[ProcessDemo]:
    """The API on a free port, and demo workers as processes of their own (SIGKILLed by pid
    at teardown, before make_app deletes the queue and the tasks' keys)."""
    api_app = make_app("demo-api")
    demo.register(api_app, queue=qname)
    # A killed worker's claim on its task is free once its heartbeat lapses: 0.5 s, not 5 s.
    settings = settings_for(broker_url, redis_url, guard_heartbeat_ttl_s=0.5)
    app_env = {
        "DEMO_QUEUE": qname,
        "DEMO_LLM_FAILURE_RATE": "0",
        "DEMO_LLM_LATENCY_S": "0.01",
        "DEMO_LLM_WORD_S": KILL_WORD_S,
    }
    workers: list[WorkerProcess] = []
    sessions: list[str] = []

    async def start_worker() -> WorkerProcess:
        worker = spawn_cli_worker(
            "consumers.demo:app",
            settings=settings,
            app_env=app_env,
            log_path=tmp_path / f"worker-{len(workers)}.log",
        )
        workers.append(worker)
        await worker.wait_consuming()
        return worker

    try:
        async with (
            serving(create_app(api_app)) as base_url,
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        ):
            yield ProcessDemo(base_url, client, api_app, start_worker, sessions)
    finally:
        for worker in workers:
            worker.kill()
        await forget_sessions(redis_url, sessions)


async def test_a_reply_whose_worker_is_killed_at_90_percent_finishes_on_the_page_once(
    process_demo: ProcessDemo,
    chromium: webdriver.Chrome,  # noqa: F811
    tmp_path: Path,
) -> None:
    prompt = "Why ack after the work?"
    reply = demo.reply_to(prompt)
    total = len(demo.words_of(reply))
    first = await process_demo.start_worker()
    page = Page(chromium, process_demo.base_url + "/")
    process_demo.sessions.append(await page.open())
    await asyncio.to_thread(chromium.execute_script, RECORD_JS)
    await page.ask(prompt)
    started = await page.wait_for(0, "the first word", lambda t: words(t) >= 1)
    task_id = started["task"]
    # A reader of the task's stream over HTTP, connected through the kill and the new worker.
    url = f"/tasks/{task_id}/events"
    live = asyncio.create_task(read_events(process_demo.client, url, until_finals=1, timeout_s=60))

    kill_at = math.ceil(total * KILL_AT)
    assert (kill_at, total) == (43, 47)  # as docs/how-to/examples.md says
    before = await page.wait_for(0, f"{kill_at} of {total} words", lambda t: words(t) >= kill_at)
    first.kill()  # SIGKILL, by pid
    assert first.popen.returncode == -signal.SIGKILL, first.describe()
    # No worker runs now, so nothing can end the task: it had not ended, and its stream holds
    # part of the reply (at least what the page showed), which the next run must continue.
    state = await process_demo.api_app.status(task_id)
    assert state is not None and state.status is TaskStatus.RUNNING, state
    held = len(await emitted_chunks(process_demo.api_app.streams, task_id))
    assert kill_at <= held < total, (held, before)
    await page.screenshot(tmp_path / "killed.png")

    await process_demo.start_worker()
    done = await page.wait_for(0, "the reply to finish", lambda t: t["status"] == "succeeded")
    frames = await live

    # The page: the whole reply, once, and every text it showed on the way was a beginning of
    # it, growing (no word twice, none missing); the last text before the final event is
    # already the whole reply (the final filled in nothing), and the new run's words came
    # one at a time.
    assert done["reply"] == reply, done
    writing = [text for text, status in await shown(chromium) if status != "succeeded"]
    assert all(reply.startswith(text) for text in writing), writing
    assert all(len(a) <= len(b) for a, b in itertools.pairwise(writing)), writing
    assert writing[-1] == reply, writing[-1]
    note = await asyncio.to_thread(
        chromium.execute_script, "return document.querySelector('.turn .note').textContent;"
    )

    # HTTP: one "attempt" marker (the new run continued, it did not start over), every word
    # once and in order, ids unique and increasing; the final result is the text shown.
    replay = await read_events(process_demo.client, url, timeout_s=20)
    for got in (frames, replay):
        ids = [f.id for f in got]
        assert len(set(ids)) == len(ids), ids
        assert ids == sorted(ids, key=id_key), ids
        assert [f.event for f in got] == ["attempt", *["chunk"] * total, "final"], got
        assert [f.data["data"] for f in got if f.event == "chunk"] == demo.words_of(reply)
    assert replay == frames
    result = frames[-1].data["result"]
    assert result["reply"] == done["reply"], result
    continued = result["continued_after_words"]
    assert held <= continued < total, (held, continued)
    continuation = {text for text in writing if len(demo.words_of(text)) > continued}
    assert len(continuation) == total - continued, writing
    assert note == f"continued after {continued} words of an earlier run", note
    await page.screenshot(tmp_path / "finished.png")


async def shown(driver: webdriver.Chrome) -> list[tuple[str, str]]:
    """The page's renderings of the first turn so far (text, status), repeats dropped."""
    raw: list[list[str]] = await asyncio.to_thread(driver.execute_script, "return window.shown;")
    out: list[tuple[str, str]] = []
    for text, status in raw:
        if not out or out[-1] != (text, status):
            out.append((text, status))
    return out

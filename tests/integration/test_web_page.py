"""The example chat page (``producers/static/index.html``) in headless Chromium, against the
API served for real with a demo worker: a reply streams in, survives a reload in the middle,
and a reply that finished while the page was closed is there when it is opened again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from consumers import demo
from tests.conftest import wait_until
from tests.integration.browser import chromium  # noqa: F401
from tests.integration.live_app import LiveApi, live_api, steady_llm  # noqa: F401
from weclaw_mq import TaskStatus

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

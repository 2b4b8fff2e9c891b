"""The web console as an operator uses it: headless Chromium (Debian's, through Selenium)
against the console served for real, with a real Worker on the shared broker and Redis.

Tasks go from queued to succeeded on the open Tasks page without a reload; a failing task's
page shows its traceback; a streamed reply appears chunk by chunk; a task's memoized steps are
listed, then shown replayed once a requeued run replays them; dead letters filtered by
error type are previewed, requeued and run; markup in a payload stays text; a running task
is cancelled from its page; the overview shows the live worker and what it runs; a console
with a token asks for it once and keeps it in a cookie the page's script cannot read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from tests.conftest import wait_until
from tests.integration.browser import chromium  # noqa: F401
from tests.integration.console_live import (  # noqa: F401
    LiveConsole,
    console_access,
    console_trace_url,
    live_console,
)
from weclaw_mq import TaskStatus
from weclaw_mq.admin import dlq
from weclaw_mq.console import Access

TIMEOUT_S = 20.0


class Browser:
    """The console in Chromium; every Selenium call runs off the event loop, which serves the
    console and runs the worker meanwhile."""

    def __init__(self, driver: webdriver.Chrome, base_url: str) -> None:
        self.driver = driver
        self.base_url = base_url

    async def open(self, path: str) -> None:
        await asyncio.to_thread(self.driver.get, self.base_url + path)

    async def js(self, script: str, *args: Any) -> Any:
        return await asyncio.to_thread(self.driver.execute_script, script, *args)

    async def text(self, selector: str) -> str:
        found: str = await self.js(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';",
            selector,
        )
        return found

    async def click(self, selector: str) -> None:
        await asyncio.to_thread(lambda: self.driver.find_element(By.CSS_SELECTOR, selector).click())

    async def type(self, selector: str, value: str) -> None:
        def typed() -> None:
            field = self.driver.find_element(By.CSS_SELECTOR, selector)
            field.clear()
            field.send_keys(value)

        await asyncio.to_thread(typed)

    async def accept_confirm(self) -> None:
        await asyncio.to_thread(lambda: self.driver.switch_to.alert.accept())

    async def until_text(self, selector: str, check: Any, what: str) -> str:
        seen: list[str] = []

        async def holds() -> bool:
            seen.append(await self.text(selector))
            return bool(check(seen[-1]))

        await wait_until(holds, TIMEOUT_S, what)
        return seen[-1]

    async def rows(self) -> dict[str, str]:
        """The Tasks page's rows: task id -> status."""
        found: dict[str, str] = await self.js(
            "const rows = {}; document.querySelectorAll('#task-table tr[data-task]').forEach("
            "(r) => { rows[r.dataset.task] = r.querySelector('.status').textContent; });"
            "return rows;"
        )
        return found


@pytest.fixture
def browser(live_console: LiveConsole, chromium: webdriver.Chrome) -> Browser:  # noqa: F811
    return Browser(chromium, live_console.base_url)


async def test_published_tasks_go_from_queued_to_succeeded_on_the_open_page_without_a_reload(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    await browser.open(f"/tasks?queue={live_console.queue}")
    await browser.js("window.notReloaded = true;")
    ids = [await live_console.publish({"mode": "hold", "gate": "go"}) for _ in range(3)]

    async def statuses(wanted: str) -> bool:
        rows = await browser.rows()
        return all(rows.get(t) == wanted for t in ids)

    await wait_until(lambda: statuses("queued"), TIMEOUT_S, "three queued rows")
    await live_console.start()
    await wait_until(lambda: statuses("running"), TIMEOUT_S, "three running rows")
    live_console.scenario.open("go")
    await wait_until(lambda: statuses("succeeded"), TIMEOUT_S, "three succeeded rows")
    assert await browser.js("return window.notReloaded === true;")


async def test_a_failing_tasks_page_shows_its_error_and_traceback(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    task_id = await live_console.publish(
        {"mode": "fail", "error": "UpstreamBroke", "message": "the model is down"}
    )
    await live_console.start()
    final = await live_console.console_app.result(task_id, timeout_s=TIMEOUT_S)
    assert final.status is TaskStatus.DEAD_LETTERED

    await browser.open(f"/tasks/{task_id}?queue={live_console.queue}")
    assert await browser.text("#status") == "dead_lettered"
    assert "UpstreamBroke: the model is down" in await browser.text("#record-error")
    traceback = await browser.text("#traceback")
    assert traceback.startswith("Traceback"), traceback
    assert "in console_task" in traceback and "UpstreamBroke: the model is down" in traceback
    assert '"mode": "fail"' in await browser.text("#payload")


async def test_a_streamed_reply_appears_chunk_by_chunk(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    await live_console.start()
    words = ["Acks", "come", "after", "the", "work."]
    task_id = await live_console.publish({"mode": "stream", "words": words})
    await browser.open(f"/tasks/{task_id}?queue={live_console.queue}")
    for i in range(len(words)):
        shown = " ".join(words[: i + 1])
        await browser.until_text("#stream", lambda t, s=shown: t == s, f"the reply up to {shown!r}")
        live_console.scenario.open(f"{task_id}:{i}")
    await browser.until_text("#stream-state", lambda t: t == "ended: succeeded", "the end")
    assert await browser.text("#stream") == " ".join(words)
    await browser.until_text("#status", lambda t: t == "succeeded", "the status, live")
    assert '"words": 5' in await browser.text("#result")


async def test_a_tasks_steps_are_listed_fresh_then_cached_after_a_run_replays_them(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    app, queue = live_console.console_app, live_console.queue
    task_id = await live_console.publish({"mode": "steps"})
    await live_console.start()
    assert (await app.result(task_id, timeout_s=TIMEOUT_S)).status is TaskStatus.DEAD_LETTERED

    await browser.open(f"/tasks/{task_id}?queue={queue}")
    assert await step_cells(browser) == [
        ["plan", "1", "1", "-", "0", "0", "-", "fresh"],
        ["call", "1", "1", "m-1", "12", "30", "-", "fresh"],
    ]
    assert await dlq.requeue(app, queue, task_ids=[task_id]) == 1
    final = await app.result(task_id, timeout_s=TIMEOUT_S)
    assert final.status is TaskStatus.SUCCEEDED, final

    # A final page polls no more: the run that replayed them is seen on the next visit.
    await browser.open(f"/tasks/{task_id}?queue={queue}")
    assert [row[-1] for row in await step_cells(browser)] == ["cached", "cached"]
    assert live_console.scenario.step_calls == [f"{task_id} plan", f"{task_id} call"]
    assert '"reply": "a reply"' in await browser.text("#result")


async def step_cells(browser: Browser) -> list[list[str]]:
    """The steps table's rows, without the duration (it varies): step, #, attempt, model,
    tokens in and out, cost, run."""
    rows: list[list[str]] = await browser.js(
        "return [...document.querySelectorAll('#steps tbody tr')]"
        ".map((r) => [...r.cells].map((c) => c.textContent.trim()));"
    )
    return [row[:3] + row[4:] for row in rows]


async def test_dead_letters_of_one_error_type_are_previewed_requeued_and_run(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    limited = [await live_console.publish({"mode": "fail_once"}) for _ in range(2)]
    broken = await live_console.publish({"mode": "fail", "error": "UpstreamBroke"})
    await live_console.start()
    for task_id in [*limited, broken]:
        final = await live_console.console_app.result(task_id, timeout_s=TIMEOUT_S)
        assert final.status is TaskStatus.DEAD_LETTERED, final

    await browser.open(f"/dead-letters?queue={live_console.queue}")
    assert "3 of 3" in await browser.text("#dlq-count")
    await browser.type("input[name=error_type]", "RateLimitError")
    await browser.click("#dlq-filters button[type=submit]")
    await browser.until_text("#dlq-count", lambda t: "2 of 3" in t, "the filtered list")

    await browser.click("#all-matching")
    await browser.click("#preview-requeue")
    await browser.until_text("#preview-title", lambda t: "requeue 2" in t, "the dry run")
    previewed = await browser.js(
        "return [...document.querySelectorAll('#preview-table tbody tr')]"
        ".map((r) => r.cells[0].textContent);"
    )
    assert sorted(previewed) == sorted(limited)
    # The dry run moved nothing.
    for task_id in limited:
        state = await live_console.console_app.status(task_id)
        assert state is not None and state.status is TaskStatus.DEAD_LETTERED

    await browser.click("#confirm")
    done = await browser.until_text("#job-state", lambda t: t.startswith("done"), "the requeue")
    assert done == "done: moved 2, skipped 0, failed 0, left 1", done
    for task_id in limited:  # they ran again, and succeeded this time
        final = await live_console.console_app.result(task_id, timeout_s=TIMEOUT_S)
        assert final.status is TaskStatus.SUCCEEDED, final
    await browser.click("#close-preview")
    await browser.until_text("#dlq-count", lambda t: "0 of 1" in t, "the list after the run")
    await browser.open(f"/tasks/{limited[0]}?queue={live_console.queue}")
    assert await browser.text("#status") == "succeeded"


async def test_markup_in_a_payload_and_an_error_is_shown_as_text(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    evil = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    task_id = await live_console.publish(
        {"mode": "fail", "error": "UpstreamBroke", "message": evil, "text": evil}
    )
    await live_console.start()
    await live_console.console_app.result(task_id, timeout_s=TIMEOUT_S)
    await browser.open(f"/tasks/{task_id}?queue={live_console.queue}")
    assert "<script>window.pwned = 1</script>" in await browser.text("#payload")
    assert evil in await browser.text("#record-error")
    assert await browser.js("return window.pwned === undefined;")
    assert await browser.js("return document.querySelectorAll('main script, main img').length") == 0


async def test_a_running_task_is_cancelled_from_its_page(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    await live_console.start()
    task_id = await live_console.publish({"mode": "hold", "gate": "never"})

    async def running() -> bool:
        state = await live_console.console_app.status(task_id)
        return state is not None and state.status is TaskStatus.RUNNING

    await wait_until(running, TIMEOUT_S, "the task to run")
    await browser.open(f"/tasks/{task_id}?queue={live_console.queue}")
    await browser.click("#cancel")
    await browser.accept_confirm()
    await browser.until_text("#action-result", lambda t: t == "cancel: cancelled", "the answer")
    await browser.until_text("#status", lambda t: t == "cancelled", "the status, live")
    final = await live_console.console_app.result(task_id, timeout_s=TIMEOUT_S)
    assert final.status is TaskStatus.CANCELLED


async def test_the_overview_shows_the_live_worker_and_the_task_it_runs(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    await browser.open("/")
    assert live_console.queue in await browser.text("#queues")
    await browser.until_text("#no-workers", lambda t: "No live worker" in t, "no worker yet")
    await live_console.start()
    task_id = await live_console.publish({"mode": "hold", "gate": "go"})
    await browser.until_text("#workers", lambda t: task_id in t, "the worker running the task")
    live_console.scenario.open("go")
    await browser.until_text("#workers", lambda t: task_id not in t and "idle" in t, "idle again")


@pytest.mark.parametrize("console_access", [Access(token="browser-test-token-0123456789")])
async def test_a_console_with_a_token_signs_in_once_with_a_cookie_scripts_cannot_read(
    live_console: LiveConsole,  # noqa: F811
    browser: Browser,
) -> None:
    await browser.open("/dead-letters")
    await browser.type("#token", "not the token")
    await browser.click("#sign-in")
    await browser.until_text("#login-failed", lambda t: "not right" in t, "the refusal")
    await browser.type("#token", "browser-test-token-0123456789")
    await browser.click("#sign-in")
    await browser.until_text("h1", lambda t: t == "Dead letters", "the page asked for")
    assert await browser.js("return document.cookie;") == ""  # HttpOnly
    await browser.open("/")
    assert live_console.queue in await browser.text("#queues")

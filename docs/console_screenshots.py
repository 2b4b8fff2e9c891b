"""The console's screenshots in the docs (``docs/assets/console/*.png``), taken for real:
``make console-screenshots``.

Against RabbitMQ and Redis on ``WECLAW_MQ_AMQP_URL`` / ``WECLAW_MQ_REDIS_URL`` (default: the
local ones), it declares two handler queues of a support bot, runs a Worker in this process,
publishes tasks that succeed, fail (a rate limit, a bad ticket) and stream a reply held
part-written, serves the console on a free port and photographs each page in headless
Chromium (the browser the tests use). It deletes its queues and Redis keys when done.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

from tests.conftest import delete_queues, forget_task_keys, wait_until  # noqa: E402
from tests.integration.browser import open_chromium  # noqa: E402
from tests.integration.live_server import serving  # noqa: E402
from weclaw_mq import App, Context, RetryPolicy, Settings, TaskStatus, Worker  # noqa: E402
from weclaw_mq.console import create_console  # noqa: E402
from weclaw_mq.policy.breaker import Breaker  # noqa: E402
from weclaw_mq.policy.limits import Limit  # noqa: E402
from weclaw_mq.wire.topology import queue_declarations  # noqa: E402

OUT = ROOT / "docs" / "assets" / "console"
TRIAGE, CHAT = "ticket-triage", "chat-replies"
WINDOW = "1280,900"
REPLY_TEXT = (
    "Your refund was approved on Tuesday and should reach your card within three to five "
    "business days. I have attached the receipt to this conversation"
)
REPLY = REPLY_TEXT.split(" ")


class RateLimitError(Exception):
    """The model provider's 429."""


class State:
    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.words = asyncio.Event()


def register(app: App, state: State) -> None:
    @app.handler(
        TRIAGE,
        retry=RetryPolicy(max_retries=0, delay_s=0.05),
        limit=Limit(key=lambda t: t["customer"], concurrency=2),
        breaker=Breaker(failures=5, window_s=30, cooldown_s=30, on=RateLimitError),
    )
    async def classify(ticket: dict[str, Any]) -> dict[str, Any]:
        if ticket.get("hold"):
            await state.hold.wait()
        if ticket.get("fail") == "rate":
            raise RateLimitError("429 Too Many Requests: retry after 20 s")
        if ticket.get("fail") == "empty":
            raise ValueError("the ticket has no text to classify")
        return {"label": ticket.get("label", "billing"), "confidence": 0.93}

    @app.handler(CHAT, retry=RetryPolicy(max_retries=2, delay_s=0.5))
    async def reply(message: dict[str, Any], ctx: Context) -> dict[str, Any]:
        # Two memoized steps before the reply: the task page lists them with their tokens.
        async def look_up() -> dict[str, str]:
            ctx.usage(input_tokens=420, output_tokens=35, model="small-1")
            return {"order": "A-1042", "refund": "approved"}

        async def check_policy(order: dict[str, str]) -> bool:
            ctx.usage(input_tokens=180, output_tokens=4, model="guard-1")
            return order["refund"] == "approved"

        order = await ctx.step("look up the order", look_up)
        await ctx.step("check the refund policy", check_policy, order)
        words = REPLY if message.get("long") else REPLY[:9]
        for i, word in enumerate(words):
            await ctx.emit(word if i == 0 else " " + word)
            if message.get("long") and i == 17:
                await state.words.wait()  # held part-written for its picture
        return {"words": len(words)}


async def take(
    driver: webdriver.Chrome,
    base: str,
    path: str | None,
    name: str,
    ready: str,
    *,
    height: int = 900,
) -> None:
    """Open ``path`` (None: stay on the page), wait until ``ready`` (a JS expression) holds,
    save ``name``.png, ``height`` pixels tall."""
    await asyncio.to_thread(driver.set_window_size, 1280, height)
    if path is not None:
        await asyncio.to_thread(driver.get, base + path)

    async def shown() -> bool:
        return bool(await asyncio.to_thread(driver.execute_script, f"return {ready};"))

    await wait_until(shown, 20, f"{name}: {ready}")
    target = OUT / f"{name}.png"
    assert await asyncio.to_thread(driver.save_screenshot, str(target)), target
    print(f"wrote {target.relative_to(ROOT)}")


async def photograph(base: str, ids: dict[str, Any], profile: Path) -> None:
    driver = open_chromium(profile, window=WINDOW)
    try:
        await take(driver, base, "/", "overview", "document.querySelector('#workers') !== null")
        await take(
            driver,
            base,
            "/tasks",
            "tasks",
            "document.querySelectorAll('#task-table tr[data-task]').length > 20",
        )
        await take(
            driver,
            base,
            f"/tasks/{ids['failed']}?queue={TRIAGE}",
            "task-failed",
            "document.querySelector('#traceback') !== null",
            height=1700,
        )
        await take(
            driver,
            base,
            f"/tasks/{ids['streaming']}?queue={CHAT}",
            "task-streaming",
            "(document.querySelector('#stream').dataset.chunks || 0) >= 18",
        )
        await asyncio.to_thread(
            driver.get, f"{base}/dead-letters?queue={TRIAGE}&error_type=RateLimitError&since=1h"
        )

        def preview() -> None:
            driver.find_element(By.ID, "all-matching").click()
            driver.find_element(By.ID, "preview-requeue").click()

        await asyncio.to_thread(preview)
        await take(
            driver,
            base,
            None,
            "dead-letters",
            "document.querySelectorAll('#preview-table tbody tr').length > 0",
        )
    finally:
        driver.quit()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    settings = Settings(
        amqp_url=os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
        redis_url=os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0"),
        worker_beat_s=0.5,
    )
    state = State()
    apps = [App(name, settings=settings) for name in ("support-bot", "support-bot-worker")]
    for app in apps:
        register(app, state)
    console_app, worker_app = apps
    ids: dict[str, Any] = {}
    worker = Worker(worker_app, concurrency=4)
    running = asyncio.create_task(worker.run())
    try:
        await worker.ready.wait()
        publish = console_app.publish
        done = [
            await publish(TRIAGE, {"customer": f"c{i % 5}", "text": "refund?"}) for i in range(14)
        ]
        done += [
            await publish(CHAT, {"text": "Where is my refund?"}, session_id=f"user-{i}")
            for i in range(5)
        ]
        rated = [await publish(TRIAGE, {"customer": "c9", "fail": "rate"}) for _ in range(4)]
        empty = [await publish(TRIAGE, {"customer": "c8", "fail": "empty"}) for _ in range(2)]
        for task_id in [*done, *rated, *empty]:
            await console_app.result(task_id, timeout_s=30)
        ids["failed"] = rated[0]
        ids["streaming"] = await publish(
            CHAT, {"text": "Where is my refund?", "long": True}, session_id="user-42"
        )
        held = [await publish(TRIAGE, {"customer": "c1", "hold": True}) for _ in range(2)]

        async def all_running() -> bool:
            states = [await console_app.status(t) for t in held]
            return all(s is not None and s.status is TaskStatus.RUNNING for s in states)

        await wait_until(all_running, 20, "the held tasks to run")
        with tempfile.TemporaryDirectory() as profile:
            async with serving(create_console(console_app)) as base:  # type: ignore[arg-type]
                await photograph(base, ids, Path(profile))
    finally:
        state.hold.set()
        state.words.set()
        worker.stop()
        await running
        names = [
            n
            for app in apps
            for spec in app.handlers.values()
            for n, _ in queue_declarations(spec.queue_spec())
        ]
        for app in apps:
            await app.close()
        await delete_queues(settings.amqp_urls()[0], sorted(set(names)))
        await forget_task_keys(settings.redis_url_plain(), [TRIAGE, CHAT])


if __name__ == "__main__":
    asyncio.run(main())

"""The web console served for real (uvicorn on a free port, in the test's event loop) over an
App whose handler does what each task asks, beside a real Worker on the shared broker and
Redis: for the console's browser and HTTP tests, and the screenshots.

The handler (``Scenario``) is steered by the payload: ``ok`` returns an echo, ``fail``
raises the named error (no retries: it is dead-lettered at once), ``fail_once`` fails its
first run with a ``RateLimitError`` and succeeds once requeued, ``hold`` waits for the gate
it names, ``stream`` emits its words one by one, each after the test opens its gate, so
a test sees a reply part-written without sleeping, and ``steps`` records two memoized steps
(``ctx.step``) and fails its first run like ``fail_once``, so a requeued run replays them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.integration.live_server import serving
from weclaw_mq import App, Context, RetryPolicy, Worker
from weclaw_mq.console import Access, create_console

NO_RETRIES = RetryPolicy(max_retries=0, delay_s=0.05)
# Short beats: the overview shows a worker a fraction of a second after it starts.
BEAT_S = 0.2


class RateLimitError(Exception):
    """What an upstream model's 429 looks like to a handler."""


class UpstreamBroke(Exception):
    """Any other failure."""


ERRORS: dict[str, type[Exception]] = {
    "RateLimitError": RateLimitError,
    "UpstreamBroke": UpstreamBroke,
}


@dataclass
class Scenario:
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    # Every real call of a "steps" task's step functions: "<task id> <step>".
    step_calls: list[str] = field(default_factory=list)

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def open(self, name: str) -> None:
        self.gate(name).set()

    def register(self, app: App, queue: str) -> None:
        @app.handler(queue, retry=NO_RETRIES)
        async def console_task(task: dict[str, Any], ctx: Context) -> Any:
            mode = task.get("mode", "ok")
            if mode == "stream":
                for i, word in enumerate(task["words"]):
                    await ctx.emit(word if i == 0 else " " + word)
                    await self.gate(f"{ctx.task_id}:{i}").wait()
                return {"words": len(task["words"])}
            if mode == "steps":
                return await self.steps(task, ctx)
            if mode == "fail":
                raise ERRORS[task["error"]](task.get("message", "upstream said no"))
            if mode == "fail_once" and ctx.task_id not in self.failed:
                self.failed.add(ctx.task_id)
                raise RateLimitError("429 Too Many Requests from the model")
            if mode == "hold":
                await self.gate(task["gate"]).wait()
            return {"echo": task.get("text", "")}

    async def steps(self, task: dict[str, Any], ctx: Context) -> Any:
        def plan() -> list[str]:
            self.step_calls.append(f"{ctx.task_id} plan")
            return ["look", "answer"]

        async def call() -> str:
            self.step_calls.append(f"{ctx.task_id} call")
            ctx.usage(input_tokens=12, output_tokens=30, model="m-1")
            return "a reply"

        planned = await ctx.step("plan", plan)
        reply = await ctx.step("call", call)
        if ctx.task_id not in self.failed:
            self.failed.add(ctx.task_id)
            raise RateLimitError("429 Too Many Requests from the model")
        return {"plan": planned, "reply": reply}


@dataclass
class LiveConsole:
    """The served console (``client`` has its base URL), the App it shows, a publisher App,
    the test's queue, and the handler's scenario."""

    base_url: str
    client: httpx.AsyncClient
    console_app: App
    publisher: App
    worker_app: App
    queue: str
    scenario: Scenario
    start_worker: Callable[..., Any]

    async def publish(self, payload: dict[str, Any], **kwargs: Any) -> str:
        return await self.publisher.publish(self.queue, payload, **kwargs)

    async def start(self) -> Worker:
        """A worker (an App of its own, as in production) on the test's queue."""
        worker: Worker = await self.start_worker(self.worker_app, concurrency=4)
        return worker


@pytest.fixture
def console_access() -> Access:
    """The console's access rules: none (a test parametrizes ``console_access`` for others)."""
    return Access()


@pytest.fixture
def console_trace_url() -> str | None:
    """Where trace ids link to: nowhere (a test parametrizes ``console_trace_url``)."""
    return None


@pytest.fixture
async def live_console(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    console_access: Access,
    console_trace_url: str | None,
) -> AsyncIterator[LiveConsole]:
    """The console of an app on ``qname``, its queues declared, no worker yet."""
    access = console_access
    scenario = Scenario()
    console_app = make_app("console", worker_beat_s=BEAT_S)
    scenario.register(console_app, qname)
    publisher = make_app("console-publisher")
    scenario.register(publisher, qname)
    worker_app = make_app("console-worker", worker_beat_s=BEAT_S)
    scenario.register(worker_app, qname)
    await console_app.declare()
    async with (
        serving(create_console(console_app, access, trace_url=console_trace_url)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        try:
            yield LiveConsole(
                base_url,
                client,
                console_app,
                publisher,
                worker_app,
                qname,
                scenario,
                start_worker,
            )
        finally:
            for gate in scenario.gates.values():  # no handler left waiting at teardown
                gate.set()

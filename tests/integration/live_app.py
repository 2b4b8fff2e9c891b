"""The example API (``producers.api``) served for real beside a demo worker, for the tests of
its event endpoints and of its web page: real broker, real Redis, a real HTTP server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from consumers import demo
from producers.api import create_app
from producers.sse import EventStreams
from tests.integration.live_server import serving
from weclaw_mq import App
from weclaw_mq.contract.naming import inbox_key, inbox_trace_key


@dataclass
class LiveApi:
    """The served API (``client`` has its base URL), the worker's App, the API's event
    streams (their bounds and counts), and the sessions to clean up (tasks are: make_app
    deletes their records and streams with their queue)."""

    base_url: str
    client: httpx.AsyncClient
    worker_app: App
    queue: str
    streams: EventStreams
    sessions: list[str] = field(default_factory=list)

    async def post(self, text: str, *, session_id: str | None = None) -> str:
        """POST /tasks; the task id."""
        headers = {"Session-Id": session_id} if session_id is not None else {}
        response = await self.client.post("/tasks", json={"text": text}, headers=headers)
        assert response.status_code == 202, response.text
        task_id: str = response.json()["task_id"]
        return task_id

    def session(self, name: str) -> str:
        """A session id of this test's own (its inbox is deleted at teardown)."""
        session_id = f"{name}-{self.queue}"
        self.sessions.append(session_id)
        return session_id


@pytest.fixture
def steady_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in model never fails and answers quickly (tests may set a slower pace)."""
    monkeypatch.setenv("DEMO_LLM_FAILURE_RATE", "0")
    monkeypatch.setenv("DEMO_LLM_LATENCY_S", "0.01")
    monkeypatch.setenv("DEMO_LLM_WORD_S", "0.002")


@pytest.fixture
async def live_api(
    steady_llm: None,
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    redis_url: str,
) -> AsyncIterator[LiveApi]:
    """The API on a free port (its own App, as in production: a web process beside worker
    processes), and a demo worker on the same queue with an App of its own."""
    api_app = make_app("demo-api")
    demo.register(api_app, queue=qname)
    worker_app = make_app("demo-worker")
    demo.register(worker_app, queue=qname)
    live: LiveApi | None = None
    api = create_app(api_app)
    try:
        async with serving(api) as base_url:
            await start_worker(worker_app)
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                live = LiveApi(base_url, client, worker_app, qname, api.state.event_streams)
                yield live
    finally:
        if live is not None:
            await forget_sessions(redis_url, live.sessions)


async def forget_sessions(redis_url: str, sessions: list[str]) -> None:
    """Delete the sessions' inboxes and their traces."""
    keys = [k for s in sessions for k in (inbox_key(s), inbox_trace_key(s))]
    if not keys:
        return
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.delete(*keys)
    finally:
        await client.aclose()

"""The example API served for real (uvicorn on a free port, in the test's event loop), and a
small Server-Sent Events reader on httpx for the tests of its ``/events`` endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from tests.conftest import wait_until

SERVER_START_TIMEOUT_S = 10.0


@contextlib.asynccontextmanager
async def serving(api: FastAPI) -> AsyncIterator[str]:
    """``api`` served by uvicorn on 127.0.0.1 and a free port; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # Open event streams do not hold the shutdown: they are cancelled after a second.
    config = uvicorn.Config(api, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    try:

        def started() -> bool:
            if serve.done():
                serve.result()  # raises why uvicorn stopped
                raise AssertionError("uvicorn stopped before it started serving")
            return server.started

        await wait_until(started, SERVER_START_TIMEOUT_S, "uvicorn to serve")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serve
        sock.close()


@dataclass(frozen=True)
class Frame:
    """One SSE event: its ``id``, ``event`` name and ``data`` (parsed JSON)."""

    id: str
    event: str
    data: Any


async def frames(response: httpx.Response) -> AsyncIterator[Frame]:
    """The events of an SSE response as they arrive (comments and ``retry:`` skipped)."""
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line == "":
            if "data" in fields:
                yield Frame(
                    fields.get("id", ""), fields.get("event", "message"), json.loads(fields["data"])
                )
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


async def read_events(
    client: httpx.AsyncClient,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
    until_finals: int | None = None,
    limit: int | None = None,
    timeout_s: float = 20.0,
) -> list[Frame]:
    """GET ``url`` as SSE and collect its events until the response ends, or until
    ``until_finals`` "final" events or ``limit`` events were read (then it disconnects)."""
    got: list[Frame] = []
    finals = 0
    async with asyncio.timeout(timeout_s):
        async with client.stream("GET", url, headers=headers, params=params) as response:
            assert response.status_code == 200, (await response.aread()).decode()
            assert response.headers["content-type"].startswith("text/event-stream")
            async for frame in frames(response):
                got.append(frame)
                finals += frame.event == "final"
                if finals == until_finals or len(got) == limit:
                    break
    return got

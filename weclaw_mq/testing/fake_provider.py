"""A local stand-in for a model provider that behaves like one, for tests of token limits:
per-model token and request limits over a sliding window, 429 with ``Retry-After`` past them,
tokens charged by text length, a bill, and a switch to take a model down. Served by uvicorn
(the ``testing`` extra) on a free port of 127.0.0.1 inside the caller's event loop; nothing
leaves the machine.

    provider = FakeProvider({"small": ModelLimits(tokens=90_000, requests=500, window_s=60)})
    async with serving(provider) as base_url:
        ...  # handlers call f"{base_url}/v1/complete"; provider.refused counts the 429s

    POST /v1/complete  {"model", "prompt", "max_tokens", "tenant"?}
      200 {"text", "usage": {"input_tokens", "output_tokens"}}
      429 {"error": "rate_limited"} + Retry-After (whole seconds, rounded up)
      503 {"error": "down"} while the model is down
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

CHARS_PER_TOKEN = 4


def tokens_of(text: str) -> int:
    """What the provider charges for ``text``: its length over 4, at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


@dataclass
class ModelLimits:
    """What the provider allows one model per sliding window of ``window_s`` seconds."""

    tokens: int
    requests: int
    window_s: float


@dataclass
class FakeProvider:
    """The provider's state: its limits per model, what it served, what it refused."""

    limits: dict[str, ModelLimits]
    # (time, tokens) of each served call per model, within the window.
    served: dict[str, deque[tuple[float, int]]] = field(default_factory=lambda: defaultdict(deque))
    bill: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    refused: int = 0  # 429s
    calls: int = 0
    down: set[str] = field(default_factory=set)
    # The most tokens served in any window, per model (checked at each call).
    peak_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def _window(self, model: str, now: float) -> deque[tuple[float, int]]:
        log = self.served[model]
        limit = self.limits[model]
        while log and log[0][0] <= now - limit.window_s:
            log.popleft()
        return log

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], float | None]:
        """(status, response body, Retry-After seconds or None) for one call."""
        self.calls += 1
        model = body["model"]
        if model in self.down:
            return 503, {"error": "down"}, None
        prompt_tokens = tokens_of(body["prompt"])
        output_tokens = int(body.get("max_tokens", 16))
        cost = prompt_tokens + output_tokens
        now = time.monotonic()
        log = self._window(model, now)
        limit = self.limits[model]
        used = sum(t for _, t in log)
        if len(log) >= limit.requests or used + cost > limit.tokens:
            self.refused += 1
            # When enough of the window has left for this call to fit.
            left, wait = used, limit.window_s
            for at, tokens in log:
                left -= tokens
                if left + cost <= limit.tokens:
                    wait = at + limit.window_s - now
                    break
            return 429, {"error": "rate_limited"}, max(wait, 0.0)
        log.append((now, cost))
        self.peak_tokens[model] = max(self.peak_tokens[model], used + cost)
        self.bill[(model, str(body.get("tenant", "")))] += cost
        usage = {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
        return 200, {"text": "x" * output_tokens * CHARS_PER_TOKEN, "usage": usage}, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope["path"] != "/v1/complete" or scope["method"] != "POST":
            status, body, retry = 404, {"error": "not found"}, None
        else:
            status, body, retry = self.complete(json.loads(b"".join(chunks)))
        headers = [(b"content-type", b"application/json")]
        if retry is not None:
            headers.append((b"retry-after", str(math.ceil(retry)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@contextlib.asynccontextmanager
async def serving(provider: FakeProvider) -> AsyncIterator[str]:
    """Serve ``provider`` on a free port of 127.0.0.1; its base URL while inside."""
    import uvicorn  # the testing extra; imported only to serve

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(provider, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()

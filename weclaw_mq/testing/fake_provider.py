"""A local stand-in for a model provider that behaves like one, for tests of token limits and
costs: per-model token and request limits over a sliding window, 429 with ``Retry-After``
past them, tokens charged by text length, a bill (per model and tenant, and per task), a
streamed answer that continues from a prefix, and a switch to take a model down. Served by
uvicorn (the ``testing`` extra) on a free port of 127.0.0.1 inside the caller's event loop;
nothing leaves the machine.

    provider = FakeProvider({"small": ModelLimits(tokens=90_000, requests=500, window_s=60)})
    async with serving(provider) as base_url:
        ...  # handlers call f"{base_url}/v1/complete"; provider.refused counts the 429s

    POST /v1/complete  {"model", "prompt", "max_tokens", "tenant"?, "task"?}
      200 {"text", "usage": {"input_tokens", "output_tokens"}}
      429 {"error": "rate_limited"} + Retry-After (whole seconds, rounded up)
      503 {"error": "down"} while the model is down
    POST /v1/stream    {"model", "prompt", "max_tokens", "tenant"?, "task"?, "prefix"?}
      200 one JSON line per token {"text"}, then {"usage": {"input_tokens", "output_tokens"}}
      (429 and 503 as above)

The answer to a prompt is ``answer(max_tokens)``, the same every time, one 4-character token
after another. A stream with a ``prefix`` (the start of that answer, as a caller re-started
after a crash has it) continues after it: the prefix is billed as input, and only the tokens
after it as output. Tokens are billed as they are answered: a completion's when it is
answered, a stream's one by one as they are sent; a call whose client left before its answer
(``hold``) is not billed, and a stream stops billing when its client leaves.
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


def answer_tokens(max_tokens: int) -> list[str]:
    """The answer's tokens (4 characters each: ``"000 "``, ``"001 "``...), the same each time."""
    return [f"{i % 1000:03d} " for i in range(max_tokens)]


def answer(max_tokens: int) -> str:
    """The provider's whole answer of ``max_tokens`` tokens."""
    return "".join(answer_tokens(max_tokens))


@dataclass
class ModelLimits:
    """What the provider allows one model per sliding window of ``window_s`` seconds."""

    tokens: int
    requests: int
    window_s: float


@dataclass
class Billed:
    """The tokens billed for one task (its calls' ``"task"``)."""

    input_tokens: int = 0
    output_tokens: int = 0
    calls: int = 0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass
class Hold:
    """A held call (``FakeProvider.hold``): ``arrived`` once it came, ``dropped`` once its
    client left without its answer (not billed); ``release`` lets it be answered."""

    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class FakeProvider:
    """The provider's state: its limits per model, what it served, what it refused.

    ``stream_token_s``: how long a stream takes per token (a generation's pace).
    """

    limits: dict[str, ModelLimits]
    # (time, tokens) of each served call per model, within the window.
    served: dict[str, deque[tuple[float, int]]] = field(default_factory=lambda: defaultdict(deque))
    bill: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    refused: int = 0  # 429s
    calls: int = 0
    down: set[str] = field(default_factory=set)
    # The most tokens served in any window, per model (checked at each call).
    peak_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    stream_token_s: float = 0.0
    # Billed per task (a call's "task"); a call without one is on the "" line.
    billed: dict[str, Billed] = field(default_factory=lambda: defaultdict(Billed))
    # Calls that came per task, billed or not (a held call's number counts them).
    arrived: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    holds: dict[tuple[str, int], Hold] = field(default_factory=dict)

    def billed_for(self, task_id: str) -> Billed:
        """What the provider billed for ``task_id``'s calls so far."""
        return self.billed.get(task_id, Billed())

    def hold(self, task_id: str, call: int) -> Hold:
        """Hold ``task_id``'s ``call``-th call (1 = its first) before it is answered."""
        held = self.holds[(task_id, call)] = Hold()
        return held

    def _window(self, model: str, now: float) -> deque[tuple[float, int]]:
        log = self.served[model]
        limit = self.limits[model]
        while log and log[0][0] <= now - limit.window_s:
            log.popleft()
        return log

    def _charge(self, body: dict[str, Any], input_tokens: int, output_tokens: int) -> None:
        self.bill[(body["model"], str(body.get("tenant", "")))] += input_tokens + output_tokens
        billed = self.billed[str(body.get("task", ""))]
        billed.input_tokens += input_tokens
        billed.output_tokens += output_tokens

    def _admitted(
        self, body: dict[str, Any], input_tokens: int, output_tokens: int
    ) -> tuple[int, dict[str, Any], float | None] | None:
        """None when the call may be served now (counted in its window), else the refusal."""
        self.calls += 1
        model = body["model"]
        if model in self.down:
            return 503, {"error": "down"}, None
        cost = input_tokens + output_tokens
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
        return None

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], float | None]:
        """(status, response body, Retry-After seconds or None) for one call."""
        prompt_tokens = tokens_of(body["prompt"])
        output_tokens = int(body.get("max_tokens", 16))
        refused = self._admitted(body, prompt_tokens, output_tokens)
        if refused is not None:
            return refused
        self._charge(body, prompt_tokens, output_tokens)
        self.billed[str(body.get("task", ""))].calls += 1
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
        streamed = scope["path"] == "/v1/stream"
        if scope["method"] != "POST" or scope["path"] not in ("/v1/complete", "/v1/stream"):
            await _respond(send, 404, {"error": "not found"}, None)
            return
        body = json.loads(b"".join(chunks))
        task = str(body.get("task", ""))
        self.arrived[task] += 1
        # The client leaving ends the receive (uvicorn answers "http.disconnect").
        left = asyncio.ensure_future(receive())
        try:
            held = self.holds.get((task, self.arrived[task]))
            if held is not None:
                held.arrived.set()
                release = asyncio.ensure_future(held.release.wait())
                await asyncio.wait({left, release}, return_when=asyncio.FIRST_COMPLETED)
                release.cancel()
                if left.done():  # its client is gone: nothing answered, nothing billed
                    held.dropped.set()
                    return
            if streamed:
                await self._stream(body, send, left)
            else:
                await _respond(send, *self.complete(body))
        finally:
            left.cancel()

    async def _stream(self, body: dict[str, Any], send: Send, left: asyncio.Future[Any]) -> None:
        """The answer after ``prefix``, a token a line, billed as each is sent."""
        prefix = str(body.get("prefix", ""))
        tokens = answer_tokens(int(body.get("max_tokens", 16)))
        done = tokens_of(prefix) if prefix else 0
        input_tokens = tokens_of(body["prompt"]) + done
        refused = self._admitted(body, input_tokens, len(tokens) - done)
        if refused is not None:
            await _respond(send, *refused)
            return
        self._charge(body, input_tokens, 0)
        self.billed[str(body.get("task", ""))].calls += 1
        headers = [(b"content-type", b"application/x-ndjson")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        sent = 0
        for token in tokens[done:]:
            if self.stream_token_s:
                await asyncio.sleep(self.stream_token_s)  # the generation's pace
            if left.done():  # the client left: the generation stops, unbilled from here
                return
            line = json.dumps({"text": token}).encode() + b"\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})
            self._charge(body, 0, 1)
            sent += 1
        usage = {"input_tokens": input_tokens, "output_tokens": sent}
        await send({"type": "http.response.body", "body": json.dumps({"usage": usage}).encode()})


async def _respond(send: Send, status: int, body: dict[str, Any], retry: float | None) -> None:
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

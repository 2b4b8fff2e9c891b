"""The example API's request size limit, enforced while the body arrives.

FastAPI reads a whole body before any handler can look at its size, so a 200 MB body costs
200 MB (and more, while it is parsed) before the 1 MiB check refuses it. ``BodyLimit`` sits
in front of the app: a ``Content-Length`` over the limit is answered 413 before a byte of
the body is read, and a body without one (chunked) is counted as it arrives and answered
413 as soon as it passes the limit. Either way the server holds at most the limit plus one
read (uvicorn stops reading the socket past 64 KiB unread), and the connection is closed,
so the rest of the body is never read.

A body within the limit is read here in full and handed to the app as one message (the
app would read all of it anyway: a JSON body is parsed whole). Recent FastAPI releases have
a ``max_body_size`` of their own; this one works on every version ``pyproject.toml`` allows
and answers in the API's JSON shape, naming the setting.
"""

from __future__ import annotations

from typing import Any

import pydantic_core
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``; ``what`` names the
    setting behind the limit in the answer."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, what: str) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.what = what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nobody to answer
            body: bytes = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send, None)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks)}
        chunks.clear()

        async def replay() -> Message:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: the client's disconnect, for streams

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, declared: int | None) -> None:
        size = f" of {declared} bytes" if declared is not None else ""
        detail = (
            f"the request body{size} is over the limit of {self.max_bytes} bytes "
            f"({self.what}); store large inputs elsewhere and send a reference"
        )
        body = pydantic_core.to_json({"detail": detail})
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            # The rest of the body is never read: the connection cannot carry another request.
            (b"connection", b"close"),
        ]
        start: dict[str, Any] = {"type": "http.response.start", "status": 413, "headers": headers}
        await send(start)
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before the app is called
    return None

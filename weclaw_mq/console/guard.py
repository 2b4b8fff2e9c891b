"""The console's one door: an ASGI middleware every request passes before any page or API
runs, applying ``access``: the host check, the token (Bearer header, throttled per client
after wrong ones, or a live session's cookie: ``sessions``), and for a mutating request
read-only, same origin and CSRF. A refused mutation is written to the audit log too. The
pages add their own security headers (``pages.SECURITY_HEADERS``).
"""

from __future__ import annotations

import math
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from weclaw_mq.console.access import (
    ANONYMOUS,
    CSRF_HEADER,
    SESSION_COOKIE,
    Access,
    mutation_refusal,
)
from weclaw_mq.console.audit import audit
from weclaw_mq.console.sessions import Sessions, Throttle

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Served without the token: the login form, and the package's own static assets.
OPEN_PATHS = ("/login", "/static/")


def client_of(request: Request) -> str:
    return request.client.host if request.client is not None else "-"


def who(identity: str) -> str:
    """The audit log's name of a caller: ``token:<fingerprint>`` or ``anonymous``."""
    return identity if identity == "anonymous" else f"token:{identity}"


def _refused(
    request: Request, status: int, message: str, headers: dict[str, str] | None = None
) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    return PlainTextResponse(message, status_code=status, headers=headers)


def throttled(wait_s: float) -> tuple[str, dict[str, str]]:
    """The 429's message and its ``Retry-After``, for a client that must wait ``wait_s``."""
    seconds = max(1, math.ceil(wait_s))
    return (
        f"too many wrong tokens from this address: try again in {seconds} s",
        {"retry-after": str(seconds)},
    )


class Guard:
    """Checks each HTTP request against ``access``; sets ``request.state.identity`` (the
    caller's fingerprint or "anonymous") and ``request.state.csrf`` for the pages."""

    def __init__(
        self, app: ASGIApp, access: Access, sessions: Sessions, throttle: Throttle
    ) -> None:
        self.app = app
        self.access = access
        self.sessions = sessions
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        response = self.check(request)
        if response is not None:
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def check(self, request: Request) -> Response | None:
        """The refusal to send, or None to let the request through."""
        access = self.access
        host = request.headers.get("host")
        if not access.host_allowed(host):
            return _refused(request, 403, "this console serves only 127.0.0.1/localhost")
        path = request.url.path
        if path == "/login" or path.startswith("/static/"):
            return None
        authorization = request.headers.get("authorization", "")
        bearer = authorization[7:].strip() if authorization.lower().startswith("bearer ") else None
        if access.token is None:
            identity: str | None = ANONYMOUS
        elif bearer is not None:
            client = client_of(request)
            wait_s = self.throttle.admit(client)
            if wait_s > 0:  # its token is not even compared: no oracle while throttled
                message, headers = throttled(wait_s)
                return _refused(request, 429, message, headers)
            identity = access.identity(bearer)
            if identity is None:
                self.throttle.failed(client)
        else:
            identity = self.sessions.identity_of(request.cookies.get(SESSION_COOKIE))
        if identity is None:
            if request.method in SAFE_METHODS and not path.startswith("/api/"):
                target = path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)
            return _refused(request, 401, "the console needs its token (--token)")
        request.state.identity = identity
        request.state.csrf = access.csrf_value(identity)
        if request.method in SAFE_METHODS:
            return None
        refusal = mutation_refusal(
            access,
            identity=identity,
            csrf=request.headers.get(CSRF_HEADER),
            origin=request.headers.get("origin"),
            referer=request.headers.get("referer"),
            host=host,
            bearer=bearer is not None,
        )
        if refusal is None:
            return None
        audit(
            client_of(request),
            who(identity),
            f"{request.method} {path}",
            outcome="refused",
            why=refusal,
        )
        return _refused(request, 403, refusal)

"""The sign-in form (``/login``) of a console with a token: it checks the token (a client
that keeps presenting wrong ones is made to wait: ``sessions.Throttle``) and sets the session
cookie (HttpOnly, SameSite=Strict, a random session id that expires: ``sessions.Sessions``),
and signing out (``/api/logout``) revokes the session and deletes the cookie.
``/api/session`` tells a script its CSRF value."""

from __future__ import annotations

import math
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from weclaw_mq.console.access import SESSION_COOKIE, same_origin
from weclaw_mq.console.audit import audit
from weclaw_mq.console.guard import client_of, throttled, who
from weclaw_mq.console.handling import console_of
from weclaw_mq.console.rendering import render


def _next_of(value: str | None) -> str:
    # Only a path of this console: never an open redirect.
    if not value or not value.startswith("/") or value.startswith("//"):
        return "/"
    return value


async def login(request: Request) -> Response:
    console = console_of(request)
    if console.access.token is None:
        return RedirectResponse("/", status_code=303)
    if request.method == "GET":
        return render(request, "login.html", next=_next_of(request.query_params.get("next")))
    origin = same_origin(
        request.headers.get("origin"), request.headers.get("referer"), request.headers.get("host")
    )
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    presented = (form.get("token") or [""])[0]
    target = _next_of((form.get("next") or [""])[0])
    client = client_of(request)
    wait_s = console.throttle.admit(client)
    if wait_s > 0:  # its token is not even compared: no oracle while throttled
        audit(client, "-", "login", outcome="throttled")
        message, headers = throttled(wait_s)
        page = render(request, "login.html", status_code=429, next=target, problem=message)
        page.headers.update(headers)
        return page
    identity = console.access.identity(presented) if origin is not False else None
    if identity is None:
        if origin is not False:  # another site's page posting here must not lock users out
            console.throttle.failed(client)
        audit(client, "-", "login", outcome="refused")
        return render(request, "login.html", status_code=401, next=target, failed=True)
    console.throttle.succeeded(client)
    audit(client, who(identity), "login", outcome="ok")
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        console.sessions.open(identity),
        max_age=math.ceil(console.access.session_ttl_s),
        httponly=True,
        samesite="strict",
        secure=console.access.secure_cookie or request.url.scheme == "https",
        path="/",
    )
    return response


async def session(request: Request) -> Response:
    """Who the caller is and the CSRF value its changes carry: for a script with a Bearer
    token (a page of another site cannot read it: no CORS)."""
    console = console_of(request)
    return JSONResponse(
        {
            "who": who(request.state.identity),
            "csrf": request.state.csrf,
            "read_only": console.access.read_only,
        }
    )


async def logout(request: Request) -> Response:
    """Revoke the caller's session (its cookie no longer signs anyone in) and delete it."""
    console_of(request).sessions.revoke(request.cookies.get(SESSION_COOKIE))
    response = JSONResponse({"ok": True})
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response

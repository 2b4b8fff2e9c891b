"""The sign-in form (``/login``) of a console with a token: it checks the token and sets the
session cookie (HttpOnly, SameSite=Strict, an HMAC of the token, not the token: see
``access``), and signing out (``/api/logout``) deletes it. ``/api/session`` tells a script
its CSRF value."""

from __future__ import annotations

from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from weclaw_mq.console.access import SESSION_COOKIE, same_origin
from weclaw_mq.console.audit import audit
from weclaw_mq.console.guard import client_of, who
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
    identity = console.access.identity(presented) if origin is not False else None
    if identity is None:
        audit(client_of(request), "-", "login", outcome="refused")
        return render(request, "login.html", status_code=401, next=target, failed=True)
    audit(client_of(request), who(identity), "login", outcome="ok")
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        console.access.session_value() or "",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
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
    response = JSONResponse({"ok": True})
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response

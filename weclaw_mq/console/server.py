"""The console's Starlette application: its pages, the JSON and fragment endpoints their
script polls, the task stream as Server-Sent Events, and the actions.

Every request passes ``guard.Guard`` first (token, host, read-only, same origin, CSRF); every
action that changes something writes one audit line (``audit``). The pages are the same
templates whether loaded whole or refreshed in part: a ``/fragments/...`` endpoint renders
the part of a page its script swaps in, so there is one rendering of each table.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlencode

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from weclaw_mq.app import App
from weclaw_mq.console import detail as details
from weclaw_mq.console import task_views
from weclaw_mq.console.access import SESSION_COOKIE, Access, same_origin
from weclaw_mq.console.audit import audit
from weclaw_mq.console.dead_letters import (
    ACTIONS,
    EXACT_MAX,
    SHOWN_MAX,
    DeadLetters,
    Job,
    filter_of,
    row,
)
from weclaw_mq.console.events import relay
from weclaw_mq.console.guard import Guard, client_of, who
from weclaw_mq.console.overview import Overview
from weclaw_mq.console.rendering import SECURITY_HEADERS, render
from weclaw_mq.contract import headers as h
from weclaw_mq.errors import ConfigurationError, WeclawMQError
from weclaw_mq.state import TaskStatus

# How often the pages poll their fragment (ms): the overview, the tasks, a running task.
REFRESH_MS = 2000


@dataclass
class Console:
    """What the routes share: the user's App, the access rules, the cached overview and the
    dead-letter previews and jobs."""

    app: App
    access: Access
    overview: Overview = field(init=False)
    dead_letters: DeadLetters = field(init=False)

    def __post_init__(self) -> None:
        self.overview = Overview(self.app)
        self.dead_letters = DeadLetters(self.app)


def _console(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def _who(request: Request) -> tuple[str, str]:
    return client_of(request), who(request.state.identity)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=SECURITY_HEADERS)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ConfigurationError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ConfigurationError("the request body is not a JSON object")
    return body


# -- login ---------------------------------------------------------------------------------


def _next_of(value: str | None) -> str:
    # Only a path of this console: never an open redirect.
    if not value or not value.startswith("/") or value.startswith("//"):
        return "/"
    return value


async def login(request: Request) -> Response:
    console = _console(request)
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


async def logout(request: Request) -> Response:
    response = JSONResponse({"ok": True})
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


# -- overview ------------------------------------------------------------------------------


async def overview_page(request: Request) -> Response:
    document = await _console(request).overview.document()
    return render(request, "overview.html", o=document, refresh_ms=REFRESH_MS)


async def overview_fragment(request: Request) -> Response:
    document = await _console(request).overview.document()
    return render(request, "overview_body.html", o=document)


async def overview_json(request: Request) -> Response:
    return JSONResponse(await _console(request).overview.document())


# -- tasks ---------------------------------------------------------------------------------


async def _task_page(request: Request) -> dict[str, Any]:
    params = dict(request.query_params)
    filters = {name: params[name] for name in task_views.FIELDS if params.get(name)}
    context: dict[str, Any] = {
        "params": {name: params.get(name, "") for name in task_views.FIELDS},
        "queues": list(_console(request).app.handlers),
        "statuses": [s.value for s in TaskStatus],
        "cursor": params.get("cursor", ""),
        "rows": [],
        "next_cursor": None,
        "scanned": 0,
        "problem": None,
        "newest_href": "/tasks?" + urlencode(filters),
        "older_href": None,
        "fragment_href": "/fragments/tasks?" + urlencode(dict(params)),
    }
    try:
        page = await task_views.tasks(_console(request).app, task_views.query_of(params))
    except WeclawMQError as e:
        context["problem"] = str(e)
        return context
    context["rows"] = [task_views.task_row(t) for t in page.tasks]
    context["next_cursor"] = page.next_cursor
    context["scanned"] = page.scanned
    if page.next_cursor:
        context["older_href"] = "/tasks?" + urlencode({**filters, "cursor": page.next_cursor})
    return context


async def tasks_page(request: Request) -> Response:
    context = await _task_page(request)
    return render(request, "tasks.html", refresh_ms=REFRESH_MS, **context)


async def tasks_fragment(request: Request) -> Response:
    return render(request, "tasks_body.html", **await _task_page(request))


async def tasks_json(request: Request) -> Response:
    context = await _task_page(request)
    if context["problem"] is not None:
        return _error(400, context["problem"])
    return JSONResponse(
        {
            "tasks": context["rows"],
            "next_cursor": context["next_cursor"],
            "scanned": context["scanned"],
        }
    )


# -- one task ------------------------------------------------------------------------------


def _task_of(request: Request) -> tuple[App, str, str | None]:
    """The App, the task id of the path and the ``queue`` of the query (None: any)."""
    app = _console(request).app
    return app, request.path_params["task_id"], request.query_params.get("queue") or None


async def _timeline(app: App, task_id: str, queue: str | None) -> tuple[list[Any], str | None]:
    try:
        events = await task_views.timeline(app, task_id, queue)
    except WeclawMQError as e:
        return [], str(e)
    return [task_views.event_row(e) for e in events], None


async def task_page(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    found = await details.detail(app, task_id, queue)
    timeline, timeline_problem = await _timeline(app, task_id, found.queue)
    dead_headers = found.dead.headers if found.dead is not None else {}
    return render(
        request,
        "task.html",
        d=found,
        state=details.state_document(found.state),
        timeline=timeline,
        timeline_problem=timeline_problem,
        body=details.body_text(found.dead) if found.dead is not None else None,
        # The traceback has its own section.
        headers={k: v for k, v in sorted(dead_headers.items()) if k != h.ERROR_TRACEBACK},
        refresh_ms=REFRESH_MS,
    )


async def task_fragment(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    state, problem = await details.status_of(app, task_id, queue)
    if queue is None and state is not None:
        queue = state.queue
    timeline, timeline_problem = await _timeline(app, task_id, queue)
    return render(
        request,
        "task_status.html",
        task_id=task_id,
        state=details.state_document(state),
        problem=problem,
        timeline=timeline,
        timeline_problem=timeline_problem,
    )


async def task_json(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    state, problem = await details.status_of(app, task_id, queue)
    if problem is not None:
        return _error(503, problem)
    return JSONResponse({"task_id": task_id, "state": details.state_document(state)})


async def task_stream(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    after = request.headers.get("last-event-id") or request.query_params.get("after") or None
    if queue is not None and queue not in app.handlers:
        return _error(400, f"{queue!r} is not a handler queue of app {app.name!r}")
    return StreamingResponse(
        relay(app, task_id, queue=queue, after=after),
        media_type="text/event-stream",
        headers={"cache-control": "no-store", "x-accel-buffering": "no"},
    )


async def cancel_task(request: Request) -> Response:
    app = _console(request).app
    task_id = request.path_params["task_id"]
    body = await _json_body(request)
    queue = body.get("queue") or None
    client, caller = _who(request)
    try:
        done = await details.cancel(app, task_id, queue if isinstance(queue, str) else None)
    except WeclawMQError as e:
        audit(client, caller, "cancel", task_id=task_id, queue=queue, outcome="failed", why=str(e))
        return _error(400, str(e))
    audit(client, caller, "cancel", task_id=task_id, queue=queue, outcome=done["outcome"])
    return JSONResponse(done)


# -- dead letters --------------------------------------------------------------------------

_DLQ_FIELDS = ("task_id", "error_type", "reason", "since", "until")


async def dead_letters_page(request: Request) -> Response:
    console = _console(request)
    params = dict(request.query_params)
    queues = list(console.app.handlers)
    queue = params.get("queue") or (queues[0] if queues else "")
    context: dict[str, Any] = {
        "queues": queues,
        "queue": queue,
        "params": {name: params.get(name, "") for name in _DLQ_FIELDS},
        "rows": [],
        "matched": 0,
        "total": 0,
        "shown_max": SHOWN_MAX,
        "problem": None,
    }
    if queue:
        try:
            seen = await console.dead_letters.look(queue, filter_of(params))
        except WeclawMQError as e:
            context["problem"] = str(e)
        else:
            context.update(
                rows=[row(d) for d in seen.shown], matched=seen.matched, total=seen.total
            )
    return render(request, "dead_letters.html", **context)


async def dead_letters_json(request: Request) -> Response:
    console = _console(request)
    params = dict(request.query_params)
    try:
        seen = await console.dead_letters.look(params.get("queue", ""), filter_of(params))
    except WeclawMQError as e:
        return _error(400, str(e))
    return JSONResponse(
        {"total": seen.total, "matched": seen.matched, "dead_letters": [row(d) for d in seen.shown]}
    )


async def preview(request: Request) -> Response:
    console = _console(request)
    try:
        body = await _json_body(request)
        action = body.get("action")
        if action not in ACTIONS:
            raise ConfigurationError(f"action {action!r} is not one of {', '.join(ACTIONS)}")
        where = filter_of(body)
        made, selected = await console.dead_letters.preview(action, str(body.get("queue")), where)
    except WeclawMQError as e:
        return _error(400, str(e))
    return JSONResponse(
        {
            "preview_id": made.id,
            "action": made.action,
            "queue": made.queue,
            "count": len(made.task_ids),
            "kept": made.kept,
            "exact": made.exact,
            "describe": where.describe() or "every dead letter",
            "dead_letters": [
                {
                    "task_id": d.task_id,
                    "reason": d.reason,
                    "error_type": d.error_type,
                    "error_message": d.error_message,
                    "last_failure_at": (
                        d.last_failure_at.isoformat(timespec="seconds")
                        if d.last_failure_at
                        else None
                    ),
                }
                for d in selected[:EXACT_MAX]  # the rest are counted
            ],
        }
    )


async def run_preview(request: Request) -> Response:
    console = _console(request)
    client, caller = _who(request)

    def ended(job: Job) -> None:
        made = job.preview
        audit(
            client,
            caller,
            f"dlq {job.action}",
            queue=job.queue,
            filter=made.where.describe() or "everything",
            task_ids=list(made.task_ids),
            outcome=job.state,
            **job.summary,
            **({"why": job.error} if job.error else {}),
        )

    preview_id = ""
    try:
        body = await _json_body(request)
        preview_id = str(body.get("preview_id") or "")
        job = console.dead_letters.start(preview_id, on_end=ended)
    except WeclawMQError as e:
        audit(client, caller, "dlq run", preview=preview_id, outcome="refused", why=str(e))
        return _error(400, str(e))
    return JSONResponse(job.document(), status_code=202)


async def job_json(request: Request) -> Response:
    job = _console(request).dead_letters.job(request.path_params["job_id"])
    if job is None:
        return _error(404, "no such job")
    return JSONResponse(job.document())


async def requeue_one(request: Request) -> Response:
    console = _console(request)
    client, caller = _who(request)
    try:
        body = await _json_body(request)
        queue, task_id = str(body.get("queue") or ""), str(body.get("task_id") or "")
        moved = await console.dead_letters.requeue_one(queue, task_id)
    except WeclawMQError as e:
        audit(client, caller, "dlq requeue one", outcome="failed", why=str(e))
        return _error(400, str(e))
    audit(client, caller, "dlq requeue one", queue=queue, task_id=task_id, moved=moved)
    if not moved:
        return _error(404, f"no task {task_id} in {queue}.dlq")
    return JSONResponse({"moved": moved, "queue": queue, "task_id": task_id})


def create_console(app: App, access: Access | None = None) -> Starlette:
    """The console of ``app`` as an ASGI application (serve it with uvicorn).

    Args:
        app: The user's App: its handlers name the queues the console shows.
        access: Token, read-only; default no token and not read-only (serve it on
            127.0.0.1 only: the console then refuses any other ``Host``).

    Returns:
        The Starlette application; ``app`` is closed with it.
    """
    console = Console(app, access or Access())
    static = StaticFiles(directory=str(files("weclaw_mq.console") / "static"))
    routes = [
        Route("/", overview_page),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/tasks", tasks_page),
        Route("/tasks/{task_id}", task_page),
        Route("/dead-letters", dead_letters_page),
        Route("/fragments/overview", overview_fragment),
        Route("/fragments/tasks", tasks_fragment),
        Route("/fragments/tasks/{task_id}", task_fragment),
        Route("/api/overview", overview_json),
        Route("/api/tasks", tasks_json),
        Route("/api/tasks/{task_id}", task_json),
        Route("/api/tasks/{task_id}/stream", task_stream),
        Route("/api/tasks/{task_id}/cancel", cancel_task, methods=["POST"]),
        Route("/api/dead-letters", dead_letters_json),
        Route("/api/dead-letters/preview", preview, methods=["POST"]),
        Route("/api/dead-letters/run", run_preview, methods=["POST"]),
        Route("/api/dead-letters/requeue-one", requeue_one, methods=["POST"]),
        Route("/api/jobs/{job_id}", job_json),
        Route("/api/logout", logout, methods=["POST"]),
        Mount("/static", static, name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await console.dead_letters.wait()
            await app.close()

    web = Starlette(routes=routes, lifespan=lifespan)
    web.state.console = console
    web.add_middleware(Guard, access=console.access)
    return web

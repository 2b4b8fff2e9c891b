"""The pages of the app and its tasks: the overview, the Tasks page (run history), one task
(its record, timeline, dead letter, live output), each with the fragment its script polls and
its JSON; the task's stream as Server-Sent Events, and cancel."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from weclaw_mq.app import App
from weclaw_mq.console import detail as details
from weclaw_mq.console import task_views
from weclaw_mq.console.audit import audit
from weclaw_mq.console.events import relay
from weclaw_mq.console.handling import (
    REFRESH_MS,
    caller_of,
    console_of,
    error_response,
    json_body,
)
from weclaw_mq.console.rendering import render
from weclaw_mq.contract import headers as h
from weclaw_mq.errors import WeclawMQError
from weclaw_mq.state import TaskStatus


async def overview_page(request: Request) -> Response:
    document = await console_of(request).overview.document()
    return render(request, "overview.html", o=document, refresh_ms=REFRESH_MS)


async def overview_fragment(request: Request) -> Response:
    document = await console_of(request).overview.document()
    return render(request, "overview_body.html", o=document)


async def overview_json(request: Request) -> Response:
    return JSONResponse(await console_of(request).overview.document())


# -- tasks ---------------------------------------------------------------------------------


async def _task_page(request: Request) -> dict[str, Any]:
    params = dict(request.query_params)
    filters = {name: params[name] for name in task_views.FIELDS if params.get(name)}
    context: dict[str, Any] = {
        "params": {name: params.get(name, "") for name in task_views.FIELDS},
        "queues": list(console_of(request).app.handlers),
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
        page = await task_views.tasks(console_of(request).app, task_views.query_of(params))
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
        return error_response(400, context["problem"])
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
    app = console_of(request).app
    return app, request.path_params["task_id"], request.query_params.get("queue") or None


async def _timeline_and_steps(
    app: App, task_id: str, queue: str | None
) -> tuple[list[Any], str | None, list[Any], str | None]:
    """The task's timeline and steps as rows, each with why it could not be read."""
    try:
        events = await task_views.timeline(app, task_id, queue)
        problem = None
    except WeclawMQError as e:
        events, problem = [], str(e)
    steps: list[Any] = []
    steps_problem = None
    if queue is not None:
        started = task_views.last_run_started(events)
        try:
            recorded = await task_views.steps(app, task_id, queue)
            steps = [task_views.step_row(s, started, app.prices) for s in recorded]
        except WeclawMQError as e:
            steps_problem = str(e)
    return [task_views.event_row(e) for e in events], problem, steps, steps_problem


async def task_page(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    found = await details.detail(app, task_id, queue)
    timeline, timeline_problem, steps, steps_problem = await _timeline_and_steps(
        app, task_id, found.queue
    )
    dead_headers = found.dead.headers if found.dead is not None else {}
    return render(
        request,
        "task.html",
        d=found,
        state=details.state_document(found.state),
        timeline=timeline,
        timeline_problem=timeline_problem,
        steps=steps,
        steps_problem=steps_problem,
        body=details.body_text(found.dead) if found.dead is not None else None,
        trace_href=details.trace_link(
            console_of(request).trace_url, found.dead.trace_id if found.dead else None
        ),
        # The traceback has its own section.
        headers={k: v for k, v in sorted(dead_headers.items()) if k != h.ERROR_TRACEBACK},
        refresh_ms=REFRESH_MS,
    )


async def task_fragment(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    state, problem = await details.status_of(app, task_id, queue)
    if queue is None and state is not None:
        queue = state.queue
    timeline, timeline_problem, steps, steps_problem = await _timeline_and_steps(
        app, task_id, queue
    )
    return render(
        request,
        "task_status.html",
        task_id=task_id,
        state=details.state_document(state),
        problem=problem,
        timeline=timeline,
        timeline_problem=timeline_problem,
        steps=steps,
        steps_problem=steps_problem,
    )


async def task_json(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    state, problem = await details.status_of(app, task_id, queue)
    if problem is not None:
        return error_response(503, problem)
    queue = state.queue if state is not None else queue
    _, _, steps, _ = await _timeline_and_steps(app, task_id, queue)
    return JSONResponse(
        {"task_id": task_id, "state": details.state_document(state), "steps": steps}
    )


async def task_stream(request: Request) -> Response:
    app, task_id, queue = _task_of(request)
    after = request.headers.get("last-event-id") or request.query_params.get("after") or None
    if queue is not None and queue not in app.handlers:
        return error_response(400, f"{queue!r} is not a handler queue of app {app.name!r}")
    return StreamingResponse(
        relay(app, task_id, queue=queue, after=after),
        media_type="text/event-stream",
        headers={"cache-control": "no-store", "x-accel-buffering": "no"},
    )


async def cancel_task(request: Request) -> Response:
    app = console_of(request).app
    task_id = request.path_params["task_id"]
    client, caller = caller_of(request)
    queue: Any = None
    try:
        queue = (await json_body(request)).get("queue") or None
        done = await details.cancel(app, task_id, queue if isinstance(queue, str) else None)
    except WeclawMQError as e:
        audit(client, caller, "cancel", task_id=task_id, queue=queue, outcome="failed", why=str(e))
        return error_response(400, str(e))
    audit(client, caller, "cancel", task_id=task_id, queue=queue, outcome=done["outcome"])
    return JSONResponse(done)

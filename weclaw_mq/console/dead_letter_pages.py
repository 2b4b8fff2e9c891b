"""The dead-letters page and its actions: a look (as ``dlq list``, each body cut to a
preview), one dead letter's whole body, the dry-run preview of a requeue or purge, its
confirmed run as a background job (and the job's progress), and requeueing one dead letter.
Every change is audited."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weclaw_mq.admin.dlq_action import ACTION_KINDS
from weclaw_mq.console.audit import audit
from weclaw_mq.console.dead_letters import (
    BODY_PREVIEW_BYTES,
    EXACT_MAX,
    SHOWN_MAX,
    Job,
    filter_of,
    row,
)
from weclaw_mq.console.handling import caller_of, console_of, error_response, json_body
from weclaw_mq.console.rendering import SECURITY_HEADERS, render
from weclaw_mq.errors import ConfigurationError, WeclawMQError

_DLQ_FIELDS = ("task_id", "error_type", "reason", "since", "until")


async def dead_letters_page(request: Request) -> Response:
    console = console_of(request)
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
        "body_preview_bytes": BODY_PREVIEW_BYTES,
        "problem": None,
    }
    if queue:
        try:
            seen = await console.dead_letters.look(queue, filter_of(params))
        except WeclawMQError as e:
            context["problem"] = str(e)
        else:
            context.update(
                rows=[row(d, queue) for d in seen.shown], matched=seen.matched, total=seen.total
            )
    return render(request, "dead_letters.html", **context)


async def dead_letters_json(request: Request) -> Response:
    console = console_of(request)
    params = dict(request.query_params)
    queue = params.get("queue", "")
    try:
        seen = await console.dead_letters.look(queue, filter_of(params))
    except WeclawMQError as e:
        return error_response(400, str(e))
    return JSONResponse(
        {
            "total": seen.total,
            "matched": seen.matched,
            "dead_letters": [row(d, queue) for d in seen.shown],
        }
    )


async def dead_letter_body(request: Request) -> Response:
    """The whole body of one dead letter, as stored: UTF-8 text as ``text/plain``, other
    bytes as a download; never rendered as a page of the console (``nosniff``)."""
    console = console_of(request)
    queue = request.query_params.get("queue", "")
    task_id = request.query_params.get("task_id", "")
    try:
        dead = await console.dead_letters.body(queue, task_id)
    except WeclawMQError as e:
        return error_response(400, str(e))
    if dead is None:
        return error_response(404, f"no task {task_id} in {queue}.dlq")
    try:
        dead.body.decode("utf-8")
    except UnicodeDecodeError:
        disposition = f'attachment; filename="{quote(task_id, safe="")}.body"'
        return Response(
            dead.body,
            media_type="application/octet-stream",
            headers={**SECURITY_HEADERS, "content-disposition": disposition},
        )
    return Response(dead.body, media_type="text/plain; charset=utf-8", headers=SECURITY_HEADERS)


async def preview(request: Request) -> Response:
    console = console_of(request)
    try:
        body = await json_body(request)
        action = body.get("action")
        if action not in ACTION_KINDS:
            raise ConfigurationError(f"action {action!r} is not one of {', '.join(ACTION_KINDS)}")
        where = filter_of(body)
        made, selected = await console.dead_letters.preview(action, str(body.get("queue")), where)
    except WeclawMQError as e:
        return error_response(400, str(e))
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
    console = console_of(request)
    client, caller = caller_of(request)

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
        body = await json_body(request)
        preview_id = str(body.get("preview_id") or "")
        job = console.dead_letters.start(preview_id, on_end=ended)
    except WeclawMQError as e:
        audit(client, caller, "dlq run", preview=preview_id, outcome="refused", why=str(e))
        return error_response(400, str(e))
    return JSONResponse(job.document(), status_code=202)


async def job_json(request: Request) -> Response:
    job = console_of(request).dead_letters.job(request.path_params["job_id"])
    if job is None:
        return error_response(404, "no such job")
    return JSONResponse(job.document())


async def requeue_one(request: Request) -> Response:
    console = console_of(request)
    client, caller = caller_of(request)
    try:
        body = await json_body(request)
        queue, task_id = str(body.get("queue") or ""), str(body.get("task_id") or "")
        moved = await console.dead_letters.requeue_one(queue, task_id)
    except WeclawMQError as e:
        audit(client, caller, "dlq requeue one", outcome="failed", why=str(e))
        return error_response(400, str(e))
    audit(client, caller, "dlq requeue one", queue=queue, task_id=task_id, moved=moved)
    if not moved:
        return error_response(404, f"no task {task_id} in {queue}.dlq")
    return JSONResponse({"moved": moved, "queue": queue, "task_id": task_id})

"""What the task-detail page shows of one task: its record (``App.status``), and when it is
in its queue's DLQ the dead letter itself (payload, headers, error and traceback: the
DLQ copy is the only place the payload and the traceback are kept), and the cancel action.

The dead letter is looked up by one pass over ``Q.dlq`` (``admin.dlq.find``, which leaves
the DLQ as it was), only on a full page load of a task whose record says it is there (or
that has no record any more): never on the page's live refresh.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_message import DeadLetter
from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError, WeclawMQError
from weclaw_mq.state import TaskState, TaskStatus

TRACE_ID_FIELD = "{trace_id}"
# Records whose task may sit in the DLQ.
IN_DLQ = frozenset({TaskStatus.DEAD_LETTERED, TaskStatus.EXPIRED})


@dataclass(frozen=True)
class Detail:
    task_id: str
    queue: str | None
    state: TaskState | None
    dead: DeadLetter | None
    problem: str | None  # why a part could not be read (results off, Redis away)


def state_document(state: TaskState | None) -> dict[str, Any] | None:
    """A record as the page's JSON carries it."""
    return None if state is None else state.model_dump(mode="json")


def pretty(value: Any) -> str:
    """A JSON value indented for reading (a text as it is)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def body_text(dead: DeadLetter) -> str:
    """The dead letter's payload for reading: indented JSON, else its text, else a note."""
    try:
        text = dead.body.decode("utf-8")
    except UnicodeDecodeError:
        return f"({len(dead.body)} bytes that are not UTF-8 text)"
    try:
        return pretty(json.loads(text))
    except ValueError:
        return text


async def status_of(
    app: App, task_id: str, queue: str | None
) -> tuple[TaskState | None, str | None]:
    """The task's record and, when it cannot be read, why."""
    try:
        return await app.status(task_id, queue=queue), None
    except WeclawMQError as e:
        return None, str(e)


async def detail(app: App, task_id: str, queue: str | None) -> Detail:
    state, problem = await status_of(app, task_id, queue)
    queue = queue or (state.queue if state is not None else None)
    dead = None
    if queue is not None and queue in app.handlers and (state is None or state.status in IN_DLQ):
        try:
            dead = await dlq.find(app, queue, task_id)
        except WeclawMQError as e:
            problem = problem or str(e)
    return Detail(task_id, queue, state, dead, problem)


async def cancel(app: App, task_id: str, queue: str | None) -> dict[str, Any]:
    """``App.cancel``'s answer as JSON: the outcome and the record afterwards.

    Raises:
        ConfigurationError: No task store, or a task id or queue no task can have.
    """
    if queue is not None and queue not in app.handlers:
        raise ConfigurationError(f"{queue!r} is not a handler queue of app {app.name!r}")
    done = await app.cancel(task_id, queue=queue)
    return {
        "task_id": done.task_id,
        "outcome": str(done.outcome),
        "changed": done.changed,
        "state": state_document(done.state),
    }


def trace_link(template: str | None, trace_id: str | None) -> str | None:
    """The trace's URL: ``template`` with ``{trace_id}`` replaced (URL-quoted); None without
    either."""
    if not template or not trace_id:
        return None
    return template.replace(TRACE_ID_FIELD, quote(trace_id, safe=""))


def check_trace_url(template: str) -> str:
    """``template`` when it is an http(s) URL holding ``{trace_id}``.

    Raises:
        ConfigurationError: It is not.
    """
    if not template.startswith(("http://", "https://")) or TRACE_ID_FIELD not in template:
        raise ConfigurationError(
            f"the trace URL must be an http(s) URL holding {TRACE_ID_FIELD}, e.g. "
            "https://grafana.example/explore?traceId={trace_id}"
        )
    return template

"""The console's two views of the task index (``state.task_index``): the Tasks page (run
history, newest first, filtered, a page at a time by cursor: ``App.tasks``) and the detail
page's timeline (``App.timeline``); and the detail page's memoized steps (``App.steps``).

Each page is one ``list_tasks`` call: the index examines a bounded number of entries per call
(no KEYS, no unbounded scan) and hands back a cursor to go on from, so a page of 50 costs the
same out of a thousand tasks or a million. A sparse filter may fill less than a page: the
page then offers "older" with the cursor.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from weclaw_mq.admin.dlq_filter import parse_time
from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.costs import Price
from weclaw_mq.state import TaskStatus
from weclaw_mq.state.steps import StepRecord
from weclaw_mq.state.task_index import IndexedTask, TaskPage, TaskQuery, TimelineEvent

# The filter fields of the Tasks page, in the order the form shows them.
FIELDS = ("queue", "status", "error", "since", "until", "task_id_prefix", "session_id")
PAGE_SIZE = 50


def query_of(params: Mapping[str, str], *, now: datetime | None = None) -> TaskQuery:
    """The ``TaskQuery`` of the page's fields (empty fields are no filter).

    Raises:
        ConfigurationError: An unknown status, a time that is not one (ISO-8601, or a
            duration before now: ``1h``), or a limit out of range.
    """
    now = now or datetime.now(UTC)

    def text(name: str) -> str | None:
        value = (params.get(name) or "").strip()
        return value or None

    status = text("status")
    if status is not None and status not in {s.value for s in TaskStatus}:
        known = ", ".join(s.value for s in TaskStatus)
        raise ConfigurationError(f"status {status!r} is not one of {known}")
    since, until = text("since"), text("until")
    limit = text("limit")
    if limit is not None and not limit.isdigit():
        raise ConfigurationError(f"limit {limit!r} is not a number")
    return TaskQuery(
        queue=text("queue"),
        status=TaskStatus(status) if status else None,
        since=parse_time(since, now=now) if since else None,
        until=parse_time(until, now=now) if until else None,
        task_id_prefix=text("task_id_prefix"),
        session_id=text("session_id"),
        error=text("error"),
        limit=int(limit) if limit else PAGE_SIZE,
        cursor=text("cursor"),
    )


def task_row(task: IndexedTask) -> dict[str, Any]:
    """One row of the Tasks page (and of its JSON)."""
    state = task.state
    return {
        "task_id": task.task_id,
        "queue": task.queue,
        "indexed_at": task.indexed_at.isoformat(timespec="seconds"),
        "session_id": task.session_id,
        "status": state.status.value if state is not None else None,
        "attempt": state.attempt if state is not None else None,
        "error": (state.error or state.reason) if state is not None else None,
        "updated_at": state.updated_at.isoformat(timespec="seconds") if state is not None else None,
    }


def event_row(event: TimelineEvent) -> dict[str, Any]:
    """One line of a task's timeline."""
    return {
        "at": event.at.isoformat(timespec="milliseconds"),
        "queue": event.queue,
        "status": event.status.value,
        "attempt": event.attempt,
        "error": event.error,
        "reason": event.reason,
    }


async def tasks(app: App, query: TaskQuery) -> TaskPage:
    """One page of the run history (``App.tasks``)."""
    return await app.tasks(query)


async def timeline(app: App, task_id: str, queue: str | None) -> list[TimelineEvent]:
    """The task's timeline (``App.timeline``), oldest first."""
    return await app.timeline(task_id, queue=queue)


async def steps(app: App, task_id: str, queue: str | None) -> list[StepRecord]:
    """The task's recorded steps (``App.steps``), in the order they ran."""
    return await app.steps(task_id, queue=queue)


def last_run_started(events: list[TimelineEvent]) -> datetime | None:
    """When the task's latest run began: its last "running" event (a retry, and a redelivery
    after a crash, each write one), None when the timeline holds none."""
    starts = [e.at for e in events if e.status is TaskStatus.RUNNING]
    return max(starts) if starts else None


def step_row(
    step: StepRecord, run_started: datetime | None, prices: Mapping[str, Price] | None
) -> dict[str, Any]:
    """One line of a task's steps: "cached" when it was recorded before the latest run began
    (that run replayed the record, at no cost), else "fresh"; its cost with the App's prices
    (None without a price for every model it called)."""
    known = prices or {}
    priced = all(m in known for m, _, _ in step.usage)
    cost = sum(known[m].of(i, o) for m, i, o in step.usage) if priced and step.usage else None
    replayed = run_started is not None and datetime.fromisoformat(step.at) < run_started
    return {
        "name": step.name,
        "occurrence": step.occurrence,
        "attempt": step.attempt,
        "at": step.at,
        "duration_s": round(step.duration_s, 3),
        "models": ", ".join(step.models),
        "input_tokens": step.input_tokens,
        "output_tokens": step.output_tokens,
        "cost": cost,
        "cached": replayed,
    }

"""``weclaw-mq inspect MODULE:APP``: every live worker of the app's queues and the tasks each
runs now, read from the worker registry in Redis (``state.worker_registry``, written by each
worker's beat, ``worker.beat``).

With ``--steps``, each running task's memoized steps so far (``ctx.step``: one read per
task, ``App.steps``) are listed under it, and given as ``"steps"`` in the JSON.

Exit 0 with a table (``--json``: one document), also when no worker is live; exit 1 with one
line when the app keeps no Redis (results off and no handler guarded, or a task store of its
own that is not Redis), so that its workers write no record; 5 when Redis does not answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from weclaw_mq.app import App
from weclaw_mq.cli.exit_codes import fail
from weclaw_mq.cli.loading import load_app
from weclaw_mq.cli.options import AppPath
from weclaw_mq.observability.tracing import configure_logging
from weclaw_mq.state import TaskQuery, TaskState, TaskStatus
from weclaw_mq.state.steps import StepRecord
from weclaw_mq.state.worker_registry import WorkerRecord, registry_of, worker_gone

# A running task's recorded steps, by (queue, task id) (``--steps``).
StepsOf = dict[tuple[str, str], list[StepRecord]]

NO_REDIS = (
    "results are off (WECLAW_MQ_RESULTS_ENABLED=false) and no handler of app {app!r} is "
    "guarded: its workers use no Redis, so they keep no record for inspect to read"
)
NOT_REDIS = (
    "app {app!r} keeps its task states in a {store} (not Redis): its workers keep no record "
    "for inspect to read"
)

WORKER_COLUMNS = (
    *("WORKER", "HOST", "PID", "STATE", "CONCURRENCY"),
    *("IN FLIGHT", "UP", "LAST BEAT", "QUEUES"),
)
TASK_COLUMNS = ("TASK ID", "QUEUE", "ATTEMPT", "RUNNING FOR")
GONE_COLUMNS = ("TASK ID", "QUEUE", "ATTEMPT", "LAST SEEN (UTC)")
# The most running records per queue checked against the live workers.
GONE_LISTED_MAX = 100


def inspect_workers(
    app_path: AppPath,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            metavar="",
            help='One JSON document: {"app", "queues", "workers": [{"worker_id", "host", '
            '"pid", "queues", "concurrency", "uptime_s", "last_beat_s", "tasks": [{"task_id", '
            '"queue", "attempt", "running_s"}], "more", ...}], "unserved_queues"}; with '
            '--steps, each task also has "steps": [{"name", "occurrence", "attempt", '
            '"duration_s", "usage", ...}].',
        ),
    ] = False,
    show_steps: Annotated[
        bool,
        typer.Option(
            "--steps",
            help="Also list each running task's memoized steps so far (ctx.step): one Redis "
            "read per task.",
        ),
    ] = False,
) -> None:
    """Show every live worker of the app's queues and the tasks each runs now (from the
    records workers keep in Redis every WECLAW_MQ_WORKER_BEAT_S)."""
    configure_logging("WARNING")
    app = load_app(app_path)
    if not app.needs_store:
        fail(NO_REDIS.format(app=app.name))
    queues = list(app.handlers)
    records, gone, steps = asyncio.run(_read(app, queues if show_steps else None))
    workers = [r for r in records if set(r.queues) & set(queues)]
    if as_json:
        typer.echo(json.dumps(document(app.name, queues, workers, gone, steps)))
    else:
        for line in table(app.name, queues, workers, gone, steps):
            typer.echo(line)


async def _read(
    app: App, steps_of: Sequence[str] | None
) -> tuple[list[WorkerRecord], list[TaskState], StepsOf | None]:
    try:
        store = app.store
        registry = registry_of(store)
        if registry is None:
            fail(NOT_REDIS.format(app=app.name, store=type(store).__name__))
        records = await registry.read()
        steps = None
        if steps_of is not None:
            running = {
                (t.queue, t.task_id) for r in records for t in r.tasks if t.queue in steps_of
            }
            found = await asyncio.gather(*(app.steps(t, queue=q) for q, t in running))
            steps = dict(zip(running, found, strict=True))
        return records, await _on_gone_workers(app, records), steps
    finally:
        await app.close()


async def _on_gone_workers(app: App, records: Sequence[WorkerRecord]) -> list[TaskState]:
    """The app's ``running`` records (the newest ``GONE_LISTED_MAX`` per queue, from the task
    index) that no live worker runs: their workers died. Nothing without results."""
    if not app.settings.results_enabled:
        return []
    now = datetime.now(UTC)
    gone: list[TaskState] = []
    for queue in app.handlers:
        page = await app.tasks(
            TaskQuery(queue=queue, status=TaskStatus.RUNNING, limit=GONE_LISTED_MAX)
        )
        states = (t.state for t in page.tasks if t.state is not None)
        gone += [s for s in states if worker_gone(records, s, app.settings.worker_beat_s, now)]
    return gone


def unserved(queues: Sequence[str], workers: Sequence[WorkerRecord]) -> list[str]:
    """The queues of ``queues`` no live worker consumes."""
    served = {q for w in workers for q in w.queues}
    return [q for q in queues if q not in served]


def document(
    app: str,
    queues: Sequence[str],
    workers: Sequence[WorkerRecord],
    gone: Sequence[TaskState] = (),
    steps: StepsOf | None = None,
) -> dict[str, Any]:
    """``--json``'s document (with ``steps``: each running task's, under it)."""
    shown = [_rounded(asdict(w)) for w in workers]
    if steps is not None:
        for worker in shown:
            for task in worker["tasks"]:
                found = steps.get((task["queue"], task["task_id"]), [])
                task["steps"] = [s.to_dict() for s in found]
    return {
        "app": app,
        "queues": list(queues),
        "workers": shown,
        "unserved_queues": unserved(queues, workers),
        "on_gone_workers": [
            {
                "task_id": s.task_id,
                "queue": s.queue,
                "attempt": s.attempt,
                "last_seen": s.updated_at.isoformat(timespec="seconds"),
            }
            for s in gone
        ],
    }


def table(
    app: str,
    queues: Sequence[str],
    workers: Sequence[WorkerRecord],
    gone: Sequence[TaskState] = (),
    steps: StepsOf | None = None,
) -> list[str]:
    """The readable form: one row per worker, then each worker's running tasks (with
    ``steps``: each task's steps so far under it), then the tasks recorded running on a
    worker that is gone."""
    return _workers_table(app, queues, workers, steps) + _gone_table(gone)


def _gone_table(gone: Sequence[TaskState]) -> list[str]:
    if not gone:
        return []
    rows = [
        [s.task_id, s.queue, str(s.attempt), s.updated_at.strftime("%Y-%m-%d %H:%M:%S")]
        for s in gone
    ]
    header = (
        f"{len(gone)} task(s) recorded running on a worker that is gone (no live worker runs it):"
    )
    return ["", header, *("  " + line for line in columns(GONE_COLUMNS, rows))]


def _workers_table(
    app: str, queues: Sequence[str], workers: Sequence[WorkerRecord], steps: StepsOf | None
) -> list[str]:
    idle = unserved(queues, workers)
    if not workers:
        return [f"no live worker consumes the queues of app {app!r} ({', '.join(queues)})"]
    lines = [f"{len(workers)} live worker(s) of app {app!r}:", ""]
    rows = [
        [
            w.worker_id,
            w.host,
            str(w.pid),
            w.state,
            str(w.concurrency),
            str(w.in_flight),
            duration(w.uptime_s),
            f"{duration(w.last_beat_s)} ago",
            ", ".join(w.queues),
        ]
        for w in workers
    ]
    lines += columns(WORKER_COLUMNS, rows)
    for w in workers:
        lines += ["", f"worker {w.worker_id} ({w.host} pid {w.pid}): {_running(w)}"]
        if w.breakers:
            states = ", ".join(f"{q} {state.replace('_', ' ')}" for q, state in w.breakers.items())
            lines.append(f"  breaker not closed: {states}")
        if w.sync_threads_stuck:
            lines.append(
                f"  sync threads held by calls past their timeout: {w.sync_threads_stuck} of "
                f"{w.sync_threads}"
                + (
                    " (no plain-def task can start)"
                    if w.sync_threads_stuck >= w.sync_threads
                    else ""
                )
            )
        if w.tasks:
            task_rows = [
                [
                    t.task_id,
                    t.queue,
                    str(t.attempt),
                    "not started" if t.running_s is None else duration(t.running_s),
                ]
                for t in w.tasks
            ]
            lines += ["  " + line for line in columns(TASK_COLUMNS, task_rows)]
            if steps is not None:
                for t in w.tasks:
                    lines.append(
                        f"  steps of {t.task_id}: {_steps_line(steps, t.queue, t.task_id)}"
                    )
        if w.more:
            lines.append(f"  ... and {w.more} more (a record lists at most {len(w.tasks)})")
    if idle:
        lines += ["", f"no live worker consumes: {', '.join(idle)}"]
    return lines


def _steps_line(steps: StepsOf, queue: str, task_id: str) -> str:
    """``search 0.2s · summarise#2 1.4s small-1 120+20 tokens``, or ``none recorded``."""
    found = steps.get((queue, task_id), [])
    if not found:
        return "none recorded"
    shown = []
    for s in found:
        name = s.name if s.occurrence == 1 else f"{s.name}#{s.occurrence}"
        part = f"{name} {duration(s.duration_s)}"
        if s.usage:
            part += f" {', '.join(s.models)} {s.input_tokens}+{s.output_tokens} tokens"
        shown.append(part)
    return " · ".join(shown)


def _running(w: WorkerRecord) -> str:
    if not w.in_flight:
        return "runs no task"
    return f"runs {w.in_flight} task(s)"


def columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``header`` and ``rows`` as left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def duration(seconds: float) -> str:
    """``4.2s``, ``12m05s``, ``3h07m``, ``2d05h``: to the tenth under a minute, then to the
    unit below the largest."""
    if seconds < 59.95:  # what rounds to 60.0 is a minute
        return f"{max(seconds, 0.0):.1f}s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value

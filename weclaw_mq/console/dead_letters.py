"""The dead-letters page's engine: the same filter (``admin.dlq_filter.DlqFilter``), looks
(``admin.dlq``) and action object (``admin.dlq_action.DlqAction``) as ``weclaw-mq dlq list /
requeue / purge``, so the console and the CLI select and move exactly the same messages.

A bulk action is two steps. The **preview** is the ``DlqAction``'s preview (a pass that moves
nothing) and is kept here under an id, with the exact task ids it listed. The
**confirmation** names that id, and the run applies the action ``pinned`` to them: those
task ids (with the filter they were chosen by), so what moves is what the operator saw, not
what happens to match by then. A preview of more than ``EXACT_MAX`` dead letters, or one
holding a message without a task id, runs as its filter with a limit of the count previewed
instead (the preview says so); a preview of none runs on none.

A run is a background job: the page polls its progress (messages visited of those in the
DLQ when the pass started) until it ends with the action's summary.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlencode

from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_action import ActionKind, DlqAction, pins_ids
from weclaw_mq.admin.dlq_filter import DlqFilter, parse_time
from weclaw_mq.admin.dlq_message import DeadLetter, export_record
from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError, WeclawMQError

# The page's word for a DLQ action's kind (its routes and jobs say "action").
Action = ActionKind
# A preview of at most this many runs by their task ids; a bigger one by its filter and count.
EXACT_MAX = 1000
# Previews and finished jobs are forgotten after this long.
KEPT_S = 3600.0
# The rows one look shows (the count of all matching is told apart).
SHOWN_MAX = 200
# The bytes of each body a look keeps and shows; the whole body is fetched on demand.
BODY_PREVIEW_BYTES = 2048


def filter_of(params: Mapping[str, Any], *, now: datetime | None = None) -> DlqFilter:
    """The ``DlqFilter`` of the page's fields (as ``dlq list``'s options): ``task_id``,
    ``error_type``, ``reason`` (each a list, or one value; a comma-separated text is split)
    and ``since`` / ``until`` (ISO-8601 or a duration before now: ``1h``).

    Raises:
        ConfigurationError: A time that is not one, or ``since`` not before ``until``.
    """
    now = now or datetime.now(UTC)

    def values(name: str) -> list[str]:
        raw = params.get(name)
        items = raw if isinstance(raw, list) else [raw] if raw else []
        return [part.strip() for item in items for part in str(item).split(",") if part.strip()]

    def when(name: str) -> datetime | None:
        text = str(params.get(name) or "").strip()
        return parse_time(text, now=now) if text else None

    return DlqFilter.of(
        task_ids=values("task_id"),
        error_types=values("error_type"),
        reasons=values("reason"),
        since=when("since"),
        until=when("until"),
    )


def row(dead: DeadLetter, queue: str) -> dict[str, Any]:
    """One dead letter as the page and its JSON show it: ``dlq list --json``'s record, and
    ``body_preview`` (its first ``BODY_PREVIEW_BYTES`` as text), ``body_size`` and
    ``body_url`` (the whole body). A body a look cut short (``body_truncated``) has no
    ``body``: only its preview, and the URL."""
    record = export_record(dead)
    record["traceback"] = dead.traceback
    record["dead_lettered_by"] = "broker" if dead.by_broker else "worker"
    truncated = dead.body_size is not None
    if truncated:
        for name in ("body", "body_bytes", "body_encoding"):
            record.pop(name, None)
        record["body"] = None
    record["body_preview"] = dead.body[:BODY_PREVIEW_BYTES].decode("utf-8", "replace")
    record["body_size"] = dead.body_size if dead.body_size is not None else len(dead.body)
    record["body_truncated"] = truncated
    record["body_url"] = (
        f"/api/dead-letters/body?{urlencode({'queue': queue, 'task_id': dead.task_id})}"
        if dead.task_id
        else None
    )
    return record


@dataclass(frozen=True)
class Preview:
    """A dry run the operator may confirm."""

    id: str
    action: Action
    queue: str
    where: DlqFilter
    task_ids: tuple[str, ...]  # in the order previewed ("" for a message without one)
    kept: int  # dead letters the action would leave
    made_at: float

    @property
    def exact(self) -> bool:
        """Whether the run selects the previewed task ids (else the filter and the count)."""
        return pins_ids(self.task_ids, EXACT_MAX)

    def planned(self) -> DlqAction:
        """The action the confirmed run applies: this preview's, pinned to what it listed."""
        previewed = DlqAction(self.action, self.queue, self.where)
        return previewed.pinned(self.task_ids, by_id_max=EXACT_MAX)

    def run_filter(self) -> tuple[DlqFilter, int | None]:
        """The filter and limit the confirmed run uses."""
        planned = self.planned()
        return planned.where, planned.limit


@dataclass
class Job:
    """A confirmed action running (or ended) in the background."""

    id: str
    preview: Preview
    started_at: float
    visited: int = 0
    total: int = 0
    state: Literal["running", "done", "failed"] = "running"
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    ended_at: float | None = None

    @property
    def action(self) -> Action:
        return self.preview.action

    @property
    def queue(self) -> str:
        return self.preview.queue

    def document(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "action": self.action,
            "queue": self.queue,
            "visited": self.visited,
            "total": self.total,
            "state": self.state,
            "summary": self.summary,
            "error": self.error,
        }


class DeadLetters:
    """Looks, previews and the jobs they start, for one app."""

    def __init__(self, app: App) -> None:
        self._app = app
        self._previews: dict[str, Preview] = {}
        self._jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak refs

    def queue_of(self, queue: str) -> str:
        """``queue`` when it is one of the app's handler queues.

        Raises:
            ConfigurationError: It is not.
        """
        if queue not in self._app.handlers:
            raise ConfigurationError(f"{queue!r} is not a handler queue of app {self._app.name!r}")
        return queue

    async def look(self, queue: str, where: DlqFilter) -> dlq.Looked:
        """Up to ``SHOWN_MAX`` matching dead letters, each body cut to its preview: a look
        holds at most ``SHOWN_MAX * BODY_PREVIEW_BYTES`` of bodies, however big they are."""
        return await dlq.look(
            self._app,
            self.queue_of(queue),
            where=where,
            limit=SHOWN_MAX,
            body_max=BODY_PREVIEW_BYTES,
        )

    async def body(self, queue: str, task_id: str) -> DeadLetter | None:
        """The whole dead letter of ``task_id`` (the first with that id), or None."""
        if not task_id:
            raise ConfigurationError("no task id given")
        return await dlq.find(self._app, self.queue_of(queue), task_id)

    async def preview(
        self, action: Action, queue: str, where: DlqFilter
    ) -> tuple[Preview, list[DeadLetter]]:
        """The dry run of ``action``: what it would select, kept for a confirmation."""
        self._forget_old()
        queue = self.queue_of(queue)
        # A preview lists no bodies: a dry run over many big dead letters holds none of them.
        dry = await DlqAction(action, queue, where).preview(self._app, body_max=0)
        selected, kept = dry.selected, dry.kept + dry.skipped
        preview = Preview(
            id=secrets.token_urlsafe(12),
            action=action,
            queue=queue,
            where=where,
            task_ids=tuple(d.task_id for d in selected),
            kept=kept,
            made_at=time.monotonic(),
        )
        self._previews[preview.id] = preview
        return preview, selected

    def start(self, preview_id: str, on_end: Callable[[Job], None] | None = None) -> Job:
        """Run a preview's action in the background; ``on_end`` is called with the job once
        it ended (done or failed).

        Raises:
            ConfigurationError: No such preview (never made, run already, or too old).
        """
        preview = self._previews.pop(preview_id, None)
        if preview is None:
            raise ConfigurationError(
                "no such preview (it ran already or is too old): preview again"
            )
        job = Job(id=secrets.token_urlsafe(12), preview=preview, started_at=time.monotonic())
        self._jobs[job.id] = job
        task = asyncio.create_task(self._run(preview, job, on_end))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def requeue_one(self, queue: str, task_id: str) -> int:
        """Move the dead letter of ``task_id`` back to ``queue`` (as ``dlq requeue -t``); how
        many moved (0: not in the DLQ)."""
        if not task_id:
            raise ConfigurationError("no task id given")
        where = DlqFilter.of(task_ids=[task_id])
        return (await DlqAction("requeue", self.queue_of(queue), where, 1).apply(self._app)).acted

    def job(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    async def wait(self) -> None:
        """Until every running job ended (the console's shutdown)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _run(self, preview: Preview, job: Job, on_end: Callable[[Job], None] | None) -> None:
        def step(visited: int, total: int) -> None:
            job.visited, job.total = visited, total

        try:
            done = await preview.planned().apply(self._app, progress=step)
            if preview.action == "requeue":
                job.summary = {
                    "moved": done.acted,
                    "skipped": done.skipped,
                    "failed": done.failed,
                    "kept": done.kept,
                }
            else:
                job.summary = {"removed": done.acted, "kept": done.kept}
            job.state = "done"
        except WeclawMQError as e:
            job.state, job.error = "failed", str(e)
        finally:
            job.ended_at = time.monotonic()
            if on_end is not None:
                on_end(job)

    def _forget_old(self) -> None:
        now = time.monotonic()
        for key, preview in list(self._previews.items()):
            if now - preview.made_at > KEPT_S:
                del self._previews[key]
        for key, job in list(self._jobs.items()):
            if job.ended_at is not None and now - job.ended_at > KEPT_S:
                del self._jobs[key]

"""The task index: every task in the order it was first recorded, and each task's timeline.

Both stores keep it beside the records (``state.redis_index`` says how Redis does), under one
rule: a task gets an index entry when its first record in a queue is written (its "queued"
record at publish, ``stored_locally`` in the outbox, or the first record a worker writes for
a task published without results), and every record write appends one event to the task's
timeline. ``list_tasks`` pages newest first and never scans without bound: one call examines
at most ``SCAN_BUDGET`` index entries and, when a sparse filter leaves its page short, answers
a cursor to go on from. The index is bounded by age and count (``task_index_max_age_s``,
``task_index_max_entries``), a timeline by ``TIMELINE_MAX_EVENTS`` and the record's TTL.

The paging itself (``scan_page``), the filters and the cursor are here, once, for both stores:
a store only answers "the index entries at or below this score" and "these tasks' records".
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, runtime_checkable

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.state.protocol import TaskState, TaskStatus

# The most index entries one ``list_tasks`` call examines: a filter that matches few tasks
# answers a short page and a cursor instead of reading the whole index.
SCAN_BUDGET = 2000
# The most events a task's timeline keeps (the oldest go first): a task retried without end
# keeps a bounded list.
TIMELINE_MAX_EVENTS = 100
# Statuses an operator filters by that few tasks have: each keeps an index of its own
# (written with the final record, never on the happy path), so such a filter reads only
# matching entries instead of scanning past millions of succeeded tasks.
SPARSE_STATUSES = frozenset({TaskStatus.DEAD_LETTERED, TaskStatus.EXPIRED, TaskStatus.CANCELLED})
MAX_LIMIT = 500
INDEX_OFF = "the task index is off (WECLAW_MQ_TASK_INDEX=false)"
_CURSOR_VERSION = "1"


def index_off() -> ConfigurationError:
    """The error every index read raises when the index is off."""
    return ConfigurationError(INDEX_OFF)


@dataclass(frozen=True)
class TaskQuery:
    """Which indexed tasks ``list_tasks`` answers, newest first.

    Args:
        queue: Only tasks of this handler queue.
        status: Only tasks whose record now reads this status.
        since: Only tasks indexed (first recorded) at or after this time (aware).
        until: Only tasks indexed before this time (aware).
        task_id_prefix: Only tasks whose id starts with this (a whole id matches itself).
        session_id: Only tasks of this session.
        error: Only tasks whose record's error ("ErrorName: message") or reason holds
            this, in any case.
        limit: The most tasks on a page, 1 to 500.
        cursor: ``TaskPage.next_cursor`` of the page before, with the same filters.

    Raises:
        ConfigurationError: A limit out of range, a naive time, or a cursor that is not one.
    """

    queue: str | None = None
    status: TaskStatus | None = None
    since: datetime | None = None
    until: datetime | None = None
    task_id_prefix: str | None = None
    session_id: str | None = None
    error: str | None = None
    limit: int = 50
    cursor: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int):
            raise ConfigurationError(f"limit must be an int from 1 to {MAX_LIMIT}")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise ConfigurationError(f"limit must be 1 to {MAX_LIMIT}, not {self.limit}")
        for name in ("since", "until"):
            at = getattr(self, name)
            if at is not None and (not isinstance(at, datetime) or at.utcoffset() is None):
                raise ConfigurationError(f"{name} must be an aware datetime, not {at!r}")
        if self.status is not None:
            object.__setattr__(self, "status", TaskStatus(self.status))
        if self.cursor is not None:
            read_cursor(self.cursor)


@dataclass(frozen=True)
class IndexedTask:
    """One task of a ``TaskPage``.

    Args:
        task_id: The task's id.
        queue: The handler queue of its index entry.
        indexed_at: When its first record in that queue was written.
        state: Its record now; None when the record expired from the store.
        session_id: Its session, when its record names one.
    """

    task_id: str
    queue: str
    indexed_at: datetime
    state: TaskState | None
    session_id: str | None = None


@dataclass(frozen=True)
class TaskPage:
    """One page of ``list_tasks``.

    Args:
        tasks: The matching tasks, newest first.
        next_cursor: Where the next page starts (``TaskQuery.cursor``); None: nothing older
            matches.
        scanned: The index entries this call examined (at most ``SCAN_BUDGET``).
    """

    tasks: list[IndexedTask]
    next_cursor: str | None
    scanned: int


@dataclass(frozen=True)
class TimelineEvent:
    """One record write of a task, as its timeline keeps it.

    Args:
        at: When the record was written.
        queue: The handler queue of the record.
        status: The status written.
        attempt: The attempt that wrote it.
        error: The failure (retrying, dead_lettered), ``ErrorName: message``.
        reason: The dead-letter reason (dead_lettered, expired).
    """

    at: datetime
    queue: str
    status: TaskStatus
    attempt: int
    error: str | None = None
    reason: str | None = None


@runtime_checkable
class TaskIndex(Protocol):
    """A store that answers which tasks it holds, and what happened to each."""

    async def list_tasks(self, query: TaskQuery) -> TaskPage:
        """One page of indexed tasks, newest first.

        Args:
            query: The filters, page size and cursor.

        Returns:
            The page.

        Raises:
            ConfigurationError: The index is off.
        """
        ...

    async def timeline(self, task_id: str, *, queue: str | None = None) -> list[TimelineEvent]:
        """The task's record writes, oldest first.

        Args:
            task_id: The task's id.
            queue: Only the events of this queue.

        Returns:
            The events ([] when none are kept).

        Raises:
            ConfigurationError: The index is off.
        """
        ...


# -- times, the cursor and the timeline's events as stored ------------------------------
def to_ms(at: datetime) -> int:
    """``at`` as milliseconds since the epoch (the index's scores)."""
    return math.floor(at.timestamp() * 1000)


def from_ms(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def make_cursor(score: int, skip: int) -> str:
    """A position in the index: past every entry above ``score`` and ``skip`` entries at it."""
    return f"{_CURSOR_VERSION}.{score}.{skip}"


def read_cursor(cursor: str) -> tuple[int, int]:
    """(score, skip) of a cursor ``make_cursor`` made.

    Raises:
        ConfigurationError: It is not one.
    """
    parts = cursor.split(".") if isinstance(cursor, str) else []
    try:
        if len(parts) != 3 or parts[0] != _CURSOR_VERSION:
            raise ValueError(cursor)
        score, skip = int(parts[1]), int(parts[2])
    except ValueError:
        raise ConfigurationError(
            f"cursor {cursor!r} is not one a task page answered (TaskPage.next_cursor)"
        ) from None
    if skip < 0:
        raise ConfigurationError(f"cursor {cursor!r} is not one a task page answered")
    return score, skip


def timeline_event(state: TaskState) -> str:
    """The timeline's entry for writing ``state``: a short JSON list (time ms, queue, status,
    attempt, error, reason). Written on every record write of the consume path, so built by
    hand: ``json.dumps`` only for the texts that may need escaping."""
    queue = _QUOTED.get(state.queue)
    if queue is None:
        if len(_QUOTED) > 1000:  # a bound, for a store fed queue names without end
            _QUOTED.clear()
        queue = _QUOTED[state.queue] = json.dumps(state.queue)
    error = "null" if state.error is None else json.dumps(state.error)
    reason = "null" if state.reason is None else json.dumps(state.reason)
    at = to_ms(state.updated_at)
    return f'[{at},{queue},"{state.status.value}",{state.attempt},{error},{reason}]'


_QUOTED: dict[str, str] = {}  # queue name -> as a JSON string


def read_timeline(raw: Sequence[str | bytes], queue: str | None) -> list[TimelineEvent]:
    """The events of a stored timeline (oldest first), those of ``queue`` when given; an
    entry this version cannot read is skipped, not fatal."""
    events = []
    for entry in raw:
        try:
            at, of_queue, status, attempt, error, reason = json.loads(entry)
            event = TimelineEvent(
                at=from_ms(at),
                queue=of_queue,
                status=TaskStatus(status),
                attempt=int(attempt),
                error=error,
                reason=reason,
            )
        except (ValueError, TypeError):
            continue
        if queue is None or event.queue == queue:
            events.append(event)
    return events


# -- one page ------------------------------------------------------------------------------
# The index entries at or below a score, newest first: (score, skip, count) -> [(queue,
# task id, score)], skipping the first ``skip`` entries (those at the score already seen).
Entries = Callable[[int, int, int], Awaitable[list[tuple[str, str, int]]]]
# The records of (queue, task id) pairs as stored (TaskState JSON), in order; None where none
# is kept.
Records = Callable[[list[tuple[str, str]]], Awaitable[list[str | bytes | None]]]

# Entries read by a page's first step (enough for a dense filter's page), doubled each step.
_MIN_STEP = 200


def _entry_matches(query: TaskQuery, queue: str, task_id: str) -> bool:
    if query.queue is not None and queue != query.queue:
        return False
    return query.task_id_prefix is None or task_id.startswith(query.task_id_prefix)


def _clues(query: TaskQuery) -> list[str]:
    """Text a stored record (compact JSON) must hold to match ``query``: checked before it is
    parsed, so a filter that scans 2,000 records parses only those that may match. A clue
    never rules out a match (it may let through a record that then fails the real test)."""
    clues = []
    if query.status is not None:
        clues.append(f'"status":"{query.status.value}"')
    if query.session_id is not None:
        clues.append(json.dumps(query.session_id))
    if query.error is not None and json.dumps(query.error)[1:-1] == query.error:
        clues.append(query.error.casefold())  # (one JSON keeps as it is)
    return clues


def _parsed(raw: str | bytes | None, clues: list[str]) -> TaskState | Literal[False] | None:
    """The record, None when there is none, or False when it cannot match (or be read)."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    if clues:
        folded = text.casefold()
        if not all(clue.casefold() in folded for clue in clues):
            return False
    try:
        return TaskState.model_validate_json(text)
    except ValueError:
        return False


def _record_matches(query: TaskQuery, state: TaskState | None) -> bool:
    if state is None:
        return query.status is None and query.session_id is None and query.error is None
    if query.status is not None and state.status is not query.status:
        return False
    if query.session_id is not None and state.session_id != query.session_id:
        return False
    if query.error is not None:
        needle = query.error.casefold()
        return any(needle in text.casefold() for text in (state.error, state.reason) if text)
    return True


async def scan_page(
    query: TaskQuery,
    entries: Entries,
    records: Records,
    *,
    budget: int = SCAN_BUDGET,
) -> TaskPage:
    """One page of ``query`` over an index read through ``entries`` and ``records``.

    Args:
        query: The filters, page size and cursor.
        entries: The index (or the sub-index the store picked for the filter) newest first.
        records: The records of the tasks whose entries passed the entry filters.
        budget: The most entries examined.

    Returns:
        The page; its cursor is set when the budget ran out or the page filled up.
    """
    if query.cursor is not None:
        score, skip = read_cursor(query.cursor)
    elif query.until is not None:
        score, skip = to_ms(query.until) - 1, 0  # until is exclusive
    else:
        score, skip = 2**62, 0
    since = to_ms(query.since) if query.since is not None else None
    clues = _clues(query)
    found: list[IndexedTask] = []
    scanned = 0
    step = max(_MIN_STEP, 2 * query.limit)
    while scanned < budget:
        step = min(budget - scanned, step)
        batch = await entries(score, skip, step)
        wanted = [(q, t) for q, t, _ in batch if _entry_matches(query, q, t)]
        # Records are read only for a filter on them, or for the tasks a page shows.
        states = iter(await records(wanted)) if wanted else iter(())
        for queue, task_id, at in batch:
            if since is not None and at < since:
                return TaskPage(found, None, scanned)
            scanned += 1
            score, skip = (score, skip + 1) if at == score else (at, 1)
            if not _entry_matches(query, queue, task_id):
                continue
            state = _parsed(next(states), clues)
            if state is False or not _record_matches(query, state):
                continue
            session = state.session_id if state is not None else None
            found.append(IndexedTask(task_id, queue, from_ms(at), state, session))
            if len(found) == query.limit:
                return TaskPage(found, make_cursor(score, skip), scanned)
        if len(batch) < step:
            return TaskPage(found, None, scanned)
        step *= 2  # a sparse filter: fewer, larger steps
    return TaskPage(found, make_cursor(score, skip), scanned)


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

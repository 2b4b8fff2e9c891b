"""What a task's stream and a session's inbox hold: ``StreamEvent``, and its stored form.

An entry is stored as two fields: ``k`` (its kind, which the Redis scripts read) and ``e``
(the whole event as JSON, which only Python reads). Encoding happens once, when the event is
made (``ctx.emit`` measures the chunk's size on it); stores move the bytes as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import pydantic_core

from weclaw_mq.contract.message import strict_json
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.state import TaskState

# "attempt": a run of the handler starts (its partial text replaces any earlier run's);
# "chunk": a piece of partial output; "final": the task ended (status, result, reason);
# "expired" (inbox only): pending entries went past the inbox TTL unread (data says which).
EventKind = Literal["attempt", "chunk", "final", "expired"]

ATTEMPT: EventKind = "attempt"
CHUNK: EventKind = "chunk"
FINAL: EventKind = "final"
EXPIRED: EventKind = "expired"

# A Redis Stream entry id: "<ms>-<seq>". The memory store makes ids of the same form.
_EVENT_ID_RE = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
FIRST_ID = "0-0"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a task's stream (or of a session's inbox, which mixes tasks).

    ``status``, ``result``, ``reason`` (and ``error``) are set on "final" only.

    Args:
        id: Orders events (the Redis Stream entry id); pass the last one seen as ``after``
            to resume.
        kind: "attempt" (a run starts: its partial text replaces any earlier run's),
            "chunk", "final", or "expired" (inbox only: pending entries went past the inbox
            TTL unread).
        task_id: The task that wrote it (empty for "expired").
        attempt: The delivery attempt that wrote it (a redelivery after a crash keeps the
            number, but still writes a new "attempt" marker).
        data: A chunk's value (str or JSON data), or for "expired"
            ``{"tasks": [...], "entries": n}``.
        queue: The handler queue of the task ("final").
        status: The task's final status ("final").
        result: The handler's return value ("final", succeeded).
        reason: The dead-letter reason ("final").
        error: ``ErrorName: message`` of the last failure ("final").
    """

    id: str
    kind: EventKind
    task_id: str
    attempt: int = 0
    data: Any = None
    queue: str | None = None
    status: str | None = None
    result: Any = None
    reason: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """An event as stored, before it has an id: ``kind`` and the event's JSON."""

    kind: EventKind
    body: bytes


def check_event_id(event_id: str) -> str:
    if not isinstance(event_id, str) or not _EVENT_ID_RE.fullmatch(event_id):
        raise ConfigurationError(
            f"event id {event_id!r} is not a stream event id (like '1733011200000-0')"
        )
    return event_id


def id_key(event_id: str) -> tuple[int, int]:
    """The id as numbers, for ordering: "9-0" < "10-0"."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq)


def next_id(event_id: str) -> str:
    """The smallest id after ``event_id``: trimming below it keeps everything later."""
    ms, seq = id_key(event_id)
    return f"{ms}-{seq + 1}"


def encode_data(chunk: Any) -> bytes:
    """A chunk as JSON (str or any JSON-able value), by the rule of task bodies
    (``message.strict_json``); ``TypeError`` if it is not JSON (NaN included)."""
    try:
        return strict_json(chunk)
    except ValueError as e:
        raise TypeError(f"ctx.emit takes str or JSON data: {e}") from e


def _head(kind: str, task_id: str, attempt: int) -> bytes:
    return b'{"kind":"%s","task_id":%s,"attempt":%d' % (
        kind.encode(),
        pydantic_core.to_json(task_id),
        attempt,
    )


def attempt_entry(task_id: str, attempt: int) -> Entry:
    return Entry(ATTEMPT, _head(ATTEMPT, task_id, attempt) + b"}")


def chunk_entry(task_id: str, attempt: int, data: bytes) -> Entry:
    """``data``: the chunk already encoded by ``encode_data`` (and measured)."""
    return Entry(CHUNK, _head(CHUNK, task_id, attempt) + b',"data":' + data + b"}")


def final_entry(state: TaskState) -> Entry:
    body = pydantic_core.to_json(
        {
            "kind": FINAL,
            "task_id": state.task_id,
            "attempt": state.attempt,
            "queue": state.queue,
            "status": state.status.value,
            "result": state.result,
            "reason": state.reason,
            "error": state.error,
        }
    )
    return Entry(FINAL, body)


def expired_entry(tasks: list[str], entries: int) -> Entry:
    body = pydantic_core.to_json(
        {"kind": EXPIRED, "task_id": "", "data": {"tasks": tasks, "entries": entries}}
    )
    return Entry(EXPIRED, body)


def decode(event_id: str, body: bytes | str) -> StreamEvent:
    fields = pydantic_core.from_json(body)
    if fields["kind"] == EXPIRED and not fields["data"]["tasks"]:
        fields["data"]["tasks"] = []  # Lua's cjson writes an empty list as {}
    return StreamEvent(id=event_id, **fields)

"""The task index's pure parts: the query's checks, the cursor, the members, the events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from weclaw_mq import ConfigurationError, TaskQuery, TaskStatus
from weclaw_mq.contract.naming import (
    LATEST_KEY_PREFIX,
    TIMELINE_KEY_PREFIX,
    index_entry,
    index_member,
    latest_key,
    timeline_key,
)
from weclaw_mq.state import TaskState
from weclaw_mq.state.task_index import (
    INDEX_OFF,
    make_cursor,
    read_cursor,
    read_timeline,
    scan_page,
    timeline_event,
)


@pytest.mark.parametrize("limit", [0, -1, 501, True, 2.5])
def test_a_limit_outside_1_to_500_is_a_configuration_error(limit: object) -> None:
    with pytest.raises(ConfigurationError, match="limit"):
        TaskQuery(limit=limit)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["since", "until"])
def test_a_naive_time_is_refused(field: str) -> None:
    with pytest.raises(ConfigurationError, match="aware"):
        TaskQuery(**{field: datetime(2026, 1, 1)})  # type: ignore[arg-type]


@pytest.mark.parametrize("cursor", ["", "x", "1.2", "2.5.0", "1.a.0", "1.5.-1", "1.5.0.0"])
def test_a_cursor_no_page_answered_is_a_configuration_error(cursor: str) -> None:
    with pytest.raises(ConfigurationError, match="cursor"):
        TaskQuery(cursor=cursor)


def test_a_cursor_reads_back_its_position() -> None:
    assert read_cursor(make_cursor(1_700_000_000_123, 4)) == (1_700_000_000_123, 4)


def test_a_status_given_as_its_value_is_the_status() -> None:
    assert TaskQuery(status="dead_lettered").status is TaskStatus.DEAD_LETTERED  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("queue", "task_id"),
    [("q", "t"), ("a:b", "c"), ("a", "b:c"), ("ü:1", "{x}"), ("q", ""), ("q", "é:é")],
)
def test_an_index_member_reads_back_its_queue_and_task_id(queue: str, task_id: str) -> None:
    assert index_entry(index_member(queue, task_id)) == (queue, task_id)


@pytest.mark.parametrize("member", ["", "x", "5:ab", "2:abc"])
def test_a_member_that_is_not_one_raises_value_error(member: str) -> None:
    with pytest.raises(ValueError):
        index_entry(member)


def test_a_timeline_event_reads_back_and_a_foreign_entry_is_skipped() -> None:
    at = datetime(2026, 5, 1, 12, 0, 0, 250_000, tzinfo=UTC)
    state = TaskState(
        task_id="t",
        queue="q",
        status=TaskStatus.RETRYING,
        attempt=2,
        error="ValueError: no",
        updated_at=at,
    )
    other = state.model_copy(update={"queue": "r", "status": TaskStatus.RUNNING})
    raw = [timeline_event(state), "not json", '["x"]', timeline_event(other)]
    (event,) = read_timeline(raw, "q")
    assert (event.at, event.queue, event.status, event.attempt, event.error) == (
        at,
        "q",
        TaskStatus.RETRYING,
        2,
        "ValueError: no",
    )
    assert [e.queue for e in read_timeline(raw, None)] == ["q", "r"]


async def test_a_page_stops_at_since_and_its_cursor_resumes_after_ties() -> None:
    # Entries (queue, task id, ms), newest first; three share one millisecond.
    rows = [("q", f"t{i}", ms) for i, ms in enumerate([50, 40, 40, 40, 30, 20, 10])]

    async def entries(score: int, skip: int, count: int) -> list[tuple[str, str, int]]:
        return [r for r in rows if r[2] <= score][skip : skip + count]

    async def records(tasks: list[tuple[str, str]]) -> list[TaskState | None]:
        return [None for _ in tasks]

    seen: list[str] = []
    cursor = None
    while True:
        page = await scan_page(TaskQuery(limit=2, cursor=cursor), entries, records)
        seen += [t.task_id for t in page.tasks]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == [f"t{i}" for i in range(7)]
    since = datetime.fromtimestamp(0.02, UTC)
    page = await scan_page(TaskQuery(since=since), entries, records)
    assert [t.task_id for t in page.tasks] == ["t0", "t1", "t2", "t3", "t4", "t5"]
    until = datetime.fromtimestamp(0.04, UTC) + timedelta(microseconds=0)
    page = await scan_page(TaskQuery(until=until), entries, records)
    assert [t.task_id for t in page.tasks] == ["t4", "t5", "t6"]


def test_the_index_off_message_names_the_setting() -> None:
    assert "WECLAW_MQ_TASK_INDEX=false" in INDEX_OFF


@pytest.mark.parametrize("task_id", ["t", "}x", "{y", "", "a:b", "ü"])
def test_a_timeline_key_is_its_latest_pointer_with_another_prefix(task_id: str) -> None:
    # The record scripts build the timeline's key from the latest pointer's (same hash tag).
    tail = latest_key(task_id).removeprefix(f"{LATEST_KEY_PREFIX}:")
    assert timeline_key(task_id) == f"{TIMELINE_KEY_PREFIX}:{tail}"

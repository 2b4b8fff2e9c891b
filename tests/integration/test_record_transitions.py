"""The Redis store enforces the transition table (``state.transitions``) in its scripts, pair
by pair, on real Redis: every (stored status, written status) pair through the record script,
the relay's narrowed ``queued``, and the batch script of ``publish_many``. The hand-written
decision is in tests/unit/test_record_transitions.py (``REFUSED``), shared here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conftest import forget_task_keys, settings_for
from tests.unit.test_record_transitions import CURRENTS, PAIRS, REFUSED, pair_id
from weclaw_mq import TaskState, TaskStatus
from weclaw_mq.state import TaskStore, open_store

S = TaskStatus


@pytest.fixture
async def store(redis_url: str, qname: str) -> AsyncIterator[TaskStore]:
    opened = open_store(settings_for("amqp://unused", redis_url, result_ttl_s=120))
    try:
        yield opened
    finally:
        await opened.close()
        await forget_task_keys(redis_url, [qname])


async def test_every_pair_is_written_or_refused_as_the_table_says(
    store: TaskStore, qname: str
) -> None:
    wrong = []
    for current, new in PAIRS:
        task_id = pair_id((current, new))
        if current is not None:
            assert await store.record(
                TaskState(task_id=task_id, queue=qname, status=current, attempt=1)
            )
        allowed = (current, new) not in REFUSED
        written = await store.record(TaskState(task_id=task_id, queue=qname, status=new, attempt=2))
        got = await store.get(task_id, queue=qname)
        assert got is not None
        expected = (new, 2) if allowed else (current, 1)
        if written is not allowed or (got.status, got.attempt) != expected:
            wrong.append(f"{task_id}: written={written}, reads {got.status.value}")
    assert wrong == []


async def test_the_relays_queued_lands_only_over_stored_locally_or_no_record(
    store: TaskStore, qname: str
) -> None:
    for current in CURRENTS:
        task_id = f"relayed-over-{current.value if current else 'none'}"
        if current is not None:
            assert await store.record(TaskState(task_id=task_id, queue=qname, status=current))
        queued = TaskState(task_id=task_id, queue=qname, status=S.QUEUED)
        await store.record_many([queued], only_over={S.STORED_LOCALLY})
        got = await store.get(task_id, queue=qname)
        assert got is not None
        assert got.status is (S.QUEUED if current in (None, S.STORED_LOCALLY) else current)


async def test_the_batch_of_new_records_never_writes_over_one(store: TaskStore, qname: str) -> None:
    assert await store.record(TaskState(task_id="old", queue=qname, status=S.DEAD_LETTERED))
    await store.record_many(
        [TaskState(task_id=t, queue=qname, status=S.QUEUED) for t in ("old", "new")],
        only_if_new=True,
    )
    old, new = await store.get("old", queue=qname), await store.get("new", queue=qname)
    assert old is not None and old.status is S.DEAD_LETTERED
    assert new is not None and new.status is S.QUEUED


async def test_the_claim_and_the_finish_write_through_the_same_table(
    store: TaskStore, qname: str
) -> None:
    # A copy of a dead-lettered task that runs again is recorded running, then its end.
    assert await store.record(TaskState(task_id="copy", queue=qname, status=S.DEAD_LETTERED))
    running = TaskState(task_id="copy", queue=qname, status=S.RUNNING)
    await store.claim(qname, "copy", "owner-1", running=running)
    got = await store.get("copy", queue=qname)
    assert got is not None and got.status is S.RUNNING
    # A finish over cancelled is refused (the done marker is still set).
    assert await store.record(TaskState(task_id="gone", queue=qname, status=S.CANCELLED))
    await store.finish(qname, "gone", TaskState(task_id="gone", queue=qname, status=S.SUCCEEDED))
    got = await store.get("gone", queue=qname)
    assert got is not None and got.status is S.CANCELLED

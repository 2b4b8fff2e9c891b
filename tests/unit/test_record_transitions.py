"""Every record write is a compare and set over one table (``state.transitions``): each (stored
status, written status) pair, as the table decides it and as the in-memory store enforces
it. The same pairs on real Redis: tests/integration/test_record_transitions.py."""

from __future__ import annotations

import itertools

import pytest

from weclaw_mq import MemoryTaskStore, TaskState, TaskStatus
from weclaw_mq.state.transitions import TRANSITIONS, may_follow

S = TaskStatus
FINALS = {S.SUCCEEDED, S.DEAD_LETTERED, S.EXPIRED, S.CANCELLED}

# The decision, written out by hand (not derived from the table under test): what is refused.
REFUSED: set[tuple[TaskStatus | None, TaskStatus]] = {
    # On the broker already: never back to "in the local outbox".
    (S.RUNNING, S.STORED_LOCALLY),
    (S.RETRYING, S.STORED_LOCALLY),
    # Final for every writer.
    *((S.SUCCEEDED, to) for to in S),
    *((S.CANCELLED, to) for to in S),
    # Final but for leaving the DLQ: requeued (queued) or a copy run (running).
    *((S.DEAD_LETTERED, to) for to in S if to not in (S.QUEUED, S.RUNNING)),
    *((S.EXPIRED, to) for to in S if to not in (S.QUEUED, S.RUNNING)),
}
CURRENTS: list[TaskStatus | None] = [None, *S]
PAIRS = list(itertools.product(CURRENTS, S))


def pair_id(pair: tuple[TaskStatus | None, TaskStatus]) -> str:
    current, new = pair
    return f"{current.value if current else 'none'}->{new.value}"


def test_the_table_names_every_status_and_no_record() -> None:
    assert set(TRANSITIONS) == set(CURRENTS)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
async def test_a_write_is_made_exactly_where_the_table_allows_it(
    pair: tuple[TaskStatus | None, TaskStatus],
) -> None:
    current, new = pair
    allowed = pair not in REFUSED
    assert may_follow(current, new) is allowed

    store = MemoryTaskStore()
    if current is not None:
        assert await store.record(TaskState(task_id="t", queue="q", status=current, attempt=1))
    written = await store.record(TaskState(task_id="t", queue="q", status=new, attempt=2))
    assert written is allowed
    got = await store.get("t", queue="q")
    assert got is not None
    assert (got.status, got.attempt) == ((new, 2) if allowed else (current, 1))


def test_a_final_status_is_replaced_only_by_the_ways_out_of_the_dlq() -> None:
    for final, new in itertools.product(FINALS, S):
        if may_follow(final, new):
            assert final in (S.DEAD_LETTERED, S.EXPIRED) and new in (S.QUEUED, S.RUNNING)


@pytest.mark.parametrize("current", CURRENTS, ids=lambda c: c.value if c else "none")
async def test_the_relays_queued_lands_only_over_stored_locally_or_no_record(
    current: TaskStatus | None,
) -> None:
    store = MemoryTaskStore()
    if current is not None:
        assert await store.record(TaskState(task_id="t", queue="q", status=current))
    queued = TaskState(task_id="t", queue="q", status=S.QUEUED)
    await store.record_many([queued], only_over={S.STORED_LOCALLY})
    got = await store.get("t", queue="q")
    assert got is not None
    expected = S.QUEUED if current in (None, S.STORED_LOCALLY) else current
    assert got.status is expected


async def test_only_if_new_writes_only_where_no_record_exists() -> None:
    store = MemoryTaskStore()
    assert await store.record(TaskState(task_id="t", queue="q", status=S.QUEUED), only_if_new=True)
    for status in (S.QUEUED, S.RUNNING, S.SUCCEEDED):
        refused = TaskState(task_id="t", queue="q", status=status)
        assert not await store.record(refused, only_if_new=True)

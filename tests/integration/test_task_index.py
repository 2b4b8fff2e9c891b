"""The task index and timelines (``weclaw_mq.state.task_index``): the same cases on Redis, a
Redis Cluster of the session's own and the in-memory store, then through a real worker.

Index times come from the records' ``updated_at``: the cases set them, so order and the
``since``/``until`` bounds are exact without waiting. The bounds cases run on a private Redis
(a count bound of 5 on the shared one would trim every other test's index).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import pytest
from pydantic import BaseModel

from tests.conftest import close_apps, forget_task_keys, settings_for
from tests.private_servers import PrivateRedis
from weclaw_mq import App, ConfigurationError, Context, MemoryTaskStore, RetryPolicy, TaskQuery
from weclaw_mq.contract.naming import timeline_key
from weclaw_mq.state import (
    RedisTaskStore,
    TaskIndex,
    TaskPage,
    TaskState,
    TaskStatus,
    TaskStore,
    new_owner,
    open_store,
)
from weclaw_mq.state.redis_clients import open_client
from weclaw_mq.state.task_index import INDEX_OFF, SCAN_BUDGET

SHORT_TTLS: dict[str, Any] = {"result_ttl_s": 300, "done_ttl_s": 300}
S = TaskStatus
# The timeline of a task that failed twice, then succeeded: (status, attempt) per event.
RETRIED_TWICE = [
    (S.QUEUED, 0),
    (S.RUNNING, 1),
    (S.RETRYING, 1),
    (S.RUNNING, 2),
    (S.RETRYING, 2),
    (S.RUNNING, 3),
    (S.SUCCEEDED, 3),
]


class IndexedStore(TaskStore, TaskIndex, Protocol):
    """A task store that keeps the index (both of ours do)."""


class Job(BaseModel):
    n: int = 0


def _open(kind: str, url: str, **overrides: Any) -> IndexedStore:
    settings = settings_for("amqp://unused", url, **{**SHORT_TTLS, **overrides})
    if kind == "memory":
        return MemoryTaskStore(
            ttl_s=settings.result_ttl_s,
            task_index=settings.task_index,
            task_index_max_entries=settings.task_index_max_entries,
            task_index_max_age_s=settings.task_index_max_age_s,
        )
    return open_store(settings)  # type: ignore[return-value]


@pytest.fixture(params=["redis", "redis-cluster", "memory"])
def backing(request: pytest.FixtureRequest, redis_url: str) -> tuple[str, str]:
    """(kind, Redis URL): the shared Redis, the session's private cluster, or memory."""
    if request.param == "redis-cluster":
        return request.param, request.getfixturevalue("redis_cluster").url
    return request.param, redis_url


@pytest.fixture
def used() -> set[str]:
    """The queues a case wrote records in: their keys go at its end."""
    return set()


@pytest.fixture
async def store(
    backing: tuple[str, str], redis_url: str, used: set[str]
) -> AsyncIterator[IndexedStore]:
    chosen = _open(*backing)
    try:
        yield chosen
    finally:
        await chosen.close()
        await forget_task_keys(redis_url, used)


@pytest.fixture
def queue(qname: str, used: set[str]) -> str:
    used.add(qname)
    return qname


# The cases' times: ``at(ms)`` is ms milliseconds after a base set per case, a few seconds
# ago (within every index's age bound, also that of a test run beside us).
_base = [datetime.now(UTC)]


@pytest.fixture(autouse=True)
def _fresh_base() -> None:
    _base[0] = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=10)


def at(ms: int) -> datetime:
    """``ms`` milliseconds after the case's base time."""
    return _base[0] + timedelta(milliseconds=ms)


def record(queue: str, task_id: str, status: TaskStatus, ms: int, **fields: Any) -> TaskState:
    return TaskState(task_id=task_id, queue=queue, status=status, updated_at=at(ms), **fields)


async def every_page(store: TaskIndex, query: TaskQuery, most: int = 200) -> list[TaskPage]:
    """The pages of ``query`` from the first until the cursor runs out."""
    pages = [await store.list_tasks(query)]
    while pages[-1].next_cursor is not None and len(pages) < most:
        query = TaskQuery(**{**query.__dict__, "cursor": pages[-1].next_cursor})
        pages.append(await store.list_tasks(query))
    assert pages[-1].next_cursor is None, f"still a cursor after {most} pages"
    return pages


async def ids_of(store: TaskIndex, query: TaskQuery) -> list[str]:
    return [t.task_id for page in await every_page(store, query) for t in page.tasks]


async def test_tasks_are_listed_newest_first_with_their_records_now(
    store: IndexedStore, queue: str
) -> None:
    ids = [f"{uuid.uuid4().hex}-{i}" for i in range(5)]
    for i in (3, 0, 4, 1, 2):  # written out of order: the first record's time decides
        await store.record(record(queue, ids[i], S.QUEUED, 10 * i), only_if_new=True)
    await store.record(record(queue, ids[0], S.RUNNING, 100, attempt=1))
    page = await store.list_tasks(TaskQuery(queue=queue))
    assert [t.task_id for t in page.tasks] == ids[::-1]
    assert [t.indexed_at for t in page.tasks] == [at(10 * i) for i in range(4, -1, -1)]
    oldest = page.tasks[-1]
    assert oldest.queue == queue and oldest.state is not None
    assert (oldest.state.status, oldest.state.attempt) == (S.RUNNING, 1)
    assert page.next_cursor is None and page.scanned == 5


async def test_every_filter_answers_the_tasks_it_names(
    store: IndexedStore, queue: str, used: set[str]
) -> None:
    run = uuid.uuid4().hex[:12]
    t = {name: f"{run}-{name}" for name in "abcdefg"}
    finals: dict[str, tuple[TaskStatus, dict[str, Any]]] = {
        "a": (S.QUEUED, {}),
        "b": (S.RUNNING, {"attempt": 1}),
        "c": (S.SUCCEEDED, {"attempt": 1, "session_id": "s-1"}),
        "d": (
            S.DEAD_LETTERED,
            {"attempt": 3, "error": "ValueError: Boom", "reason": "retries_exhausted"},
        ),
        "e": (S.EXPIRED, {"reason": "expired"}),
        "f": (S.CANCELLED, {}),
        "g": (S.RETRYING, {"attempt": 1, "error": "TimeoutError: too slow"}),
    }
    for i, (name, (status, fields)) in enumerate(finals.items()):
        session = fields.get("session_id")
        await store.record(
            record(queue, t[name], S.QUEUED, 10 * i, session_id=session), only_if_new=True
        )
        if status is not S.QUEUED:
            await store.record(record(queue, t[name], status, 10 * i + 5, **fields))
    other = f"{queue}-other"
    used.add(other)
    await store.record(record(other, f"{run}-h", S.QUEUED, 70), only_if_new=True)

    async def names(**filters: Any) -> str:
        found = await ids_of(store, TaskQuery(**filters))
        return "".join(i.rsplit("-", 1)[1] for i in found)

    assert await names(queue=queue) == "gfedcba"
    assert await names(queue=other) == "h"
    for name, (status, _) in finals.items():
        assert await names(queue=queue, status=status) == name, status
    assert await names(queue=queue, since=at(30), until=at(60)) == "fed"
    assert await names(queue=queue, until=at(30)) == "cba"  # until: before, not at
    # Over every queue (since: only what this case and its neighbours wrote is scanned).
    assert await names(task_id_prefix=t["d"], since=at(0)) == "d"  # a whole id
    assert await names(task_id_prefix=run, since=at(0)) == "hgfedcba"
    assert await names(queue=queue, session_id="s-1") == "c"
    assert await names(queue=queue, error="boom") == "d"  # the error, in any case
    assert await names(queue=queue, error="EXPIRED") == "e"  # or the reason
    assert await names(queue=queue, error="slow") == "g"
    assert await names(queue=queue, error="nowhere") == ""
    (c,) = (await store.list_tasks(TaskQuery(queue=queue, status=S.SUCCEEDED))).tasks
    assert c.session_id == "s-1" and c.state is not None and c.state.attempt == 1


async def test_cursor_pages_answer_each_task_exactly_once_newest_first(
    store: IndexedStore, queue: str
) -> None:
    ids = [f"{uuid.uuid4().hex[:8]}-{i}" for i in range(130)]
    # Three tasks per millisecond: ties are where a cursor could repeat or skip one.
    await store.record_many(
        [record(queue, task_id, S.QUEUED, i // 3) for i, task_id in enumerate(ids)],
        only_if_new=True,
    )
    pages = await every_page(store, TaskQuery(queue=queue, limit=7))
    listed = [t for page in pages for t in page.tasks]
    assert sorted(t.task_id for t in listed) == sorted(ids)  # each once, none missing
    times = [t.indexed_at for t in listed]
    assert times == sorted(times, reverse=True)
    assert all(len(page.tasks) == 7 for page in pages[:-1]) and len(pages) == 19


async def test_a_sparse_filter_answers_a_cursor_instead_of_scanning_everything(
    store: IndexedStore, queue: str
) -> None:
    run = uuid.uuid4().hex[:8]
    count = SCAN_BUDGET + 100
    states = [record(queue, f"{run}-{i}", S.QUEUED, i) for i in range(count)]
    # The oldest task alone matches, and one more is dead-lettered right behind it.
    states[0] = states[0].model_copy(update={"session_id": "needle"})
    await store.record_many(states, only_if_new=True)
    await store.record(record(queue, f"{run}-1", S.DEAD_LETTERED, count, reason="rejected"))

    first = await store.list_tasks(TaskQuery(queue=queue, session_id="needle"))
    assert (first.tasks, first.scanned) == ([], SCAN_BUDGET)
    assert first.next_cursor is not None
    second = await store.list_tasks(
        TaskQuery(queue=queue, session_id="needle", cursor=first.next_cursor)
    )
    assert [t.task_id for t in second.tasks] == [f"{run}-0"]
    assert second.next_cursor is None and second.scanned == 100
    # A sparse status keeps its own index: its filter finds the task on the first page.
    dead = await store.list_tasks(TaskQuery(queue=queue, status=S.DEAD_LETTERED))
    assert [t.task_id for t in dead.tasks] == [f"{run}-1"]
    assert dead.scanned < SCAN_BUDGET


async def test_a_task_requeued_from_the_dlq_reads_queued_again_and_leaves_the_dead_filter(
    store: IndexedStore, queue: str
) -> None:
    task_id = uuid.uuid4().hex
    await store.record(record(queue, task_id, S.QUEUED, 0), only_if_new=True)
    await store.record(record(queue, task_id, S.DEAD_LETTERED, 10, attempt=1, reason="rejected"))
    assert await ids_of(store, TaskQuery(queue=queue, status=S.DEAD_LETTERED)) == [task_id]
    await store.record(record(queue, task_id, S.QUEUED, 20, attempt=1))  # weclaw-mq dlq requeue
    assert await ids_of(store, TaskQuery(queue=queue, status=S.DEAD_LETTERED)) == []
    assert await ids_of(store, TaskQuery(queue=queue, status=S.QUEUED)) == [task_id]
    events = await store.timeline(task_id)
    assert [(e.status, e.at) for e in events] == [
        (S.QUEUED, at(0)),
        (S.DEAD_LETTERED, at(10)),
        (S.QUEUED, at(20)),
    ]
    assert events[1].reason == "rejected"


async def test_a_publish_the_broker_refused_leaves_no_index_entry(
    store: IndexedStore, queue: str
) -> None:
    kept, refused = uuid.uuid4().hex, uuid.uuid4().hex
    await store.record(record(queue, kept, S.QUEUED, 0), only_if_new=True)
    await store.record(record(queue, refused, S.QUEUED, 1), only_if_new=True)
    await store.forget_queued(queue, refused)
    assert await ids_of(store, TaskQuery(queue=queue)) == [kept]
    assert await ids_of(store, TaskQuery(task_id_prefix=refused, since=at(0))) == []


async def test_the_timeline_of_a_task_retried_twice_then_succeeded(
    store: IndexedStore, queue: str
) -> None:
    task_id = uuid.uuid4().hex
    await store.record(record(queue, task_id, S.QUEUED, 0), only_if_new=True)
    for attempt in (1, 2, 3):
        owner = new_owner()
        running = record(queue, task_id, S.RUNNING, 10 * attempt, attempt=attempt)
        await store.claim(queue, task_id, owner, running=running)
        if attempt < 3:
            error = f"RuntimeError: attempt {attempt} fails"
            await store.record(
                record(queue, task_id, S.RETRYING, 10 * attempt + 5, attempt=attempt, error=error)
            )
            await store.release(queue, task_id, owner)
    done = record(queue, task_id, S.SUCCEEDED, 40, attempt=3, result="ok")
    await store.finish(queue, task_id, done, owner=owner)
    events = await store.timeline(task_id)
    assert [(e.status, e.attempt) for e in events] == RETRIED_TWICE
    assert [e.error for e in events if e.status is S.RETRYING] == [
        "RuntimeError: attempt 1 fails",
        "RuntimeError: attempt 2 fails",
    ]
    assert {e.queue for e in events} == {queue}
    assert await store.timeline(task_id, queue=f"{queue}-other") == []
    assert await store.timeline(uuid.uuid4().hex) == []


async def test_a_cancelled_task_reads_cancelled_in_its_timeline_and_filter(
    store: IndexedStore, queue: str
) -> None:
    task_id = uuid.uuid4().hex
    await store.record(record(queue, task_id, S.QUEUED, 0), only_if_new=True)
    await store.cancel(task_id, queue=queue)
    assert [e.status for e in await store.timeline(task_id)] == [S.QUEUED, S.CANCELLED]
    assert await ids_of(store, TaskQuery(queue=queue, status=S.CANCELLED)) == [task_id]


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_the_index_off_raises_and_keeps_no_timeline(
    kind: str, redis_url: str, qname: str
) -> None:
    queue = qname
    store = _open(kind, redis_url, task_index=False)
    task_id = uuid.uuid4().hex
    try:
        await store.record(record(queue, task_id, S.QUEUED, 0), only_if_new=True)
        owner = new_owner()
        await store.claim(queue, task_id, owner, running=record(queue, task_id, S.RUNNING, 1))
        await store.finish(queue, task_id, record(queue, task_id, S.SUCCEEDED, 2), owner=owner)
        state = await store.get(task_id, queue=queue)
        assert state is not None and state.status is S.SUCCEEDED  # records as ever
        with pytest.raises(ConfigurationError, match=re.escape(INDEX_OFF)):
            await store.list_tasks(TaskQuery())
        with pytest.raises(ConfigurationError, match="WECLAW_MQ_TASK_INDEX=false"):
            await store.timeline(task_id)
        if isinstance(store, RedisTaskStore):
            client = open_client(settings_for("amqp://unused", redis_url))
            try:
                assert await client.exists(timeline_key(task_id)) == 0
            finally:
                await client.aclose()
    finally:
        await store.close()
        await forget_task_keys(redis_url, [queue])


@pytest.fixture(params=["redis", "memory"])
def bounded(request: pytest.FixtureRequest) -> Callable[..., IndexedStore]:
    """Stores with tight index bounds: on a private Redis (the shared index is everyone's)."""
    url = "redis://unused"
    if request.param == "redis":
        url = request.getfixturevalue("private_redis").url
    return lambda **bounds: _open(request.param, url, **bounds)


async def _trimmed(store: IndexedStore) -> None:
    # The Redis store trims every TRIM_EVERY index writes; here at once.
    if isinstance(store, RedisTaskStore):
        await store.index.trim_soon()


async def test_the_index_keeps_the_newest_entries_up_to_its_count_bound(
    bounded: Callable[..., IndexedStore], qname: str
) -> None:
    store = bounded(task_index_max_entries=5)
    ids = [f"{uuid.uuid4().hex}-{i}" for i in range(8)]
    try:
        for i, task_id in enumerate(ids):
            await store.record(record(qname, task_id, S.QUEUED, i), only_if_new=True)
        await store.record(record(qname, ids[0], S.EXPIRED, 50, reason="expired"))
        await _trimmed(store)
        assert await ids_of(store, TaskQuery()) == ids[:2:-1]
        assert await ids_of(store, TaskQuery(queue=qname)) == ids[:2:-1]
        assert await ids_of(store, TaskQuery(status=S.EXPIRED)) == []  # its entry went too
    finally:
        await store.close()


async def test_the_index_drops_entries_older_than_its_age_bound(
    bounded: Callable[..., IndexedStore], qname: str
) -> None:
    store = bounded(task_index_max_age_s=60)
    now = datetime.now(UTC)
    ids = [uuid.uuid4().hex for _ in range(3)]
    try:
        for task_id, age_s in zip(ids, (120, 90, 1), strict=True):
            state = TaskState(
                task_id=task_id,
                queue=qname,
                status=S.QUEUED,
                updated_at=now - timedelta(seconds=age_s),
            )
            await store.record(state, only_if_new=True)
        await _trimmed(store)
        assert await ids_of(store, TaskQuery(queue=qname)) == [ids[2]]
        assert await ids_of(store, TaskQuery()) == [ids[2]]
    finally:
        await store.close()


async def test_writers_of_a_few_records_each_keep_the_index_within_its_count_bound(
    private_redis: PrivateRedis, qname: str
) -> None:
    # Each store is a short-lived producer (a script, a CLI call): none writes TRIM_EVERY
    # records, and the index grew past its bound for good when only that many trimmed.
    most, per_writer = 5, 3
    for writer in range(6):
        store = _open("redis", private_redis.url, task_index_max_entries=most)
        try:
            for i in range(per_writer):
                task_id = f"{writer}-{i}-{uuid.uuid4().hex}"
                await store.record(
                    record(qname, task_id, S.QUEUED, writer * 10 + i), only_if_new=True
                )
        finally:
            await store.close()
    reader = _open("redis", private_redis.url, task_index_max_entries=most)
    try:
        assert len(await ids_of(reader, TaskQuery())) <= most + per_writer
    finally:
        await reader.close()


# -- through a real worker ------------------------------------------------------------------
@pytest.fixture
async def app_on(
    backing: tuple[str, str], broker_url: str, redis_url: str
) -> AsyncIterator[Callable[..., App]]:
    """Apps on the case's store and the test broker; closed and cleaned up at teardown."""
    apps: list[App] = []
    stores: list[IndexedStore] = []

    def factory(**overrides: Any) -> App:
        settings = settings_for(broker_url, backing[1], **{**SHORT_TTLS, **overrides})
        store = None
        if backing[0] == "memory":
            store = _open("memory", backing[1], **overrides)
            stores.append(store)
        app = App("test", settings=settings, store=store)
        apps.append(app)
        return app

    yield factory
    await close_apps(apps, broker_url, redis_url)
    for chosen in stores:
        await chosen.close()


async def test_a_worker_run_leaves_index_entries_and_timelines(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on()

    @app.handler(qname, retry=RetryPolicy(max_retries=3, delay_s=0.2))
    async def flaky(task: Job, ctx: Context) -> int:
        if task.n == 1 and ctx.attempt < 3:
            raise RuntimeError(f"attempt {ctx.attempt} fails")
        return ctx.attempt

    await start_worker(app)
    retried = await app.publish(qname, Job(n=1))
    plain = await app.publish(qname, Job(n=2), session_id="session-7")
    assert (await app.result(retried, timeout_s=20)).result == 3
    assert (await app.result(plain, timeout_s=20)).result == 1

    page = await app.tasks(TaskQuery(queue=qname))
    assert [t.task_id for t in page.tasks] == [plain, retried]
    assert all(t.state is not None and t.state.status is S.SUCCEEDED for t in page.tasks)
    assert page.tasks[0].session_id == "session-7"
    session = await app.tasks(TaskQuery(queue=qname, session_id="session-7"))
    assert [t.task_id for t in session.tasks] == [plain]
    events = await app.timeline(retried)
    assert [(e.status, e.attempt) for e in events] == RETRIED_TWICE
    assert "attempt 2 fails" in (events[4].error or "")
    assert [e.status for e in await app.timeline(plain, queue=qname)] == [
        S.QUEUED,
        S.RUNNING,
        S.SUCCEEDED,
    ]


async def test_a_task_published_without_results_is_indexed_by_its_worker(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    producer = app_on(results_enabled=False)
    producer.handler(qname)(_noop)
    worker_app = app_on()
    worker_app.handler(qname)(_noop)
    await start_worker(worker_app)
    task_id = await producer.publish(qname, Job())
    state = await worker_app.result(task_id, timeout_s=15)
    assert state.status is S.SUCCEEDED
    page = await worker_app.tasks(TaskQuery(queue=qname))
    assert [t.task_id for t in page.tasks] == [task_id]
    assert [e.status for e in await worker_app.timeline(task_id)] == [S.RUNNING, S.SUCCEEDED]
    with pytest.raises(ConfigurationError, match="results are turned off"):
        await producer.tasks()


async def _noop(task: Job) -> None:
    return None


async def test_app_tasks_refuses_an_invalid_queue_and_task_id(
    app_on: Callable[..., App],
) -> None:
    app = app_on()
    with pytest.raises(ConfigurationError, match="queue name"):
        await app.tasks(TaskQuery(queue="amq.nope"))
    with pytest.raises(ConfigurationError):
        await app.timeline("")

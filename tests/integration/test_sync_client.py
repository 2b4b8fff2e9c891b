"""``app.sync`` on the real broker and Redis: blocking calls from plain threads (as a Django or
Flask view makes them), one background loop and one connection per process, the async API's
errors, and a forked child (gunicorn's workers) that opens its own connection.

The calls are made from threads (``asyncio.to_thread``) while this test's loop runs the worker:
``app.sync`` is for code without an event loop, and refuses a thread that runs one."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel

from tests.broker_ctl import broker_ctl
from tests.conftest import settings_for
from weclaw_mq import (
    App,
    ConfigurationError,
    Context,
    PayloadValidationError,
    ResultTimeoutError,
    TaskStatus,
    UnroutableError,
)
from weclaw_mq.state import TaskState

THREADS = 8
# How long a forked child may take to publish and read its result; never reached when it works.
CHILD_BOUND_S = 60


class Sum(BaseModel):
    a: int
    b: int


@pytest.fixture
async def producer(broker_url: str, redis_url: str, qname: str) -> AsyncIterator[App]:
    """An App used only through ``sync`` (named after the test's queue, so its connection is
    found by name); closed on its own loop at teardown."""
    app = App(f"sync-{qname}", settings=settings_for(broker_url, redis_url))
    yield app
    await asyncio.to_thread(app.sync.close)


@pytest.fixture
async def worker_app(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> App:
    app = make_app()

    @app.handler(qname)
    async def add(task: Sum, ctx: Context) -> int:
        await ctx.emit(f"{task.a}+{task.b}")
        return task.a + task.b

    await start_worker(app)
    return app


def _producer_connections(name: str) -> int:
    listing = broker_ctl("-q", "list_connections", "client_properties")
    return sum(f'{{"connection_name","{name}-producer"}}' in line for line in listing.splitlines())


async def test_eight_threads_publish_and_wait_over_one_connection(
    producer: App, worker_app: App, qname: str
) -> None:
    def one(n: int) -> tuple[str, TaskState]:
        task_id = producer.sync.publish(qname, {"a": n, "b": 1})
        return task_id, producer.sync.result(task_id, timeout_s=30)

    def all_at_once() -> list[tuple[str, TaskState]]:
        out: list[tuple[str, TaskState]] = []
        lock = threading.Lock()
        barrier = threading.Barrier(THREADS)

        def run(n: int) -> None:
            barrier.wait()
            got = one(n)
            with lock:
                out.append(got)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    finals = await asyncio.to_thread(all_at_once)

    assert sorted(f.result for _, f in finals) == [n + 1 for n in range(THREADS)]
    assert {f.status for _, f in finals} == {TaskStatus.SUCCEEDED}
    assert len({task_id for task_id, _ in finals}) == THREADS
    assert await asyncio.to_thread(_producer_connections, producer.name) == 1


async def test_sync_calls_raise_what_the_async_api_raises(
    producer: App, worker_app: App, qname: str
) -> None:
    producer.handler(qname)(_typed_add)  # the model checks payloads before they are sent

    def calls() -> list[BaseException]:
        raised: list[BaseException] = []
        for call in (
            lambda: producer.sync.publish(qname, {"a": "not a number", "b": 1}),
            lambda: producer.sync.publish(f"{qname}-nobody", {"a": 1, "b": 1}),
            lambda: producer.sync.result("never-published-" + qname, timeout_s=0.2),
        ):
            try:
                call()
            except Exception as e:
                raised.append(e)
        return raised

    raised = await asyncio.to_thread(calls)
    assert [type(e) for e in raised] == [
        PayloadValidationError,
        UnroutableError,
        ResultTimeoutError,
    ]


async def _typed_add(task: Sum) -> int:
    return task.a + task.b


async def test_status_cancel_stream_and_a_batch_from_a_thread(
    producer: App, worker_app: App, qname: str
) -> None:
    def run() -> tuple[Any, ...]:
        task_id = producer.sync.publish(qname, {"a": 2, "b": 3})
        events = list(producer.sync.stream(task_id, queue=qname))
        status = producer.sync.status(task_id, queue=qname)
        later = producer.sync.publish(qname, {"a": 0, "b": 0}, delay_s=60)
        cancelled = producer.sync.cancel(later, queue=qname)
        batch = producer.sync.publish_many(qname, [{"a": n, "b": n} for n in range(3)])
        sums = [producer.sync.result(t, timeout_s=30).result for t in batch]
        assert sums == [0, 2, 4]
        return events, status, cancelled, producer.sync.status(later, queue=qname)

    events, status, cancelled, later = await asyncio.wait_for(asyncio.to_thread(run), 60)

    assert [e.data for e in events if e.kind == "chunk"] == ["2+3"]
    assert events[-1].kind == "final" and events[-1].result == 5
    assert status is not None and status.status is TaskStatus.SUCCEEDED
    assert cancelled.changed and later is not None and later.status is TaskStatus.CANCELLED


async def test_a_thread_that_runs_an_event_loop_is_told_to_await(producer: App, qname: str) -> None:
    with pytest.raises(ConfigurationError, match=r"await app\.publish"):
        producer.sync.publish(qname, {"a": 1, "b": 2})


async def test_a_forked_child_publishes_over_a_connection_of_its_own(
    producer: App, worker_app: App, qname: str
) -> None:
    def fork_and_publish() -> tuple[int, TaskState]:
        # The parent's loop and connection are in use before the fork (gunicorn's preload).
        first = producer.sync.publish(qname, {"a": 1, "b": 1})
        pid = os.fork()
        if pid == 0:  # the child: its exit code says what it saw
            threading.Timer(CHILD_BOUND_S, os._exit, (3,)).start()
            try:
                task_id = producer.sync.publish(qname, {"a": 20, "b": 1})
                final = producer.sync.result(task_id, timeout_s=CHILD_BOUND_S)
                code = 0 if final.result == 21 else 1
            except BaseException:
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status), producer.sync.result(first, timeout_s=30)

    code, parents = await asyncio.wait_for(asyncio.to_thread(fork_and_publish), CHILD_BOUND_S + 30)

    assert code == 0, "the child could not publish and read its result (3: it hung)"
    assert parents.result == 2  # the parent's App still works after the fork

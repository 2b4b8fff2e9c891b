"""Statuses of tasks that went through the local outbox never lie (issue 24, items 1 and 3):
the relay's late ``queued`` never hides what a worker wrote, nor does a ``stored_locally``
written after a confirm that came too late, and a lifetime that ends in the outbox reads
``expired``. Real broker, real Redis, real SQLite; a closed port stands in for the broker
being down."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import queue_depth, wait_until
from weclaw_mq import App, Reject, TaskState, TaskStatus
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.errors import ConfirmTimeoutError
from weclaw_mq.outbox.relay import Relay


class Job(BaseModel):
    n: int


def rejecting(app: App, queue: str, **options: Any) -> App:
    """``queue``'s handler dead-letters every task at once (the fast worker of the issue)."""

    @app.handler(queue, **options)
    async def work(job: Job) -> int:
        raise Reject(f"task {job.n} is rejected")

    return app


async def drain(app: App) -> int:
    """Drain ``app``'s outbox once with a relay of the test's own (the app's own is off)."""
    relay = Relay(await app.start_outbox(), app.settings, app.metrics, store=app.results)
    try:
        return await relay.drain()
    finally:
        await relay.close()


@pytest.fixture
def down(down_apps: Callable[..., App], tmp_path: Path) -> Callable[..., App]:
    """Apps whose broker is a closed port, on the test's outbox file; closed at teardown."""
    path = str(tmp_path / "outbox.db")
    return lambda **overrides: down_apps(outbox_path=path, outbox_relay_in_app=False, **overrides)


@pytest.fixture
def up(make_app: Callable[..., App], tmp_path: Path) -> Callable[..., App]:
    """Apps on the shared broker and the same outbox file (their queues go at teardown)."""

    def build(**overrides: Any) -> App:
        return make_app(
            "up",
            outbox_path=str(tmp_path / "outbox.db"),
            outbox_relay_in_app=False,
            **overrides,
        )

    return build


async def test_a_task_the_worker_dead_lettered_never_reads_queued_after_the_relay_sent_it(
    down: Callable[..., App],
    up: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    producer = down()
    ids = await producer.publish_many(qname, [{"n": i} for i in range(200)])
    first = await producer.status(ids[0])
    assert first is not None and first.status is TaskStatus.STORED_LOCALLY

    app = rejecting(up(), qname)
    await app.declare()
    await start_worker(app, concurrency=16)
    assert await drain(app) == len(ids)

    async def in_dlq() -> bool:
        return await queue_depth(amqp, dlq_name(qname)) == len(ids)

    await wait_until(in_dlq, 60, "every task in the DLQ")
    # The worker records dead_lettered just after the move: result() waits for that (and,
    # over a record turned back to queued, times out "last status: queued").
    ended = await asyncio.gather(
        *(app.result(t, timeout_s=10) for t in ids), return_exceptions=True
    )
    lying = [e for e in ended if not isinstance(e, TaskState)]
    assert lying == [], f"{len(lying)} of {len(ids)} tasks in the DLQ never read final"
    assert {e.status for e in ended if isinstance(e, TaskState)} == {TaskStatus.DEAD_LETTERED}
    # drain() returned: every "queued" write of the relay has landed or been refused.
    statuses = await asyncio.gather(*(app.status(t) for t in ids))
    assert {s.status if s is not None else None for s in statuses} == {TaskStatus.DEAD_LETTERED}
    async with asyncio.timeout(10):  # a stream reader gets its final event
        events = [e async for e in app.stream(ids[-1])]
    assert events[-1].kind == "final" and events[-1].status == TaskStatus.DEAD_LETTERED.value


async def test_a_confirm_that_comes_too_late_never_turns_a_dead_letter_into_stored_locally(
    up: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = rejecting(up(), qname)
    await app.declare()
    await start_worker(app)
    send = app._engine._send

    async def confirmed_too_late(queue: str, message: aio_pika.Message) -> str:
        """The broker took the task and a worker ended it before the confirm came back: the
        publish times out, and the outbox keeps a copy (the unknown outcome)."""
        task_id = await send(queue, message)

        async def dead_lettered() -> bool:
            state = await app.status(task_id)
            return state is not None and state.status is TaskStatus.DEAD_LETTERED

        await wait_until(dead_lettered, 20, "the worker to dead-letter the task")
        raise ConfirmTimeoutError("no confirm in time", queue=queue, task_id=task_id)

    monkeypatch.setattr(app._engine, "_send", confirmed_too_late)
    task_id = await app.publish(qname, {"n": 1})
    assert await app.stored_locally(task_id)

    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.DEAD_LETTERED
    assert (await app.result(task_id, timeout_s=5)).status is TaskStatus.DEAD_LETTERED

    # The relay sends the outbox's copy: its "queued" does not land over the dead letter, and
    # the copy ends in the DLQ beside the first.
    assert await drain(app) == 1

    async def both_dead_lettered() -> bool:
        state = await app.status(task_id)
        in_dlq = await queue_depth(amqp, dlq_name(qname))
        return in_dlq == 2 and state is not None and state.status is TaskStatus.DEAD_LETTERED

    await wait_until(both_dead_lettered, 30, "both copies in the DLQ, the task dead_lettered")


async def test_a_lifetime_that_ends_in_the_outbox_reads_expired(
    down: Callable[..., App], up: Callable[..., App], qname: str
) -> None:
    producer = down()
    task_id = await producer.publish(qname, {"n": 1}, ttl_s=0.5)
    state = await producer.status(task_id)
    assert state is not None and state.status is TaskStatus.STORED_LOCALLY

    async def expired() -> bool:
        seen = await producer.status(task_id)
        return seen is not None and seen.status is TaskStatus.EXPIRED

    await wait_until(expired, 10, "the stored_locally task to read expired past its deadline")
    assert (await producer.result(task_id, timeout_s=5)).status is TaskStatus.EXPIRED

    # Relayed after its deadline, it still reads expired (no worker runs it).
    app = up()
    app.handler(qname)(_ignored)
    await app.declare()
    assert await drain(app) == 1
    relayed = await app.status(task_id)
    assert relayed is not None and relayed.status is TaskStatus.EXPIRED


async def test_a_lifetime_that_ends_in_the_outbox_reads_expired_without_a_record(
    up: Callable[..., App], qname: str, tmp_path: Path
) -> None:
    """Added in the caller's own SQLite transaction: no record exists, the outbox answers."""
    app = up(task_ttl_s=0.5)
    app.handler(qname)(_ignored)
    await app.start_outbox()
    with sqlite3.connect(tmp_path / "outbox.db") as conn:
        task_id = app.add_to_outbox(conn, qname, {"n": 1})

    async def expired() -> bool:
        seen = await app.status(task_id)
        return seen is not None and seen.status is TaskStatus.EXPIRED

    await wait_until(expired, 10, "the task in the outbox to read expired past its deadline")
    assert (await app.result(task_id, timeout_s=5)).status is TaskStatus.EXPIRED


async def _ignored(job: Job) -> None:
    return None

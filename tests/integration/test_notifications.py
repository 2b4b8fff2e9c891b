"""Result notifications (``notify=``) on the real broker and Redis: every final state reaches
the results queue before its task is acked, a notification handler with the guard runs once
per notification, and a failed notification keeps its task from being acked."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import (
    delete_queues,
    forget_task_keys,
    next_message,
    outcome_count,
    queue_depth,
    settings_for,
    wait_until,
)
from tests.integration.fixture_apps import guard_app
from tests.integration.processes import CONSUMING_MARK, WorkerProcess, all_empty, queue_names
from weclaw_mq import App, Context, Reject, Settings, TaskNotification, TaskStatus
from weclaw_mq.contract.naming import results_queue_name
from weclaw_mq.handlers.notifications import notification_id
from weclaw_mq.wire.topology import QueueSpec, work_queue_arguments

SHORT_TTLS: dict[str, Any] = {"result_ttl_s": 300, "done_ttl_s": 300}


class Job(BaseModel):
    n: int


def notifications(app: App, queue: str, outcome: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_notifications_total", {"queue": queue, "outcome": outcome}
    )
    return value or 0.0


class NotificationLog:
    """What a guarded notification handler on the results queue received, in this process."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()  # handler runs per notification (message) id
        self.by_task: dict[str, list[TaskNotification]] = defaultdict(list)
        self.trace_ids: set[str] = set()
        self.on_note: Callable[[TaskNotification], None] = lambda note: None

    def register(self, app: App, results_queue: str) -> None:
        @app.handler(results_queue)
        async def notified(note: TaskNotification, ctx: Context) -> None:
            self.runs[ctx.task_id] += 1
            self.by_task[note.task_id].append(note)
            self.trace_ids.add(ctx.trace_id)
            self.on_note(note)


async def test_each_of_500_final_states_reaches_a_guarded_notification_handler_once(
    qname: str, make_app: Callable[..., App], start_worker: Callable[..., Any]
) -> None:
    app = make_app(retry_delay_s=0.2, **SHORT_TTLS)
    results = results_queue_name(qname)
    received = NotificationLog()

    @app.handler(qname, notify=True)
    async def work(task: Job) -> dict[str, int]:
        if task.n % 50 == 0:
            raise Reject("multiples of 50 are refused")
        return {"double": 2 * task.n}

    received.register(app, results)
    await start_worker(app, concurrency=32)
    ids = await app.publish_many(qname, [Job(n=n) for n in range(500)], trace_id="trace-500")

    await wait_until(lambda: len(received.by_task) == 500, 60, "500 notifications")
    await wait_until(
        lambda: (
            outcome_count(app, qname, "acked") + outcome_count(app, qname, "dead_lettered") == 500
        ),
        10,
        "every task settled",
    )
    assert set(received.by_task) == set(ids)
    assert all(len(notes) == 1 for notes in received.by_task.values())
    assert set(received.runs.values()) == {1}
    assert outcome_count(app, results, "duplicate") == 0
    assert notifications(app, qname, "published") == 500
    assert notifications(app, qname, "failed") == 0
    # The notification handler ran under the task's own trace id.
    assert received.trace_ids == {"trace-500"}
    for n, task_id in enumerate(ids):
        (note,) = received.by_task[task_id]
        assert (note.queue, note.attempt, note.trace_id) == (qname, 1, "trace-500")
        if n % 50 == 0:
            assert note.status is TaskStatus.DEAD_LETTERED
            assert (note.reason, note.error_type) == ("rejected", "weclaw_mq.Reject")
            assert note.error == "Reject: multiples of 50 are refused"
            assert note.result is None
        else:
            assert note.status is TaskStatus.SUCCEEDED
            assert note.result == {"double": 2 * n}
            assert note.error is None
        assert received.runs[notification_id(task_id, note.status)] == 1
    # The record a consumer reads back agrees with what it was told.
    state = await app.status(ids[1], queue=qname)
    assert state is not None and state.result == {"double": 2}


async def declare_bounded_results_queue(amqp: AbstractChannel, queue: str) -> str:
    """Declare ``queue``'s results queue first, holding at most one message: the worker keeps
    it as it is (no conflict), and the broker refuses (nacks) publishes while it is full."""
    results = results_queue_name(queue)
    bounded = {**work_queue_arguments(QueueSpec(results, (), delivery_limit=10)), "x-max-length": 1}
    await amqp.declare_queue(results, durable=True, arguments=bounded)  # type: ignore[arg-type]
    return results


async def test_a_notification_the_results_queue_refuses_keeps_its_task_unacked_until_it_is_out(
    qname: str,
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
) -> None:
    results = await declare_bounded_results_queue(amqp, qname)
    app = make_app(retry_delay_s=0.2, **SHORT_TTLS)
    runs: Counter[str] = Counter()

    @app.handler(qname, notify=True)
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        runs[ctx.task_id] += 1
        return {"n": task.n}

    await start_worker(app, concurrency=4)
    await _fill_until_refused(amqp, results)
    task_id = await app.publish(qname, Job(n=2))
    # Refused, parked in the delay queue, back, refused again: never acked meanwhile.
    await wait_until(lambda: notifications(app, qname, "failed") >= 3, 20, "three refusals")
    assert outcome_count(app, qname, "acked") + outcome_count(app, qname, "duplicate") == 0
    assert outcome_count(app, qname, "deferred") >= 2
    assert notifications(app, qname, "published") == 0
    state = await app.status(task_id, queue=qname)
    assert state is not None and state.status is TaskStatus.SUCCEEDED  # stored before notifying

    # Room in the results queue: the parked task's next return finds it done, publishes the
    # notification, and only then is acked (as a copy of a finished task).
    await (await amqp.get_queue(results, ensure=False)).purge()
    await wait_until(lambda: outcome_count(app, qname, "duplicate") == 1, 20, "the task acked")
    assert outcome_count(app, qname, "acked") == 0
    announced = await next_message(amqp, results)
    assert announced.message_id == notification_id(task_id, TaskStatus.SUCCEEDED)
    note = TaskNotification.model_validate_json(announced.body)
    assert (note.task_id, note.status, note.result) == (task_id, TaskStatus.SUCCEEDED, {"n": 2})
    assert notifications(app, qname, "published") == 1
    # The handler ran once: each return found the task done and only notified.
    assert runs == Counter({task_id: 1})
    assert await queue_depth(amqp, qname) == 0


@pytest.mark.parametrize("where", ["queued", "in_its_delay_queue", "running"])
async def test_a_cancelled_task_is_announced_once_before_its_ack(
    qname: str,
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    where: str,
) -> None:
    app = make_app(retry_delay_s=0.2, **SHORT_TTLS)
    results = results_queue_name(qname)
    started = asyncio.Event()

    @app.handler(qname, notify=True)
    async def work(task: Job, ctx: Context) -> None:
        if where == "in_its_delay_queue":
            raise RuntimeError("the model API is down")  # off to the delay queue
        started.set()
        await asyncio.sleep(30)  # cancelled while it runs

    await app.declare()
    if where == "queued":
        task_id = await app.publish(qname, Job(n=1))
        assert (await app.cancel(task_id)).changed
        await start_worker(app)
    else:
        await start_worker(app)
        task_id = await app.publish(qname, Job(n=1))
        if where == "running":
            await asyncio.wait_for(started.wait(), 10)
        else:

            async def retrying() -> bool:
                state = await app.status(task_id)
                return state is not None and state.status is TaskStatus.RETRYING

            await wait_until(retrying, 10, "the task in its delay queue")
        assert (await app.cancel(task_id)).changed

    await wait_until(lambda: outcome_count(app, qname, "cancelled") == 1, 10, "the cancel acked")
    # Confirmed before the ack: the notification is in the results queue already.
    assert await queue_depth(amqp, results) == 1
    announced = await next_message(amqp, results)
    assert announced.message_id == notification_id(task_id, TaskStatus.CANCELLED)
    assert announced.message_id == f"cancelled:{task_id}"
    note = TaskNotification.model_validate_json(announced.body)
    attempt = 2 if where == "in_its_delay_queue" else 1
    assert (note.task_id, note.queue, note.status, note.attempt) == (
        task_id,
        qname,
        TaskStatus.CANCELLED,
        attempt,
    )
    assert (note.result, note.error, note.reason) == (None, None, None)
    assert notifications(app, qname, "published") == 1
    assert await queue_depth(amqp, results) == 0  # once
    state = await app.status(task_id, queue=qname)
    assert state is not None and state.status is TaskStatus.CANCELLED


async def test_a_cancelled_task_whose_notification_is_refused_is_not_acked_until_it_is_out(
    qname: str,
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
) -> None:
    results = await declare_bounded_results_queue(amqp, qname)
    app = make_app(retry_delay_s=0.2, **SHORT_TTLS)

    @app.handler(qname, notify=True)
    async def work(task: Job) -> None:
        raise AssertionError("a cancelled task never runs")

    await app.declare()
    task_id = await app.publish(qname, Job(n=1))
    assert (await app.cancel(task_id)).changed
    await _fill_until_refused(amqp, results)
    await start_worker(app)
    # Refused, parked in the delay queue, back to its cancel marker, refused again.
    await wait_until(lambda: notifications(app, qname, "failed") >= 2, 20, "two refusals")
    assert outcome_count(app, qname, "cancelled") == 0
    assert outcome_count(app, qname, "deferred") >= 1

    await (await amqp.get_queue(results, ensure=False)).purge()
    await wait_until(lambda: outcome_count(app, qname, "cancelled") == 1, 20, "the cancel acked")
    assert notifications(app, qname, "published") == 1
    announced = await next_message(amqp, results)
    assert announced.message_id == notification_id(task_id, TaskStatus.CANCELLED)
    assert TaskNotification.model_validate_json(announced.body).status is TaskStatus.CANCELLED
    assert await queue_depth(amqp, results) == 0
    assert await queue_depth(amqp, qname) == 0


async def test_the_results_queue_declares_idempotently_and_keeps_its_consumers_own_arguments(
    qname: str, make_app: Callable[..., App], amqp: AbstractChannel
) -> None:
    results = results_queue_name(qname)
    # One app: the notification handler (own max_length) is registered after the announcing
    # handler, and its own arguments still win.
    app = make_app()

    @app.handler(qname, notify=True)
    async def work(task: Job) -> None: ...

    @app.handler(results, max_length=5)
    async def notified(note: TaskNotification) -> None: ...

    assert results in await app.declare()
    # Another process with only the announcing handler: declared again and again, no conflict.
    announcer = make_app()

    @announcer.handler(qname, notify=True)
    async def work_too(task: Job) -> None: ...

    for _ in range(2):
        assert (await announcer.declare())[-2:] == [f"{results}.dlq", results]
    # The queue still holds its max length: the second publish past it is refused.
    await _fill_until_refused(amqp, results)
    assert await queue_depth(amqp, results) <= 6


async def _fill_until_refused(channel: AbstractChannel, queue: str) -> None:
    """Publish fillers (with confirms) until the broker nacks one. A quorum queue's length
    limit is soft: the publish that crosses it is still accepted; the ones after are not."""
    for n in range(50):
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}", message_id=f"filler-{n}"), routing_key=queue
            )
        except aio_pika.exceptions.DeliveryError:
            return
    raise AssertionError(f"{queue} never refused a publish")


class Fleet:
    """Worker processes of the guard fixture app with ``notify=True`` on one queue, and the
    in-process notification handler on its results queue (its worker started by the test)."""

    def __init__(self, queue: str, settings: Settings, work_dir: Path, consumer: App) -> None:
        self.queue = queue
        self.settings = settings
        self.work_dir = work_dir
        self.record_key = f"weclaw-test:{queue}"
        self.publisher = guard_app.build_app(
            queue, settings=settings, record_key=self.record_key, notify=True
        )
        self.consumer = consumer
        self.received = NotificationLog()
        self.received.register(consumer, results_queue_name(queue))
        self.workers: list[WorkerProcess] = []

    def spawn(self, **kwargs: Any) -> WorkerProcess:
        worker = guard_app.spawn_worker(
            queue=self.queue,
            record_key=self.record_key,
            settings=self.settings,
            log_path=self.work_dir / f"worker-{len(self.workers)}.log",
            notify=True,
            **kwargs,
        )
        self.workers.append(worker)
        return worker

    async def handler_runs(self, client: aioredis.Redis) -> list[str]:
        """Task ids, one per completed run of the producing handler (recorded in Redis)."""
        runs = await client.lrange(guard_app.runs_key(self.record_key), 0, -1)
        return [guard_app.as_text(r) for r in runs]


@pytest.fixture
async def fleet(
    qname: str,
    broker_url: str,
    redis_url: str,
    make_app: Callable[..., App],
    tmp_path: Path,
) -> AsyncIterator[Fleet]:
    # Short leases and delays: a killed worker's claims lapse, and its tasks come back, fast.
    settings = settings_for(
        broker_url, redis_url, guard_lease_s=1.0, retry_delay_s=0.2, **SHORT_TTLS
    )
    fleet = Fleet(qname, settings, tmp_path, make_app("notified", **SHORT_TTLS))
    client = aioredis.Redis.from_url(redis_url)
    try:
        await fleet.publisher.declare()
        yield fleet
    finally:
        for worker in fleet.workers:
            worker.kill()
        await fleet.publisher.close()
        # Not the results queues: the consumer's worker (stopped after this fixture) would
        # declare them again; make_app deletes them once it has stopped.
        results = results_queue_name(qname)
        own = [n for n in queue_names(fleet.publisher) if not n.startswith(results)]
        await delete_queues(broker_url, own)
        await forget_task_keys(redis_url, [qname])
        await client.delete(*guard_app.record_keys(fleet.record_key))
        await client.aclose()


async def test_a_worker_killed_between_storing_the_result_and_notifying_notifies_on_redelivery(
    fleet: Fleet, broker_url: str, redis_client: aioredis.Redis, start_worker: Callable[..., Any]
) -> None:
    received = fleet.received
    await start_worker(fleet.consumer)
    first = fleet.spawn(die_after_store=True)
    await first.wait_consuming()
    task_id = await fleet.publisher.publish(fleet.queue, guard_app.Job(n=7, die_after_store=True))
    # Killed with the result and the done marker stored, before the notification.
    assert await first.wait_exit(20) == -signal.SIGKILL, first.describe()
    assert received.runs == Counter()

    second = fleet.spawn()
    await second.wait_consuming()
    await wait_until(lambda: task_id in received.by_task, 20, "the notification")
    queues = [fleet.queue, results_queue_name(fleet.queue)]
    await wait_until(lambda: all_empty(broker_url, queues), 10, "queues empty")
    second.signal(signal.SIGTERM)
    assert await second.wait_exit(20) == 0, second.describe()

    (note,) = received.by_task[task_id]
    assert note.status is TaskStatus.SUCCEEDED
    assert note.result == {"n": 7, "pid": first.pid}  # the stored result, not a rerun's
    assert await fleet.handler_runs(redis_client) == [task_id]


KILL_TASKS = 500
KILL_CONCURRENCY = 8
# Each kill lands as the notification handler receives the n-th notification: that task, and
# others in flight, are between "notification confirmed" and "task acked" or just before.
KILL_AT = (150, 300)


async def test_kill_9_around_the_notify_point_loses_no_notification_and_duplicates_are_absorbed(
    fleet: Fleet, broker_url: str, redis_client: aioredis.Redis, start_worker: Callable[..., Any]
) -> None:
    received = fleet.received
    killed = asyncio.Event()
    current: list[WorkerProcess] = []
    seen = [0]

    def kill_at_thresholds(note: TaskNotification) -> None:
        seen[0] += 1
        if seen[0] in KILL_AT:
            os.kill(current[-1].pid, signal.SIGKILL)  # at once, in the handler: no lag
            killed.set()

    received.on_note = kill_at_thresholds
    await start_worker(fleet.consumer, concurrency=16)
    ids = await fleet.publisher.publish_many(
        fleet.queue, [guard_app.Job(n=n) for n in range(KILL_TASKS)]
    )
    for _ in KILL_AT:
        current.append(
            fleet.spawn(concurrency=KILL_CONCURRENCY, sleep_min_s=0.002, sleep_max_s=0.01)
        )
        # Not wait_consuming(): on a loaded machine the kill can come before the log line
        # is read, and a worker killed by the test has not "exited before consuming".
        await current[-1].wait_for_log(CONSUMING_MARK, 20, "the worker to consume")
        await asyncio.wait_for(killed.wait(), 30)
        killed.clear()
        assert await current[-1].wait_exit(10) == -signal.SIGKILL, current[-1].describe()
    last = fleet.spawn(concurrency=KILL_CONCURRENCY)
    await last.wait_consuming()

    await wait_until(lambda: len(received.by_task) == KILL_TASKS, 60, "every notification")
    names = [n for n in queue_names(fleet.publisher)]
    await wait_until(lambda: all_empty(broker_url, names), 20, "every queue drained")
    last.signal(signal.SIGTERM)
    assert await last.wait_exit(20) == 0, last.describe()

    results = results_queue_name(fleet.queue)
    duplicates = outcome_count(fleet.consumer, results, "duplicate")
    handler_runs = Counter(await fleet.handler_runs(redis_client))
    reruns = sum(c - 1 for c in handler_runs.values())
    print(
        f"\nkill -9 x{len(KILL_AT)} around the notify point: {KILL_TASKS} tasks, "
        f"{KILL_TASKS} notifications handled once each; {duplicates:.0f} duplicate copies "
        f"absorbed by the guard, {reruns} task reruns"
    )
    assert set(received.by_task) == set(ids)
    # The guard ran the notification handler once per notification, whatever came twice.
    assert set(received.runs.values()) == {1}
    assert all(len(notes) == 1 for notes in received.by_task.values())
    assert all(n.status is TaskStatus.SUCCEEDED for ns in received.by_task.values() for n in ns)
    # A copy comes only from a task in flight at a kill: at most the prefetch per kill.
    assert duplicates <= KILL_CONCURRENCY * len(KILL_AT)
    assert set(handler_runs) == set(ids) and reruns <= KILL_CONCURRENCY * len(KILL_AT)

"""Drills: a broker that stops taking publishes, and a broker that stops answering at all.

1. Memory alarm (``connection.blocked``): the private node's memory watermark is set so low
   that the alarm goes off. RabbitMQ then stops reading from publishing connections, and a
   plain aio-pika publish waits forever; ``App.publish`` must raise ``ConfirmTimeoutError``
   within ``confirm_timeout_s``. Once the alarm clears, publishing works again, and the
   timed-out tasks, republished with the same task id, each run once.
2. Paused broker (SIGSTOP of the node's VM, then SIGCONT): the worker, a real process, must
   notice within the heartbeat bound and recover after the resume; every task published
   before the pause runs, once.
3. Memory alarm under a consuming worker (concurrency 1): its moves (a dead letter, a retry)
   wait on its publishing connection, which the alarm blocks, while tasks that need no
   publish are still stored and acked on its consuming connection; after the alarm clears
   every task ends where it should.

Alarms are always cleared and the VM always resumed in ``finally`` (and again by the ``node``
fixture).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable

import aio_pika
import pytest

from tests.conftest import delete_queues, outcome_count, wait_until
from tests.drills import bounds, drill_app
from tests.drills.conftest import DrillRun, RabbitNode, drill_settings
from tests.drills.drill_app import CONSUMING, LOST, Outcomes
from weclaw_mq import App, ConfirmTimeoutError, Context, Reject, Settings, TaskStatus, Worker
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.wire.connection import CLOSE_TIMEOUT_S, CONNECT_TIMEOUT_S
from weclaw_mq.wire.topology import queue_declarations

CONFIRM_TIMEOUT_S = bounds.ALARM_CONFIRM_TIMEOUT_S
BEFORE = 100
UNDER_ALARM = 10
AFTER = 100
# How long the plain aio-pika control publish is given before we call it stuck.
RAW_PATIENCE_S = 3 * CONFIRM_TIMEOUT_S


async def _raw_publish_completes(url: str, queue: str, patience_s: float) -> bool:
    """Whether a bare aio-pika confirmed publish finishes within ``patience_s``."""
    conn = await aio_pika.connect(url, timeout=10)
    try:
        channel = await conn.channel(publisher_confirms=True)
        message = aio_pika.Message(b'{"n": 0}', message_id=f"raw-{uuid.uuid4()}")
        try:
            await asyncio.wait_for(
                channel.default_exchange.publish(message, routing_key=queue), patience_s
            )
        except TimeoutError:
            return False
        return True
    finally:
        # Closing a blocked connection waits for the unblock too: do not wait for it.
        close = asyncio.ensure_future(conn.close())
        done, _ = await asyncio.wait({close}, timeout=2)
        if not done:
            close.cancel()


@pytest.mark.drill
async def test_publish_under_a_memory_alarm_raises_instead_of_hanging(
    node: RabbitNode, drill_redis_url: str, new_drill_run: Callable[[str, Settings], DrillRun]
) -> None:
    settings = drill_settings(node.url, drill_redis_url, confirm_timeout_s=CONFIRM_TIMEOUT_S)
    run = new_drill_run("alarm", settings)
    app, queue = run.app, run.queue
    before, under, after = run.task_ids(BEFORE), run.task_ids(UNDER_ALARM), run.task_ids(AFTER)
    blocked = Outcomes()
    raw_completed: bool | None = None
    try:
        await app.declare()
        await drill_app.publish_jobs(app, queue, before)
        try:
            await node.set_memory_alarm(True)
            # One alone, then the rest together.
            await blocked.publish(app, queue, 0, under[0], CONFIRM_TIMEOUT_S + 10)
            await asyncio.gather(
                *(blocked.publish(app, queue, 0, t, CONFIRM_TIMEOUT_S + 10) for t in under[1:])
            )
            raw_completed = await _raw_publish_completes(node.url, queue, RAW_PATIENCE_S)
        finally:
            await node.set_memory_alarm(False)
        cleared_at = time.monotonic()
        # Same task ids again: the caller's answer to "outcome unknown".
        retried = Outcomes()
        for task_id in under:
            await retried.publish(app, queue, 0, task_id, CONFIRM_TIMEOUT_S + 10)
        first_confirm_s = time.monotonic() - cleared_at
        await drill_app.publish_jobs(app, queue, after)
        # Messages the blocked publishes left in the client's buffer reach the queue now.
        confirmed = set(before) | set(after) | blocked.confirmed | retried.confirmed

        await run.start_worker(concurrency=20)
        exit_code, stuck = await run.finish(node, confirmed)

        row = run.report(
            "memory alarm (connection.blocked)",
            published=BEFORE + UNDER_ALARM + AFTER,
            confirmed=confirmed,
            notes=f"{len(blocked.failed)} of {UNDER_ALARM} publishes under the alarm raised "
            f"({blocked.error_kinds()}), slowest in {blocked.slowest_s:.1f} s "
            f"({bounds.alarm_bound_text()}); plain aio-pika publish "
            f"{'completed' if raw_completed else f'still waiting after {RAW_PATIENCE_S} s'}; "
            f"republished with the same ids: first confirm {first_confirm_s:.1f} s after the "
            "alarm cleared",
        )
        assert not blocked.hung and not blocked.foreign, blocked.summary()
        assert not blocked.confirmed, "a publish was confirmed by a node under a memory alarm"
        assert all(isinstance(e, ConfirmTimeoutError) for e in blocked.failed.values()), (
            blocked.summary()
        )
        assert blocked.slowest_s <= bounds.ALARM_PUBLISH_BOUND_S, blocked.summary()
        assert raw_completed is False, "the control (plain aio-pika) was expected to block"
        assert retried.confirmed == set(under), f"republish after the alarm: {retried.summary()}"
        run.assert_clean(row, exit_code, stuck)
    finally:
        await run.clean_up(node)


HEARTBEAT_S = bounds.HEARTBEAT_S
DETECT_BOUND_S = bounds.HEARTBEAT_DETECT_BOUND_S
PAUSE_TASKS = 400


@pytest.mark.drill
# 'make drill' only: test_connection_cut_drill.py's blackholed-connection drill keeps the same
# promise in 'make test' (a silent link noticed within the heartbeat bound, then recovered).
@pytest.mark.slow
async def test_worker_notices_a_paused_broker_within_the_heartbeat_bound_and_recovers(
    node: RabbitNode, drill_redis_url: str, new_drill_run: Callable[[str, Settings], DrillRun]
) -> None:
    run = new_drill_run("pause", drill_settings(node.url, drill_redis_url, heartbeat_s=HEARTBEAT_S))
    ids = run.task_ids(PAUSE_TASKS)
    try:
        await run.app.declare()
        await drill_app.publish_jobs(run.app, run.queue, ids)
        await run.app.close()  # the producer's part is done; only the worker meets the pause
        worker = await run.start_worker(concurrency=4, sleep_s=0.05)
        await run.wait_ran(PAUSE_TASKS // 5, 30)
        try:
            node.pause()
            paused_at = time.monotonic()
            ran_at_pause = len(run.ran())
            await worker.wait_for_log(
                LOST, DETECT_BOUND_S + 10, "the worker to notice the paused broker"
            )
            detect_s = time.monotonic() - paused_at
        finally:
            node.resume()
        resumed_at = time.monotonic()
        await wait_until(
            lambda: worker.log().count(CONSUMING) >= 2 or worker.popen.poll() is not None,
            CONNECT_TIMEOUT_S + 15,
            "the worker to consume again",
        )
        assert worker.popen.poll() is None, f"the worker died: {worker.describe()}"
        recover_s = time.monotonic() - resumed_at
        exit_code, stuck = await run.finish(node, ids)

        row = run.report(
            "paused broker (SIGSTOP/SIGCONT), heartbeat 2 s",
            published=PAUSE_TASKS,
            confirmed=set(ids),
            notes=f"paused after {ran_at_pause} ran; worker noticed in {detect_s:.1f} s "
            f"({bounds.heartbeat_bound_text()}), consumed again {recover_s:.1f} s after SIGCONT",
        )
        assert detect_s <= DETECT_BOUND_S, f"noticed after {detect_s:.1f} s"
        run.assert_clean(row, exit_code, stuck)
    finally:
        node.resume()
        await run.clean_up(node)


@pytest.mark.drill
async def test_app_close_under_a_memory_alarm_returns_within_its_bound(
    node: RabbitNode, drill_redis_url: str, new_drill_run: Callable[[str, Settings], DrillRun]
) -> None:
    """A blocked broker reads nothing, close-ok included: closing must not wait for the
    alarm to clear (``weclaw-mq publish`` under an alarm would hang in its exit)."""
    settings = drill_settings(node.url, drill_redis_url, confirm_timeout_s=CONFIRM_TIMEOUT_S)
    run = new_drill_run("alarm-close", settings)
    app, queue = run.app, run.queue
    await app.declare()
    try:
        await node.set_memory_alarm(True)
        with pytest.raises(ConfirmTimeoutError):
            await app.publish(queue, drill_app.Job(n=0), task_id=run.task_ids(1)[0])
        started = time.monotonic()
        await app.close()
        closed_in_s = time.monotonic() - started
    finally:
        await node.set_memory_alarm(False)
    # One bounded close of the connection (its channel goes with it); 12 s before the bound.
    assert closed_in_s < CLOSE_TIMEOUT_S + 1, f"App.close() took {closed_in_s:.1f} s"


ANSWERS = 20  # tasks that need no publish: stored, then acked
REJECTED = 2  # tasks that end in the DLQ (a publish)
FAIL_ONCE = 2  # tasks that fail once (a publish to a delay queue), then succeed


async def _connection_states(node: RabbitNode) -> dict[str, str]:
    out = await node.ctl("list_connections", "client_properties", "state", "--formatter", "json")
    states: dict[str, str] = {}
    for row in json.loads(out):
        props = row["client_properties"]
        # rabbitmqctl's json renders the table as [name, type, value] triples.
        name = next((p[2] for p in props if p[0] == "connection_name"), None)
        if name is not None:
            states[str(name)] = str(row["state"])
    return states


@pytest.mark.drill
async def test_a_workers_acks_go_through_while_its_publishes_wait_under_a_memory_alarm(
    node: RabbitNode, drill_redis_url: str, forget_tasks: Callable[[str, list[str]], None]
) -> None:
    """RabbitMQ blocks a connection that publishes under an alarm, and reads nothing more
    from it: acks included. The worker publishes (retries, dead letters, notifications) on a
    connection of its own, so its acks still go through while its publishes wait."""
    run_id = uuid.uuid4().hex[:8]
    moves, answers = f"drill-alarm-moves-{run_id}", f"drill-alarm-answers-{run_id}"
    settings = drill_settings(
        node.url, drill_redis_url, confirm_timeout_s=CONFIRM_TIMEOUT_S, max_retries=3
    )
    app = App(f"drill-alarm-{run_id}", settings=settings)
    answer_ids = [f"a-{uuid.uuid4()}" for _ in range(ANSWERS)]
    rejected_ids = [f"r-{uuid.uuid4()}" for _ in range(REJECTED)]
    fail_once_ids = [f"f-{uuid.uuid4()}" for _ in range(FAIL_ONCE)]
    forget_tasks(answers, answer_ids)
    forget_tasks(moves, rejected_ids + fail_once_ids)
    failed_once: set[str] = set()
    # The answers wait until a publish of the worker has waited out its confirm timeout: by
    # then the alarm blocks whatever connection the worker publishes on.
    publishes_blocked = asyncio.Event()

    @app.handler(answers)
    async def answer(job: drill_app.Job) -> int:
        await publishes_blocked.wait()
        return job.n

    @app.handler(moves)
    async def move(job: drill_app.Job, ctx: Context) -> int:
        if ctx.task_id in rejected_ids:
            raise Reject("dead-lettered on purpose")
        if ctx.task_id not in failed_once:
            failed_once.add(ctx.task_id)
            raise RuntimeError("fails once on purpose")
        return job.n

    worker = Worker(app, concurrency=1)
    running: asyncio.Task[None] | None = None
    names = [
        n for q in (moves, answers) for n, _ in queue_declarations(app.handlers[q].queue_spec())
    ]
    try:
        await app.declare()
        for task_id in rejected_ids + fail_once_ids:
            await app.publish(moves, drill_app.Job(n=0), task_id=task_id)
        for n, task_id in enumerate(answer_ids):
            await app.publish(answers, drill_app.Job(n=n), task_id=task_id)
        await app.close()  # the producer's part is done: only the worker meets the alarm
        try:
            await node.set_memory_alarm(True)
            running = asyncio.create_task(worker.run())
            await asyncio.wait_for(worker.ready.wait(), 30)

            def timed_out() -> float:
                return sum(
                    s.value
                    for metric in app.metrics.registry.collect()
                    if metric.name == "weclaw_mq_published"
                    for s in metric.samples
                    if s.name.endswith("_total") and s.labels.get("outcome") == "timeout"
                )

            async def answers_acked() -> bool:
                counts = (await node.queue_counts([answers]))[answers]
                return counts.ready + counts.unacked == 0

            await wait_until(lambda: timed_out() >= 1, 20, "a publish to wait out its timeout")
            publishes_blocked.set()
            # While the worker's publishes wait (and time out) under the alarm, every task
            # that needs no publish is stored and acked.
            await wait_until(answers_acked, 40, "the answers to be acked under the alarm")
            states = await _connection_states(node)
            # Acked on the session they were delivered in: not given up on (an ack that waits
            # SETTLE_TIMEOUT_S ends the session) and redelivered to a new one as duplicates.
            acked = outcome_count(app, answers, "acked")
            reconnects = app.metrics.registry.get_sample_value(
                "weclaw_mq_reconnects_total", {"role": "worker"}
            )
            assert "Memory alarm" in await node.diag("alarms"), "the alarm cleared too early"
        finally:
            await node.set_memory_alarm(False)
        publishing = [s for name, s in states.items() if name.endswith("-publish")]
        consuming = [
            s for name, s in states.items() if "-worker-" in name and not name.endswith("-publish")
        ]
        assert (acked, reconnects or 0) == (ANSWERS, 0), _seen(states)
        assert publishing == ["blocked"], states
        assert consuming and "blocked" not in consuming, states

        async def all_done() -> bool:
            counts = await node.queue_counts([n for n in names if not n.endswith(".dlq")])
            if any(c.ready + c.unacked for c in counts.values()):
                return False
            dlq = (await node.queue_counts([dlq_name(moves)]))[dlq_name(moves)]
            return dlq.ready >= REJECTED

        await wait_until(all_done, 60, "every task to end after the alarm cleared")
        store = app.results
        assert store is not None
        for queue, ids in ((answers, answer_ids), (moves, fail_once_ids)):
            for task_id in ids:
                state = await store.get(task_id, queue=queue)
                assert state is not None and state.status is TaskStatus.SUCCEEDED, (task_id, state)
        dead = await _dead_letter_ids(node.url, dlq_name(moves))
        assert set(rejected_ids) <= dead, dead
    finally:
        worker.stop()
        if running is not None:
            await asyncio.wait_for(running, 60)
        await app.close()
        await delete_queues(node.url, names)


def _seen(states: dict[str, str]) -> str:
    return f"answers acked, worker reconnects; connections: {states}"


async def _dead_letter_ids(url: str, dlq: str) -> set[str]:
    conn = await aio_pika.connect(url, timeout=10)
    try:
        channel = await conn.channel()
        queue = await channel.get_queue(dlq, ensure=False)
        ids: set[str] = set()
        while (message := await queue.get(no_ack=False, fail=False)) is not None:
            ids.add(message.message_id or "")
        return ids  # unacked: they go back when the channel closes
    finally:
        await conn.close()

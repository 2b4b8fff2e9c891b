"""The promises of docs/design/guarantees.md about a task's state and its settlement, each
one tested here.

Real RabbitMQ and Redis, the App-level API (``publish``, ``status``, ``result``) and real
workers; what the broker holds is read from the broker (``rabbitmqctl list_queues``), never
from our own metrics.

- "queued" never overwrites a later state (a publish's "queued" write that lands after the
  worker's "running" or "succeeded" record leaves that record alone);
- ``running`` and ``retrying`` are recorded while they are true;
- ``succeeded`` is final: a later write of another status is refused;
- ``result()`` is woken by the notification, well before its poll interval;
- the carried return count ends a crash loop that hops through the delay queue, with reason
  ``delivery_limit``;
- a connection cut between "publish to the delay queue" and "ack" loses nothing, and the
  task ends exactly once;
- no ack before the result is stored (the broker's unacked count says so).
"""

from __future__ import annotations

import asyncio
import importlib
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any

import aiormq
import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.broker_ctl import abroker_ctl
from tests.conftest import SHORT_TTLS, close_connections, consuming_connection, wait_until
from tests.integration.processes import (
    OpenFleet,
    QueueCounts,
    WorkerFleet,
    WorkerProcess,
    broker_queue_counts,
    end_state_problems,
    fresh_ready_counts,
    queue_names,
    take_one,
)
from tests.private_servers import PrivateRedis
from weclaw_mq import App, Context, Reject, RetryPolicy, TaskState, TaskStatus
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name, done_channel


class Job(BaseModel):
    n: int = 0


async def _status(app: App, task_id: str) -> TaskState:
    state = await app.status(task_id)
    assert state is not None, f"no record of {task_id}"
    return state


async def _has_status(app: App, task_id: str, status: TaskStatus, attempt: int = 0) -> bool:
    state = await app.status(task_id)
    return state is not None and state.status is status and state.attempt >= attempt


async def _assert_broker_end_state(
    app: App, broker_url: str, expected_ready: dict[str, int] | None = None, within_s: float = 20
) -> None:
    """Until the broker reports every queue of ``app`` with nothing unacked and nothing ready
    but ``expected_ready``; read with rabbitmqctl, not from our metrics, and the ready counts
    afresh with a passive declare (rabbitmqctl's counts are statistics up to 5 s old)."""
    names = queue_names(app)
    wanted = {n: (expected_ready or {}).get(n, 0) for n in names}
    await wait_until(
        lambda: fresh_ready_counts_are(broker_url, wanted), within_s, f"ready counts {wanted}"
    )
    problems: list[str] = []

    async def as_expected() -> bool:
        nonlocal problems
        problems = end_state_problems(await broker_queue_counts(names), names, expected_ready or {})
        return not problems

    try:
        await wait_until(as_expected, within_s, "the broker's end state")
    except AssertionError:
        raise AssertionError(f"end state on the broker: {'; '.join(problems)}") from None


async def fresh_ready_counts_are(broker_url: str, wanted: dict[str, int]) -> bool:
    return await fresh_ready_counts(broker_url, list(wanted)) == wanted


# -- "queued" never overwrites a later state ---------------------------------------------------


async def test_a_queued_write_after_running_or_succeeded_leaves_the_later_state(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, broker_url: str
) -> None:
    """The order forced: the same task id published again while its first copy runs, and
    again after it succeeded. Each second publish writes "queued" after the worker's record
    (publish waits for its queued write); the record must stay what the worker wrote."""
    app = make_app(qname, **SHORT_TTLS)
    release = asyncio.Event()
    runs: list[int] = []

    @app.handler(qname)
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        runs.append(task.n)
        await release.wait()
        return {"n": task.n}

    await start_worker(app, concurrency=2)
    task_id = await app.publish(qname, Job(n=1))
    try:
        await wait_until(lambda: _has_status(app, task_id, TaskStatus.RUNNING), 10, "running")
        # Another body under the id on purpose (the copy must not run): let the first win.
        await app.publish(qname, Job(n=2), task_id=task_id, refuse_other_body=False)
        assert (await _status(app, task_id)).status is TaskStatus.RUNNING, "queued hid running"
    finally:
        release.set()  # a failed check must not leave the handler waiting at the teardown
    done = await app.result(task_id, timeout_s=15)
    assert done.status is TaskStatus.SUCCEEDED and done.result == {"n": 1}

    await app.publish(qname, Job(n=3), task_id=task_id, refuse_other_body=False)
    after = await _status(app, task_id)
    assert after.status is TaskStatus.SUCCEEDED, "queued hid succeeded"
    assert after.result == {"n": 1}
    # Both extra copies were absorbed by the guard (acked unrun), as the broker confirms.
    await _assert_broker_end_state(app, broker_url)
    assert runs == [1], f"the handler ran for {runs}"


# -- running and retrying are recorded --------------------------------------------------------

RETRY_DELAY_S = 1.0


async def test_running_and_retrying_are_recorded_while_true(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, broker_url: str
) -> None:
    app = make_app(qname, **SHORT_TTLS)
    first_may_fail, second_may_finish = asyncio.Event(), asyncio.Event()

    @app.handler(qname, retry=RetryPolicy(max_retries=1, delay_s=RETRY_DELAY_S))
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        if ctx.attempt == 1:
            await first_may_fail.wait()
            raise RuntimeError("the first attempt fails")
        await second_may_finish.wait()
        return {"attempt": ctx.attempt}

    await start_worker(app)
    task_id = await app.publish(qname, Job())
    try:
        await wait_until(lambda: _has_status(app, task_id, TaskStatus.RUNNING), 10, "running")
        assert (await _status(app, task_id)).attempt == 1

        first_may_fail.set()
        # Written before the copy goes to the delay queue, so it is there for the whole delay.
        await wait_until(lambda: _has_status(app, task_id, TaskStatus.RETRYING), 10, "retrying")
        retrying = await _status(app, task_id)
        assert retrying.attempt == 1
        assert retrying.error is not None and "the first attempt fails" in retrying.error

        await wait_until(
            lambda: _has_status(app, task_id, TaskStatus.RUNNING, attempt=2),
            RETRY_DELAY_S + 10,
            "the second attempt to run",
        )
    finally:
        # A failed check must not leave a handler waiting at the teardown.
        first_may_fail.set()
        second_may_finish.set()
    done = await app.result(task_id, timeout_s=15)
    assert done.status is TaskStatus.SUCCEEDED and done.result == {"attempt": 2}
    await _assert_broker_end_state(app, broker_url)


# -- succeeded is final -----------------------------------------------------------------------


async def test_a_succeeded_record_refuses_a_later_status(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, broker_url: str
) -> None:
    """The handler is not guarded (``idempotent=False``), so the same task id published again
    after its success really runs again and fails: the worker then writes "running" and
    "dead_lettered" for it, and both must be refused by the succeeded record."""
    app = make_app(qname, **SHORT_TTLS)
    calls: list[int] = []

    @app.handler(qname, idempotent=False, retry=RetryPolicy(max_retries=0, delay_s=0.1))
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        calls.append(task.n)
        if task.n == 2:
            raise Reject("the second run fails for good")
        return {"n": task.n}

    await start_worker(app)
    task_id = await app.publish(qname, Job(n=1))
    assert (await app.result(task_id, timeout_s=15)).result == {"n": 1}

    await app.publish(qname, Job(n=2), task_id=task_id)
    # The second run ended in the DLQ (its message is there): its writes were made by then.
    await _assert_broker_end_state(app, broker_url, {dlq_name(qname): 1})
    assert calls == [1, 2]
    final = await _status(app, task_id)
    assert final.status is TaskStatus.SUCCEEDED, f"succeeded was overwritten: {final}"
    assert final.result == {"n": 1}


# -- result() is woken by the notification ----------------------------------------------------


def _poll_interval_s() -> float:
    """How often a waiting result() re-reads the record without a notification."""
    for module in ("weclaw_mq.state.redis",):
        try:
            value = getattr(importlib.import_module(module), "_RECHECK_S", None)
        except ImportError:
            continue
        if value is not None:
            return float(value)
    raise AssertionError("where did result()'s poll interval (_RECHECK_S) go? update this test")


async def test_result_is_woken_by_the_notification_well_before_its_poll_interval(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, redis_url: str
) -> None:
    poll_s = _poll_interval_s()
    assert poll_s >= 1.0, "with so short a poll a wake-up cannot be told from a poll"
    app = make_app(qname, **SHORT_TTLS)
    release = asyncio.Event()
    stored_at: dict[str, float] = {}

    @app.handler(qname)
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        await release.wait()
        stored_at[ctx.task_id] = time.monotonic()  # the worker stores the result right after
        return {"n": task.n}

    await start_worker(app)
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
    latencies = []
    try:
        for n in range(3):
            release.clear()
            task_id = await app.publish(qname, Job(n=n))
            running = partial(_has_status, app, task_id, TaskStatus.RUNNING)
            await wait_until(running, 10, "the task to run")
            waiter = asyncio.create_task(app.result(task_id, timeout_s=30))

            async def subscribed(t: str = task_id) -> bool:
                return bool((await client.pubsub_numsub(done_channel(t)))[0][1])

            # The waiter has subscribed and read the record once: its next poll is poll_s away.
            await wait_until(subscribed, 10, "result() to subscribe")
            release.set()
            state = await waiter
            latencies.append(time.monotonic() - stored_at[task_id])
            assert state.status is TaskStatus.SUCCEEDED
    finally:
        release.set()  # a failed check must not leave the handler waiting at the teardown
        await client.aclose()
    print(f"result() returned {', '.join(f'{s * 1000:.1f}' for s in latencies)} ms after the store")
    assert max(latencies) < poll_s / 4, (
        f"result() returned {[f'{s:.3f}' for s in latencies]} s after the store: a poll "
        f"(every {poll_s} s), not the notification"
    )


# -- the carried return count ends a crash loop across delay-queue hops -----------------------

CRASH = "crash-the-worker"
CRASH_LIMIT = 1
# Longer than a worker's restart, with room: the copy the broker returns after a kill meets
# the dead worker's claim, and hops through the delay queue until it lapses. At 3 s a loaded
# restart (3.4 s) let the claim lapse first, and the broker's own limit ended the loop.
CRASH_LEASE_S = 10.0


@pytest.fixture
async def crash_fleet(open_fleet: OpenFleet) -> AsyncIterator[WorkerFleet]:
    async with open_fleet(
        delivery_limit=CRASH_LIMIT,
        retry_delay_s=0.2,
        guard_lease_s=CRASH_LEASE_S,
        **SHORT_TTLS,
    ) as fleet:
        yield fleet


# Slow (two rounds of a lease each): its scenario needs each worker restart to take less than
# CRASH_LEASE_S, else the broker's delivery limit dead-letters the task and the loop it tests
# never happens. CI's 'make test-slow' runs it.
@pytest.mark.slow
@pytest.mark.timeout(360)
async def test_the_carried_return_count_ends_a_crash_loop_that_hops_through_the_delay_queue(
    crash_fleet: WorkerFleet, broker_url: str
) -> None:
    """One worker, started again after each death. Each time the task comes back, the dead
    worker's claim still holds: the copy is deferred to the delay queue, which starts a new
    stint in Q where the broker's own delivery count begins at 0, so the broker's limit never
    fires. Only the return count the worker carries across hops can end the loop."""
    fleet = crash_fleet
    workers: list[WorkerProcess] = [fleet.start(crash_on=CRASH)]
    await workers[0].wait_consuming()
    task_id = await fleet.app.publish(fleet.queue, {"text": CRASH})

    async def ended() -> bool:
        state = await fleet.app.status(task_id)
        if state is not None and state.status is TaskStatus.DEAD_LETTERED:
            return True
        if workers[-1].popen.poll() is not None:
            assert workers[-1].popen.returncode == -signal.SIGKILL, workers[-1].describe()
            assert len(workers) <= CRASH_LIMIT + 2, f"{len(workers)} workers died: no end"
            workers.append(fleet.start(crash_on=CRASH))
        return False

    # Each round starts a worker process and waits out a lease: about 30 s alone.
    try:
        await wait_until(ended, 300, "the crash loop to end")
    except AssertionError as e:
        logs = "\n".join(w.describe() for w in workers)
        state = await fleet.app.status(task_id)
        counts = await abroker_ctl(
            "list_queues", "name", "messages_ready", "messages_unacknowledged", "consumers"
        )
        held = [ln for ln in counts.splitlines() if fleet.queue in ln or "weclaw_mq." in ln]
        raise AssertionError(
            f"{e}; {len(workers)} worker(s) started; {state}; broker: {held}\n{logs}"
        ) from e
    state = await _status(fleet.app, task_id)
    assert state.reason == "delivery_limit", state
    await _assert_broker_end_state(fleet.app, broker_url, {dlq_name(fleet.queue): 1})
    dead = await take_one(broker_url, dlq_name(fleet.queue))
    assert dead is not None and dead.message_id == task_id
    headers = dead.headers or {}
    x_death: list[dict[str, Any]] = list(headers.get(h.X_DEATH) or [])  # type: ignore[arg-type]
    deaths = {(_text(d.get("queue")), _text(d.get("reason"))) for d in x_death}
    # It hopped: the broker dead-lettered it out of a delay queue when its delay expired.
    assert any(q != fleet.queue and r == "expired" for q, r in deaths), headers
    # Ended by the worker on the return that passed the limit (our header), not the broker.
    assert headers.get(h.DEAD_LETTER_REASON) == "delivery_limit", headers
    assert all(r != "delivery_limit" for _, r in deaths), f"the broker ended it: {headers}"
    assert int(str(headers.get(h.RETURNS))) > CRASH_LIMIT, headers
    started = fleet.events("started")
    assert len(started) == CRASH_LIMIT + 1, f"ran {len(started)} times"
    assert fleet.events("finished") == []


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- a connection cut between "publish to the delay queue" and "ack" ---------------------------


def _channel_closed(message: Any) -> bool:
    try:
        return bool(message.channel.is_closed)
    except aiormq.exceptions.ChannelInvalidStateError:  # aio-pika's word for "closed"
        return True


@pytest.fixture
def cut_before_move_ack(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A hook on the worker's settlement: the first ack of the task named in ``cut["task"]``
    (the ack of its move to the delay queue, whose publish the broker has confirmed by then)
    is preceded by the broker closing the worker's consuming connection (``cut["name"]``)."""
    # The one place this test reaches into the library: where a delivery is acked (every
    # ack, the move's included, is one Settler._settle with requeue=None).
    from weclaw_mq.worker.settle import Settler

    cut: dict[str, Any] = {"task": None, "name": None, "closed": 0, "ack_went_through": None}
    settle = Settler._settle

    async def ack_after_a_cut(
        self: Settler, message: Any, *, requeue: bool | None, keep_slot: bool = False
    ) -> bool:
        first_ack = requeue is None and message.message_id == cut["task"] and not cut["closed"]
        if cut["task"] is not None and first_ack:
            cut["closed"] = await asyncio.to_thread(close_connections, cut["name"])
            # rabbitmqctl returns once the broker was told to close, not once the worker saw
            # the close: an ack sent in between could still go through (seen on a loaded
            # machine). The channel reports closed once the close reached the client.
            await wait_until(lambda: _channel_closed(message), 10, "the worker saw the cut")
            cut["ack_went_through"] = await settle(
                self, message, requeue=requeue, keep_slot=keep_slot
            )
            return bool(cut["ack_went_through"])
        return await settle(self, message, requeue=requeue, keep_slot=keep_slot)

    monkeypatch.setattr(Settler, "_settle", ack_after_a_cut)
    yield cut


async def test_a_connection_cut_between_the_move_to_the_delay_queue_and_the_ack_loses_nothing(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    broker_url: str,
    cut_before_move_ack: dict[str, Any],
) -> None:
    app = make_app(qname, reconnect_max_delay_s=0.5, **SHORT_TTLS)
    calls: list[int] = []
    successes: list[str] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=3, delay_s=0.3))
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        calls.append(ctx.attempt)
        if len(calls) == 1:
            raise RuntimeError("the first call fails: the task moves to the delay queue")
        successes.append(ctx.task_id)
        return {"attempt": ctx.attempt}

    await start_worker(app)
    task_id = app.prepare(qname, Job()).message_id
    assert task_id is not None
    cut_before_move_ack.update(task=task_id, name=consuming_connection(qname))
    await app.publish(qname, Job(), task_id=task_id)

    done = await app.result(task_id, timeout_s=30)
    assert cut_before_move_ack["closed"] == 1, "the worker's connection was not cut"
    assert cut_before_move_ack["ack_went_through"] is False, "the ack beat the cut"
    assert done.status is TaskStatus.SUCCEEDED
    # Both copies came back (the source, unacked, and the delay queue's): one ran, the other
    # was absorbed. Nothing is left, and nothing is unacked, says the broker.
    await _assert_broker_end_state(app, broker_url)
    assert successes == [task_id], f"the task succeeded {len(successes)} times"
    assert len(calls) >= 2


# -- "no ack" before the result is stored, read from the broker ------------------------------


@pytest.mark.on_private_redis
class TestNoAckBeforeTheResultIsStored:
    """Redis goes away between the handler's return and the result's store: the worker must
    hold the delivery unacked until the result is stored. Whether it acked is read from the
    broker's unacked count, not from the worker's metrics. This Redis is the test's own."""

    async def test_the_broker_holds_the_task_unacked_until_its_result_is_stored(
        self,
        make_app: Callable[..., App],
        start_worker: Callable[..., Any],
        qname: str,
        broker_url: str,
        private_redis: PrivateRedis,
    ) -> None:
        app = make_app(qname, result_store_patience_s=60, **SHORT_TTLS)
        finish = asyncio.Event()
        returned: list[str] = []

        @app.handler(qname, priorities=True)  # the lanes' look-ahead, counted below
        async def work(task: Job, ctx: Context) -> dict[str, int]:
            await finish.wait()
            returned.append(ctx.task_id)
            return {"n": task.n}

        # Concurrency 1: while the worker runs the task it holds one more message of Q (the
        # NORMAL lane's look-ahead, see "Priorities"); the second marker below waits ready.
        await start_worker(app, concurrency=1)
        task_id = await app.publish(qname, Job(n=5))
        try:
            await wait_until(lambda: _has_status(app, task_id, TaskStatus.RUNNING), 10, "running")
            await asyncio.to_thread(private_redis.stop)
        finally:
            finish.set()
        await wait_until(lambda: returned == [task_id], 10, "the handler to return")
        # rabbitmqctl's counts are statistics refreshed every few seconds: a reading that
        # shows the marker (published after the handler returned) was taken after that.
        await app.publish(qname, Job(n=6))  # taken as the look-ahead, not started
        marker = await app.publish(qname, Job(n=7))
        seen: list[QueueCounts] = []

        async def fresh_reading() -> bool:
            seen.append((await broker_queue_counts([qname]))[qname])
            return seen[-1].ready == 1

        await wait_until(
            fresh_reading,
            30,
            "a reading that shows the marker ready (when it never comes, the worker took "
            "the marker: it had let go of the task, i.e. acked it)",
        )
        assert seen[-1].unacked == 2, (
            f"the broker reports {seen[-1]} after the handler returned, while its result "
            "could not be stored: the task was acked without its result"
        )
        assert returned == [task_id], "the worker took the marker: it let go of the task"

        await asyncio.to_thread(private_redis.start)
        done = await app.result(task_id, timeout_s=60)
        assert done.status is TaskStatus.SUCCEEDED and done.result == {"n": 5}
        assert (await app.result(marker, timeout_s=30)).status is TaskStatus.SUCCEEDED
        await _assert_broker_end_state(app, broker_url)

"""Chains and groups (``weclaw_mq.workflows``), one set of scenarios run on both backends.

The ``backend`` fixture runs each scenario once on the test kit (``TestBroker``: memory) and
once on the shared RabbitMQ and Redis with a real ``Worker``: the assertions are the same
lines for both, so the test kit keeps the real semantics. Every policy is here: a chain's
success, its failing middle stage, its cancel and its deadline; a group's join in order,
"fail" and "pass" for a failed part, no callback, a cancel, a part counted once however often
it is delivered, and a part an operator removed, which ends the group at its deadline with
that part named.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import outcome_count, settings_for, wait_until
from tests.integration.processes import one_error_line, run_cli, settings_env
from tests.integration.scenario_backends import WAIT_S, MemoryBackend, RealBackend
from weclaw_mq import App, Reject, Retry, RetryPolicy, TaskState, TaskStatus, Worker
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import (
    CHAIN_RECORD_QUEUE,
    GROUP_RECORD_QUEUE,
    WORKFLOW_DEADLINES_KEY,
    inbox_key,
    inbox_trace_key,
    latest_key,
    state_key,
    workflow_key,
    workflow_parts_key,
)
from weclaw_mq.testing import DeadLetter
from weclaw_mq.workflows import PartResult, hops
from weclaw_mq.workflows.deadlines import sweep

FAST_RETRY = RetryPolicy(max_retries=1, delay_s=0.05)


class Backend:
    """Where a scenario runs. ``open`` readies the queues (nothing consumes yet), ``run``
    lets the handlers work, ``final`` waits for a workflow's (or task's) final record."""

    name: str
    ids: list[str]  # workflow ids, and below session ids, whose Redis keys the test leaves
    sessions: list[str]

    def app(self, **settings: Any) -> App:
        raise NotImplementedError

    async def open(self, app: App) -> None:
        raise NotImplementedError

    async def run(self, app: App) -> None:
        raise NotImplementedError

    async def final(self, app: App, task_id: str, queue: str | None = None) -> TaskState:
        raise NotImplementedError

    async def remove(self, queue: str, task_id: str) -> None:
        """Take the task's message off its queue, as an operator's purge would."""
        raise NotImplementedError

    async def past_deadline(self, app: App, deadline_s: float) -> None:
        """Let the deadline pass (and the sweep run)."""
        raise NotImplementedError

    async def redeliver(self, app: App, queue: str, task_id: str, tag: str, body: bytes) -> None:
        """A copy of a task, as a broker redelivers one (same id, same tag)."""
        raise NotImplementedError

    async def dead_letters(self, app: App, queue: str) -> list[DeadLetter]:
        raise NotImplementedError


class Memory(MemoryBackend, Backend):
    app_name = "wf"

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        super().__init__(stack)
        self.ids = []
        self.sessions = []

    async def open(self, app: App) -> None:
        await self.open_broker(app)

    async def run(self, app: App) -> None:
        await self._broker().run_until_idle()

    async def remove(self, queue: str, task_id: str) -> None:
        assert self._broker().purge(queue, task_id=task_id) == 1

    async def past_deadline(self, app: App, deadline_s: float) -> None:
        self._broker().advance(deadline_s + 1)
        await self._broker().run_until_idle()

    async def redeliver(self, app: App, queue: str, task_id: str, tag: str, body: bytes) -> None:
        await self._broker().publish_raw(queue, body, task_id=task_id, headers={h.WORKFLOW: tag})
        await self._broker().run_until_idle()


class Real(RealBackend, Backend):
    def __init__(
        self, make_app: Callable[..., App], start_worker: Callable[..., Any], broker_url: str
    ) -> None:
        super().__init__(make_app, start_worker, broker_url)
        self.ids = []
        self.sessions = []

    def app(self, **settings: Any) -> App:
        return self.make_app("wf", workflow_sweep_s=0.1, **settings)

    async def open(self, app: App) -> None:
        await app.declare()

    async def run(self, app: App) -> None:
        await self.start_worker(app)

    async def remove(self, queue: str, task_id: str) -> None:
        conn = await aio_pika.connect(self.broker_url)
        try:
            channel = await conn.channel()
            q = await channel.get_queue(queue, ensure=False)
            kept: list[aio_pika.abc.AbstractIncomingMessage] = []
            found = False
            while (message := await q.get(fail=False, no_ack=False)) is not None:
                if message.message_id == task_id:
                    await message.ack()
                    found = True
                    break
                kept.append(message)
            for message in kept:
                await message.nack(requeue=True)
            assert found, f"no message {task_id} in {queue}"
        finally:
            await conn.close()

    async def past_deadline(self, app: App, deadline_s: float) -> None:
        await asyncio.sleep(0)  # the worker's sweep ends it: ``final`` waits for that

    async def redeliver(self, app: App, queue: str, task_id: str, tag: str, body: bytes) -> None:
        await self.publish_body(queue, body, task_id, headers={h.WORKFLOW: tag})

        async def acked() -> bool:
            counts = app.metrics.messages.labels(queue, "duplicate").value
            return counts >= 1

        await wait_until(acked, WAIT_S, "the copy acked as a duplicate")


@pytest.fixture
async def memory_backend() -> AsyncIterator[Backend]:
    async with contextlib.AsyncExitStack() as stack:
        yield Memory(stack)


@pytest.fixture
async def rabbitmq_backend(
    make_app: Callable[..., App], start_worker: Callable[..., Any], broker_url: str, redis_url: str
) -> AsyncIterator[Backend]:
    backend = Real(make_app, start_worker, broker_url)
    yield backend
    await forget_workflows(redis_url, backend.ids, backend.sessions)


@pytest.fixture(params=["memory", "rabbitmq"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each scenario on both; only the rabbitmq run needs (and checks for) the services."""
    found: Backend = request.getfixturevalue(f"{request.param}_backend")
    return found


async def forget_workflows(redis_url: str, ids: list[str], sessions: list[str]) -> None:
    """Delete what the workflows of a test left in Redis (their tasks' keys go with their
    queues: ``make_app``), and its sessions' inboxes."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        for session in sessions:
            await client.delete(inbox_key(session), inbox_trace_key(session))
        for wid in ids:
            keys = [workflow_key(wid), workflow_parts_key(wid), latest_key(wid)]
            keys += [state_key(q, wid) for q in (CHAIN_RECORD_QUEUE, GROUP_RECORD_QUEUE)]
            await client.delete(*keys)
            await client.zrem(WORKFLOW_DEADLINES_KEY, wid)
    finally:
        await client.aclose()


# -- chains ---------------------------------------------------------------------------------


async def test_a_chain_passes_each_result_on_and_ends_with_the_last_one(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    seen: list[tuple[str, Any, str, str | None]] = []

    @app.handler(f"{qname}-a")
    async def understand(text: str, ctx: Any) -> dict[str, str]:
        seen.append(("a", text, ctx.trace_id, ctx.session_id))
        return {"intent": text.upper()}

    @app.handler(f"{qname}-b")
    async def lookup(found: dict[str, str], ctx: Any) -> list[str]:
        seen.append(("b", found, ctx.trace_id, ctx.session_id))
        return [found["intent"], "graph"]

    @app.handler(f"{qname}-c")
    async def generate(facts: list[str], ctx: Any) -> str:
        seen.append(("c", facts, ctx.trace_id, ctx.session_id))
        return " + ".join(facts)

    await backend.open(app)
    await backend.run(app)
    session = f"user-{qname}"
    backend.sessions.append(session)
    chain_id = await app.chain(
        [f"{qname}-a", f"{qname}-b", f"{qname}-c"],
        "hello",
        trace_id="trace-wf-1",
        session_id=session,
    )
    backend.ids.append(chain_id)
    state = await backend.final(app, chain_id)

    assert (state.status, state.result, state.queue) == (
        TaskStatus.SUCCEEDED,
        "HELLO + graph",
        CHAIN_RECORD_QUEUE,
    )
    assert seen == [
        ("a", "hello", "trace-wf-1", session),
        ("b", {"intent": "HELLO"}, "trace-wf-1", session),
        ("c", ["HELLO", "graph"], "trace-wf-1", session),
    ]
    # The session's inbox holds every stage's final reply, in the chain's order.
    inbox = app.inbox(session)
    finals = [(e.task_id, e.result) for e in await inbox.pending() if e.kind == "final"]
    assert finals == [
        (f"{chain_id}.0", {"intent": "HELLO"}),
        (f"{chain_id}.1", ["HELLO", "graph"]),
        (f"{chain_id}.2", "HELLO + graph"),
    ]
    await inbox.confirm((await inbox.pending())[-1].id)
    stage = await app.status(f"{chain_id}.1", queue=f"{qname}-b")
    assert stage is not None and stage.status is TaskStatus.SUCCEEDED
    async with asyncio.timeout(WAIT_S):
        events = [e async for e in app.stream(chain_id)]
    assert [(e.kind, e.status, e.result) for e in events] == [
        ("final", TaskStatus.SUCCEEDED, "HELLO + graph")
    ]


async def test_a_failing_middle_stage_ends_the_chain_naming_the_stage(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    ran: list[str] = []

    @app.handler(f"{qname}-a")
    async def first(n: int) -> int:
        ran.append("a")
        return n + 1

    @app.handler(f"{qname}-b", retry=FAST_RETRY)
    async def second(n: int) -> int:
        ran.append("b")
        raise ConnectionError("the knowledge graph is down")

    @app.handler(f"{qname}-c")
    async def third(n: int) -> int:
        ran.append("c")
        return n

    await backend.open(app)
    await backend.run(app)
    chain_id = await app.chain([f"{qname}-a", f"{qname}-b", f"{qname}-c"], 1)
    backend.ids.append(chain_id)
    state = await backend.final(app, chain_id)

    assert state.status is TaskStatus.DEAD_LETTERED
    assert state.reason == (
        f"stage 2 of 3 ({qname}-b, task {chain_id}.1) dead_lettered: retries_exhausted"
    )
    assert state.error == "ConnectionError: the knowledge graph is down"
    assert ran == ["a", "b", "b"]
    [dead] = await backend.dead_letters(app, f"{qname}-b")
    assert (dead.task_id, dead.headers[h.WORKFLOW]) == (f"{chain_id}.1", f"chain:{chain_id}")


async def test_a_rejected_first_stage_ends_the_chain_at_once(backend: Backend, qname: str) -> None:
    app = backend.app()

    @app.handler(f"{qname}-a")
    async def first(n: int) -> int:
        raise Reject("not for us")

    @app.handler(f"{qname}-b")
    async def second(n: int) -> int:
        return n

    await backend.open(app)
    await backend.run(app)
    chain_id = await app.chain([f"{qname}-a", f"{qname}-b"], 1)
    backend.ids.append(chain_id)
    state = await backend.final(app, chain_id)

    assert state.status is TaskStatus.DEAD_LETTERED
    assert state.reason is not None and state.reason.startswith(
        f"stage 1 of 2 ({qname}-a, task {chain_id}.0) dead_lettered"
    )


async def test_a_cancelled_chain_runs_none_of_its_stages(backend: Backend, qname: str) -> None:
    app = backend.app()
    ran: list[int] = []

    @app.handler(f"{qname}-a")
    async def first(n: int) -> int:
        ran.append(n)
        return n

    @app.handler(f"{qname}-b")
    async def second(n: int) -> int:
        ran.append(n)
        return n

    await backend.open(app)
    chain_id = await app.chain([f"{qname}-a", f"{qname}-b"], 1)
    backend.ids.append(chain_id)
    cancelled = await app.cancel_workflow(chain_id)
    await backend.run(app)
    state = await backend.final(app, chain_id)
    stage = await backend.final(app, f"{chain_id}.0", f"{qname}-a")

    assert cancelled.outcome.value == "cancelled"
    assert (state.status, state.reason) == (TaskStatus.CANCELLED, "cancelled")
    assert stage.status is TaskStatus.CANCELLED
    assert ran == []
    assert (await app.cancel_workflow(chain_id)).outcome.value == "finished"


async def test_a_chain_whose_stage_is_lost_ends_at_its_deadline_naming_it(
    backend: Backend, qname: str
) -> None:
    app = backend.app()

    @app.handler(f"{qname}-a")
    async def first(n: int) -> int:
        return n

    await backend.open(app)
    chain_id = await app.chain([f"{qname}-a"], 1, deadline_s=1.0)
    backend.ids.append(chain_id)
    await backend.remove(f"{qname}-a", f"{chain_id}.0")
    await backend.run(app)
    await backend.past_deadline(app, 1.0)
    state = await backend.final(app, chain_id)

    assert state.status is TaskStatus.EXPIRED
    assert state.reason == (
        f"the chain's deadline passed before stage 1 of 1 ({qname}-a, task {chain_id}.0) ended"
    )


# -- groups ---------------------------------------------------------------------------------


async def test_a_group_runs_its_callback_once_with_the_results_in_order(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    merged: list[list[int]] = []

    @app.handler(f"{qname}-part")
    async def square(n: int) -> int:
        return n * n

    @app.handler(f"{qname}-merge")
    async def merge(squares: list[int]) -> int:
        merged.append(squares)
        return sum(squares)

    await backend.open(app)
    await backend.run(app)
    group_id = await app.group(f"{qname}-part", range(8), then=f"{qname}-merge")
    backend.ids.append(group_id)
    state = await backend.final(app, group_id)

    assert (state.status, state.result, state.queue) == (
        TaskStatus.SUCCEEDED,
        140,
        GROUP_RECORD_QUEUE,
    )
    assert merged == [[n * n for n in range(8)]]


async def test_a_failed_part_fails_the_group_and_its_callback_never_runs(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    merged: list[Any] = []

    @app.handler(f"{qname}-part")
    async def part(n: int) -> int:
        if n == 2:
            raise Reject("chunk 2 is unreadable")
        return n

    @app.handler(f"{qname}-merge")
    async def merge(parts: list[int]) -> None:
        merged.append(parts)

    await backend.open(app)
    await backend.run(app)
    group_id = await app.group(f"{qname}-part", range(4), then=f"{qname}-merge")
    backend.ids.append(group_id)
    state = await backend.final(app, group_id)

    assert state.status is TaskStatus.DEAD_LETTERED
    assert state.reason == (
        f"part 3 of 4 ({qname}-part, task {group_id}.2) dead_lettered: rejected"
    )
    assert state.error == "Reject: chunk 2 is unreadable"
    assert merged == []


async def test_with_pass_the_callback_receives_every_part_s_end(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    received: list[list[PartResult]] = []

    @app.handler(f"{qname}-part")
    async def part(n: int) -> int:
        if n == 1:
            raise Reject("no")
        return n * 10

    @app.handler(f"{qname}-merge")
    async def merge(parts: list[PartResult]) -> list[str]:
        received.append(parts)
        return [p.status.value for p in parts]

    await backend.open(app)
    await backend.run(app)
    group_id = await app.group(f"{qname}-part", [0, 1, 2], then=f"{qname}-merge", on_failure="pass")
    backend.ids.append(group_id)
    state = await backend.final(app, group_id)

    assert (state.status, state.result) == (
        TaskStatus.SUCCEEDED,
        ["succeeded", "dead_lettered", "succeeded"],
    )
    [parts] = received
    assert [(p.task_id, p.result, p.reason) for p in parts] == [
        (f"{group_id}.0", 0, None),
        (f"{group_id}.1", None, "rejected"),
        (f"{group_id}.2", 20, None),
    ]


async def test_a_group_without_callback_ends_with_its_parts_results(
    backend: Backend, qname: str
) -> None:
    app = backend.app()

    @app.handler(f"{qname}-part")
    async def part(word: str) -> str:
        return word[::-1]

    await backend.open(app)
    await backend.run(app)
    group_id = await app.group(f"{qname}-part", ["ab", "cd", "ef"])
    backend.ids.append(group_id)
    state = await backend.final(app, group_id)

    assert (state.status, state.result) == (TaskStatus.SUCCEEDED, ["ba", "dc", "fe"])


async def test_a_part_delivered_again_is_counted_once(backend: Backend, qname: str) -> None:
    app = backend.app()
    merged: list[list[int]] = []

    @app.handler(f"{qname}-part")
    async def part(n: int) -> int:
        return n

    @app.handler(f"{qname}-merge")
    async def merge(parts: list[int]) -> int:
        merged.append(parts)
        return len(parts)

    await backend.open(app)
    await backend.run(app)
    group_id = await app.group(f"{qname}-part", [5, 6], then=f"{qname}-merge")
    backend.ids.append(group_id)
    first = await backend.final(app, group_id)
    # A copy of part 0, as the broker redelivers one whose worker died before its ack.
    await backend.redeliver(app, f"{qname}-part", f"{group_id}.0", f"group:{group_id}", b"5")
    again = await backend.final(app, group_id)

    assert (first.status, first.result) == (TaskStatus.SUCCEEDED, 2)
    assert again == first
    assert merged == [[5, 6]]


async def test_a_cancelled_group_cancels_its_parts_and_callback(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    ran: list[Any] = []

    @app.handler(f"{qname}-part")
    async def part(n: int) -> int:
        ran.append(n)
        return n

    @app.handler(f"{qname}-merge")
    async def merge(parts: list[int]) -> None:
        ran.append(parts)

    await backend.open(app)
    group_id = await app.group(f"{qname}-part", [1, 2, 3], then=f"{qname}-merge")
    backend.ids.append(group_id)
    cancelled = await app.cancel_workflow(group_id)
    await backend.run(app)
    state = await backend.final(app, group_id)
    parts = [await backend.final(app, f"{group_id}.{i}", f"{qname}-part") for i in range(3)]

    assert cancelled.outcome.value == "cancelled"
    assert state.status is TaskStatus.CANCELLED
    assert [p.status for p in parts] == [TaskStatus.CANCELLED] * 3
    assert ran == []


async def test_a_part_purged_by_an_operator_ends_the_group_at_its_deadline_naming_it(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    merged: list[Any] = []

    @app.handler(f"{qname}-part")
    async def part(n: int) -> int:
        return n

    @app.handler(f"{qname}-merge")
    async def merge(parts: list[int]) -> None:
        merged.append(parts)

    await backend.open(app)
    group_id = await app.group(f"{qname}-part", [0, 1, 2, 3], then=f"{qname}-merge", deadline_s=2.0)
    backend.ids.append(group_id)
    await backend.remove(f"{qname}-part", f"{group_id}.2")
    await backend.run(app)
    await backend.past_deadline(app, 2.0)
    state = await backend.final(app, group_id)

    assert state.status is TaskStatus.EXPIRED
    assert state.reason == (
        f"the group's deadline passed with 1 of 4 parts ({qname}-part) not ended (lost: "
        f"purged, expired in the queue, or its queue deleted?): parts 3 (task {group_id}.2)"
    )
    assert merged == []
    done = await app.status(f"{group_id}.1", queue=f"{qname}-part")
    assert done is not None and done.status is TaskStatus.SUCCEEDED


async def test_a_failed_part_cancels_the_parts_still_to_run(backend: Backend, qname: str) -> None:
    app = backend.app(concurrency=1)  # one part at a time: the others are still queued
    ran: list[int] = []

    @app.handler(f"{qname}-part")
    async def part(n: int) -> int:
        ran.append(n)
        raise Reject("the first chunk is unreadable")

    await backend.open(app)
    group_id = await app.group(f"{qname}-part", [0, 1, 2])
    backend.ids.append(group_id)
    await backend.run(app)
    state = await backend.final(app, group_id)
    rest = [await backend.final(app, f"{group_id}.{i}", f"{qname}-part") for i in (1, 2)]

    assert state.status is TaskStatus.DEAD_LETTERED
    assert ran == [0]
    assert [r.status for r in rest] == [TaskStatus.CANCELLED] * 2


@pytest.mark.on_private_redis
class TestTheSweepAfterTheAck:
    """A Redis of this test's own: any worker sweeps every due group of its Redis, and on
    the shared one another test's (or another suite's) worker swept this group early."""

    async def test_a_failed_part_cancels_one_batch_before_its_ack_and_a_sweep_the_rest_after(
        self,
        make_app: Callable[..., App],
        start_worker: Callable[..., Any],
        redis_url: str,
        qname: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        assert hops.CANCELS_BEFORE_ACK == 200  # the batch docs/how-to/workflows.md names
        # A batch of two for five parts: what a 100k-part group is to the 200 of a real batch.
        monkeypatch.setattr(hops, "CANCELS_BEFORE_ACK", 2)
        app = make_app("wf", workflow_sweep_s=3600.0)  # no worker of its own sweeps meanwhile
        queue = f"{qname}-part"
        ran: list[int] = []
        workers: list[Worker] = []

        @app.handler(queue)
        async def part(n: int) -> int:
            ran.append(n)
            if n == 0:
                workers[0].stop()  # the worker goes as this part is acked: it sweeps nothing
                raise Reject("the first chunk is unreadable")
            return n

        workers.append(await start_worker(app, concurrency=1))
        group_id = await app.group(queue, range(5))
        try:
            state = await app.result(group_id, timeout_s=WAIT_S)
            assert state.status is TaskStatus.DEAD_LETTERED
            await wait_until(
                lambda: outcome_count(app, queue, "dead_lettered") == 1, WAIT_S, "part 0 settled"
            )
            assert ran == [0]
            results = app.results
            assert results is not None
            ids = [f"{group_id}.{i}" for i in range(1, 5)]
            # Before the ack, the queue's next two; the rest is owed, not sent in that delivery.
            cancelled = [await results.is_cancelled(queue, t) for t in ids]
            assert cancelled == [True, True, False, False]
            client = aioredis.Redis.from_url(redis_url)
            try:
                due_ms = await client.zscore(WORKFLOW_DEADLINES_KEY, group_id)
            finally:
                await client.aclose()
            assert due_ms is not None and due_ms <= time.time() * 1000  # due now: any sweep
            # Another worker's sweep (the one that acked is gone) cancels the rest, once.
            await sweep(app)
            assert [await results.is_cancelled(queue, t) for t in ids] == [True] * 4
            await start_worker(app, concurrency=1)
            for task_id in ids:
                end = await app.result(task_id, queue=queue, timeout_s=WAIT_S)
                assert end.status is TaskStatus.CANCELLED
            assert ran == [0]
        finally:
            await forget_workflows(redis_url, [group_id], [])


class Order(BaseModel):
    n: int


async def test_a_result_the_next_stage_refuses_ends_the_chain_naming_it(
    backend: Backend, qname: str
) -> None:
    app = backend.app()

    @app.handler(f"{qname}-a")
    async def first(n: int) -> str:
        return "not an order"

    @app.handler(f"{qname}-b")
    async def second(order: Order) -> int:
        return order.n

    await backend.open(app)
    await backend.run(app)
    chain_id = await app.chain([f"{qname}-a", f"{qname}-b"], 1)
    backend.ids.append(chain_id)
    state = await backend.final(app, chain_id)

    assert state.status is TaskStatus.DEAD_LETTERED
    assert state.reason == (
        f"stage 2 of 2 ({qname}-b, task {chain_id}.1) could not be published: invalid_payload"
    )
    assert state.error is not None and state.error.startswith("PayloadValidationError")


async def test_a_stage_delivered_again_moves_the_chain_on_once(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    ran: list[str] = []

    @app.handler(f"{qname}-a")
    async def first(n: int) -> int:
        ran.append("a")
        return n + 1

    @app.handler(f"{qname}-b")
    async def second(n: int) -> int:
        ran.append("b")
        return n * 10

    await backend.open(app)
    await backend.run(app)
    chain_id = await app.chain([f"{qname}-a", f"{qname}-b"], 1)
    backend.ids.append(chain_id)
    first_end = await backend.final(app, chain_id)
    # A copy of stage 1, as the broker redelivers one whose worker died before its ack.
    await backend.redeliver(app, f"{qname}-a", f"{chain_id}.0", f"chain:{chain_id}", b"1")
    again = await backend.final(app, chain_id)

    assert (first_end.status, first_end.result) == (TaskStatus.SUCCEEDED, 20)
    assert again == first_end
    assert ran == ["a", "b"]


async def test_the_cli_cancels_a_workflow_and_says_when_it_had_ended(
    make_app: Callable[..., App], broker_url: str, redis_url: str, qname: str
) -> None:
    app = make_app("wf")

    @app.handler(f"{qname}-part")
    async def part(n: int) -> int:
        return n

    await app.declare()  # no worker: the parts wait in their queue
    group_id = await app.group(f"{qname}-part", [1, 2])
    env = settings_env(settings_for(broker_url, redis_url))
    try:
        done = await run_cli("cancel", group_id, "--workflow", env=env)
        assert done.code == 0, done.stderr
        assert done.stdout.strip() == f"workflow {group_id} cancelled, and its tasks still to come"
        state = await app.status(group_id)
        assert state is not None and state.status is TaskStatus.CANCELLED
        part_state = await app.status(f"{group_id}.1", queue=f"{qname}-part")
        assert part_state is not None and part_state.status is TaskStatus.CANCELLED

        again = await run_cli("cancel", group_id, "--workflow", env=env)
        assert (again.code, one_error_line(again)) == (
            1,
            f"weclaw-mq: error: workflow {group_id} already ended (cancelled); "
            "nothing was cancelled",
        )
        unknown = await run_cli("cancel", f"{group_id}-no", "--workflow", env=env)
        assert one_error_line(unknown) == (
            f"weclaw-mq: error: workflow {group_id}-no is not known: nothing was cancelled"
        )
        misused = await run_cli("cancel", group_id, "--workflow", "--pending", env=env)
        assert misused.code == 2 and "--workflow takes neither" in misused.stderr
    finally:
        await forget_workflows(redis_url, [group_id], [])


async def test_a_chain_stage_and_group_parts_replay_their_steps_on_a_retry(
    backend: Backend, qname: str
) -> None:
    """Memoized steps (``ctx.step``) inside a chain's stage and a group's parts: each part's
    step runs once though its first attempt asked for a retry after it."""
    app = backend.app(retry_delay_s=0.05)
    calls: list[str] = []

    async def model(text: str) -> str:
        calls.append(text)
        return text.upper()

    @app.handler(f"{qname}-s", retry=FAST_RETRY)
    async def stage(text: str, ctx: Any) -> str:
        answer: str = await ctx.step("model", model, text)
        if ctx.attempt == 1:
            raise Retry("the tool said busy", after_s=0.05)
        return answer

    @app.handler(f"{qname}-t")
    async def tail(text: str) -> str:
        return f"{text}!"

    await backend.open(app)
    await backend.run(app)
    chain_id = await app.chain([f"{qname}-s", f"{qname}-t"], "hi")
    group_id = await app.group(f"{qname}-s", ["a", "b", "c"])
    backend.ids += [chain_id, group_id]

    chained = await backend.final(app, chain_id)
    grouped = await backend.final(app, group_id)
    assert (chained.status, chained.result) == (TaskStatus.SUCCEEDED, "HI!")
    assert (grouped.status, grouped.result) == (TaskStatus.SUCCEEDED, ["A", "B", "C"])
    assert sorted(calls) == ["a", "b", "c", "hi"]  # each once, across the retries

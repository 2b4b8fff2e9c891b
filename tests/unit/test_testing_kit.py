"""The test broker's own promises, beyond the scenarios it shares with the real broker
(tests/integration/test_testing_kit_scenarios.py): delays are the policy's and are skipped,
not waited; time can be held and moved by hand; the rest of the app's surface (cancel,
priorities, pipelines over two apps, timeouts, unroutable publishes) works; and the app is
given back untouched."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import pytest
from pydantic import BaseModel

from weclaw_mq import (
    App,
    ConfigurationError,
    Context,
    InvalidPriorityError,
    Priority,
    Retry,
    RetryPolicy,
    Settings,
    TaskNotification,
    TaskStatus,
    UnroutableError,
)
from weclaw_mq.admin.dlq_message import read_dead_letter
from weclaw_mq.contract import lifetime
from weclaw_mq.policy.delays import STEP_DELAYS_MS
from weclaw_mq.testing import TestBroker, VirtualClock, outcome_counts, services
from weclaw_mq.testing.queues import MemoryBroker
from weclaw_mq.wire.topology import (
    QueueSpec,
    delay_exchanges,
    ladder_declarations,
    queue_declarations,
)

Q = "kit-q"


class Job(BaseModel):
    n: int


def offline_app(**settings: Any) -> App:
    """An app whose broker and Redis do not exist: only the test broker can serve it."""
    dead = {"amqp_url": "amqp://guest:guest@127.0.0.1:1/", "redis_url": "redis://127.0.0.1:1"}
    return App("kit", settings=Settings(_env_file=None, **{**dead, **settings}))  # type: ignore[call-arg]


async def test_retries_wait_the_policys_delays_on_the_virtual_clock() -> None:
    app = offline_app()
    seen_ms: list[int] = []

    @app.handler(Q)  # the default policy: 5 s, 10 s, 20 s, then the DLQ
    async def failing(job: Job) -> None:
        seen_ms.append(lifetime.now_ms())
        raise RuntimeError("down")

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 1})
        await broker.run_until_idle()
        state = await app.status(task_id)

    assert state is not None and (state.status, state.attempt) == (TaskStatus.DEAD_LETTERED, 4)
    assert broker.waits(Q) == [5.0, 10.0, 20.0]
    gaps_ms = [b - a for a, b in itertools.pairwise(seen_ms)]
    # Each attempt came no earlier than its delay after the one before, on the broker's clock.
    assert [g >= w * 1000 for g, w in zip(gaps_ms, [5.0, 10.0, 20.0], strict=True)] == [True] * 3
    assert broker.clock.skipped_s > 0


async def test_a_held_clock_leaves_a_retry_parked_until_moved() -> None:
    app = offline_app()
    calls: list[int] = []

    @app.handler(Q, retry=RetryPolicy(max_retries=1, delay_s=30.0))
    async def once_failing(job: Job) -> str:
        calls.append(job.n)
        if len(calls) == 1:
            raise ConnectionError("busy")
        return "ok"

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 1})
        await broker.run_until_idle(advance_clock=False)
        state = await app.status(task_id)
        assert state is not None and state.status is TaskStatus.RETRYING
        assert (broker.depth("weclaw_mq.delay.30s"), calls) == (1, [1])

        broker.advance(29.0)
        await broker.run_until_idle(advance_clock=False)
        assert (broker.depth("weclaw_mq.delay.30s"), calls) == (1, [1])

        broker.advance(1.0)
        await broker.run_until_idle(advance_clock=False)
        state = await app.status(task_id)
    assert state is not None and (state.status, state.result) == (TaskStatus.SUCCEEDED, "ok")
    assert calls == [1, 1]


async def test_a_retry_after_that_has_no_queue_of_its_own_hops_until_it_is_due() -> None:
    app = offline_app()
    seen_ms: list[int] = []

    @app.handler(Q)
    async def asks_later(job: Job) -> str:
        seen_ms.append(lifetime.now_ms())
        if len(seen_ms) == 1:
            raise Retry(after_s=90)  # not a delay queue: it hops through the step queues
        return "ok"

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 1})
        await broker.run_until_idle()
        state = await app.status(task_id)

    assert state is not None and (state.status, state.attempt) == (TaskStatus.SUCCEEDED, 2)
    assert seen_ms[1] - seen_ms[0] >= 90_000
    hops = broker.waits(Q)
    assert len(hops) > 1 and sum(hops) >= 90
    assert all(hop * 1000 in STEP_DELAYS_MS or hop in (5.0, 10.0, 20.0) for hop in hops)


async def test_a_delayed_publish_does_not_run_before_its_time() -> None:
    app = offline_app()
    calls: list[int] = []

    @app.handler(Q)
    async def record(job: Job) -> None:
        calls.append(job.n)

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 3}, delay_s=120)
        await broker.run_until_idle(advance_clock=False)
        state = await app.status(task_id)
        assert state is not None and state.status is TaskStatus.QUEUED
        assert calls == []
        await broker.run_until_idle()
        state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.SUCCEEDED
    assert calls == [3]


async def test_a_cancelled_task_is_acked_unrun() -> None:
    app = offline_app()
    calls: list[int] = []

    @app.handler(Q)
    async def record(job: Job) -> None:
        calls.append(job.n)

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 1})
        await app.cancel(task_id)
        await broker.run_until_idle()
        state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.CANCELLED
    assert calls == []
    assert outcome_counts(app, Q) == {"cancelled": 1}


async def test_higher_priorities_run_first() -> None:
    app = offline_app(concurrency=1)
    order: list[int] = []

    @app.handler(Q, priorities=True)
    async def record(job: Job) -> None:
        order.append(job.n)

    async with TestBroker(app) as broker:
        await app.publish(Q, {"n": 0})
        await app.publish(Q, {"n": 1}, priority=Priority.HIGH)
        await app.publish(Q, {"n": 2}, priority=Priority.URGENT)
        await broker.run_until_idle()
    assert order == [2, 1, 0]


async def test_a_priority_for_a_handler_without_priorities_is_refused_before_anything_is_sent() -> (
    None
):
    """Lanes are opt-in (issue 25): a handler without ``priorities=True`` has none, so its app
    refuses a HIGH task at once rather than publish it to a lane that does not exist."""
    app = offline_app()

    @app.handler(Q)
    async def record(job: Job) -> None: ...

    async with TestBroker(app) as broker:
        with pytest.raises(InvalidPriorityError, match=r"takes no priorities.*priorities=True"):
            await app.publish(Q, {"n": 1}, priority="high")
        assert broker.depth(Q) == 0
        assert sorted(broker.memory.queues) == sorted(
            [Q, f"{Q}.dlq", *(n for n, _ in ladder_declarations([app.handlers[Q].queue_spec()]))]
        )
        await app.publish(Q, {"n": 2}, priority="normal")  # NORMAL is every handler's
        assert broker.depth(Q) == 1


async def test_a_delayed_task_whose_queue_is_gone_is_parked_not_dropped() -> None:
    clock = VirtualClock()
    memory = MemoryBroker(clock)
    spec = QueueSpec(name=Q, retry_delays_ms=(5000,), delivery_limit=2)
    for name, arguments in ladder_declarations([spec]):
        memory.declare(name, arguments)
    for exchange in delay_exchanges(spec):
        memory.declare_fanout(exchange, exchange)
    memory.publish(Q, aio_pika.Message(b"{}", message_id="t-3"), exchange="weclaw_mq.delay.5s")
    clock.advance(5.0)
    memory.expire_due()
    parked = memory.deliver("weclaw_mq.unroutable.dlq")
    assert parked is not None and parked.message_id == "t-3" and parked.routing_key == Q


async def test_a_pipeline_over_two_apps_runs_to_its_last_stage() -> None:
    producer, worker = offline_app(), offline_app()

    @worker.handler("kit-stage-1")
    async def first(job: Job, ctx: Context) -> None:
        await ctx.app.publish("kit-stage-2", {"n": job.n + 1}, task_id=ctx.task_id)

    @worker.handler("kit-stage-2")
    async def second(job: Job) -> int:
        return job.n * 10

    async with TestBroker(producer, worker) as broker:
        task_id = await producer.publish("kit-stage-1", {"n": 4})
        await broker.run_until_idle()
        state = await producer.status(task_id, queue="kit-stage-2")
    assert state is not None and (state.status, state.result) == (TaskStatus.SUCCEEDED, 50)


async def test_a_handler_past_its_timeout_fails_with_handler_timeout() -> None:
    app = offline_app()

    @app.handler(Q, timeout_s=0.05, retry=RetryPolicy(max_retries=0))
    async def hangs(job: Job) -> None:
        await asyncio.Event().wait()

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 1})
        await broker.run_until_idle()
        [dead] = broker.dead_letters(Q)
    assert (dead.task_id, dead.reason, dead.error_type) == (
        task_id,
        "retries_exhausted",
        "weclaw_mq.HandlerTimeout",
    )


async def test_publishing_to_a_queue_nobody_declared_is_unroutable() -> None:
    app = offline_app()

    @app.handler(Q)
    async def record(job: Job) -> None:
        return None

    async with TestBroker(app):
        with pytest.raises(UnroutableError):
            await app.publish("kit-nobody-declared", {"n": 1})


async def test_the_app_and_the_clock_are_given_back_on_exit() -> None:
    app = offline_app()

    @app.handler(Q)
    async def record(job: Job) -> None:
        return None

    before = (app._engine.publisher, app._store, app._reader._streams, app._engine.local)
    async with TestBroker(app) as broker:
        broker.advance(3600)
        assert lifetime.now_ms() >= int(time.time() * 1000) + 3_599_000
    assert (app._engine.publisher, app._store, app._reader._streams, app._engine.local) == before
    assert lifetime.now_ms() <= int(time.time() * 1000)


async def test_emitted_chunks_reach_the_tasks_stream_before_its_final_event() -> None:
    app = offline_app()

    @app.handler(Q)
    async def speak(job: Job, ctx: Context) -> str:
        for word in ("one", "two"):
            await ctx.emit(word)
        return "one two"

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 1})
        await broker.run_until_idle()
        events = [e async for e in app.stream(task_id)]
    chunks = [e.data for e in events if e.kind == "chunk"]
    assert chunks == ["one", "two"]
    assert (events[-1].kind, events[-1].result) == ("final", "one two")


def test_a_message_handed_back_past_the_delivery_limit_is_dead_lettered_by_the_broker() -> None:
    clock = VirtualClock()
    memory = MemoryBroker(clock)
    spec = QueueSpec(name=Q, retry_delays_ms=(5000,), delivery_limit=2)
    for name, arguments in queue_declarations(spec):
        memory.declare(name, arguments)
    memory.publish(Q, aio_pika.Message(b"{}", message_id="t-1"))

    returns = 0
    while (message := memory.deliver(Q)) is not None:
        assert message.delivery_tag is not None
        memory.settle(message.delivery_tag, requeue=True)
        returns += 1

    assert returns == 3  # the third return is over the limit of 2
    [dead] = [
        read_dead_letter(m.task_id, m.headers, m.body) for m in memory.queues[f"{Q}.dlq"].messages
    ]
    assert (dead.task_id, dead.reason, dead.by_broker) == ("t-1", "delivery_limit", True)


def test_a_delay_queue_hands_its_message_back_when_its_ttl_is_over() -> None:
    clock = VirtualClock()
    memory = MemoryBroker(clock)
    spec = QueueSpec(name=Q, retry_delays_ms=(5000,), delivery_limit=2, priorities=True)
    for name, arguments in [*ladder_declarations([spec]), *queue_declarations(spec)]:
        memory.declare(name, arguments)
    for exchange in delay_exchanges(spec):
        memory.declare_fanout(exchange, exchange)
    # Through the delay queue's exchange, with the lane it goes back to as routing key.
    lane = f"{Q}.lane.high"
    memory.publish(lane, aio_pika.Message(b"{}", message_id="t-2"), exchange="weclaw_mq.delay.5s")

    assert memory.deliver(lane) is None
    clock.advance(4.9)
    assert memory.deliver(lane) is None
    clock.advance(0.1)
    assert memory.deliver(Q) is None  # not to Q: to the lane its routing key names
    message = memory.deliver(lane)
    assert message is not None and message.message_id == "t-2"
    assert message.routing_key == lane
    [death] = message.headers["x-death"]
    assert (death["reason"], death["queue"], death["count"]) == (
        "expired",
        "weclaw_mq.delay.5s",
        1,
    )
    assert (death["exchange"], death["routing-keys"]) == ("weclaw_mq.delay.5s", [lane])


async def test_two_apps_with_a_handler_on_one_queue_are_refused_and_given_back() -> None:
    first, second = offline_app(), offline_app()

    @first.handler(Q)
    async def one(job: Job) -> None:
        return None

    @second.handler(Q)
    async def other(job: Job) -> None:
        return None

    with pytest.raises(ConfigurationError, match="in two of the apps"):
        async with TestBroker(first, second):
            pass
    assert (first._engine.publisher, first._store, second._engine.publisher, second._store) == (
        None,
    ) * 4
    assert lifetime.now_ms() <= int(time.time() * 1000)


async def test_a_notifying_handler_announces_its_final_state_to_its_results_queue() -> None:
    app = offline_app()

    @app.handler(Q, notify=True)
    async def answer(job: Job) -> int:
        return job.n + 1

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"n": 41})
        await broker.run_until_idle()
        [message] = broker.messages(f"{Q}.results")
    note = TaskNotification.model_validate_json(message.body)
    assert (note.task_id, note.status, note.result) == (task_id, TaskStatus.SUCCEEDED, 42)


def test_with_a_docker_engine_but_no_testcontainers_the_service_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(services.AMQP_ENV, raising=False)
    monkeypatch.setattr(services, "docker_engine", lambda: True)
    monkeypatch.setitem(sys.modules, "testcontainers.rabbitmq", None)  # import fails

    with (
        pytest.raises(services.ServiceMissing, match=r"pip install 'weclaw-mq\[testing\]'"),
        services.rabbitmq(),
    ):
        pass


async def test_outcomes_count_from_when_the_broker_opened() -> None:
    app = offline_app()

    @app.handler(Q, retry=RetryPolicy(max_retries=1, delay_s=1.0))
    async def failing(job: Job) -> None:
        raise RuntimeError("down")

    for _ in range(2):  # two tests in a row on one module-level app
        async with TestBroker(app) as broker:
            await app.publish(Q, {"n": 1})
            await broker.run_until_idle()
            assert broker.outcomes(Q) == {"retried": 1, "dead_lettered": 1}
    assert outcome_counts(app, Q) == {"retried": 2, "dead_lettered": 2}


async def test_the_plugins_fixture_opens_a_test_broker_in_this_projects_own_run(
    weclaw_test_broker: Callable[..., Awaitable[TestBroker]],
) -> None:
    app = offline_app()

    @app.handler(Q)
    async def echo(job: Job) -> int:
        return job.n

    broker = await weclaw_test_broker(app, concurrency=2)
    task_id = await app.publish(Q, {"n": 8})
    await broker.run_until_idle()
    state = await app.status(task_id)
    assert state is not None and (state.status, state.result) == (TaskStatus.SUCCEEDED, 8)


def test_a_rejected_message_is_dead_lettered_by_the_broker_as_rejected() -> None:
    memory = MemoryBroker(VirtualClock())
    spec = QueueSpec(name=Q, retry_delays_ms=(5000,), delivery_limit=2)
    for name, arguments in queue_declarations(spec):
        memory.declare(name, arguments)
    memory.publish(Q, aio_pika.Message(b"{}", message_id="t-3"))

    message = memory.deliver(Q)
    assert message is not None and message.delivery_tag is not None
    memory.settle(message.delivery_tag, requeue=False)

    assert memory.deliver(Q) is None
    [stored] = memory.queues[f"{Q}.dlq"].messages
    dead = read_dead_letter(stored.task_id, stored.headers, stored.body)
    assert (dead.task_id, dead.reason, dead.original_queue) == ("t-3", "rejected", Q)


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "1e9"])
def test_a_service_wait_that_is_not_seconds_says_so(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(services.SERVICE_WAIT_ENV, raw)
    with pytest.raises(services.ServiceMissing, match=services.SERVICE_WAIT_ENV):
        services.service_wait_s()


def test_the_service_wait_is_the_default_or_the_one_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(services.SERVICE_WAIT_ENV, raising=False)
    assert services.service_wait_s() == services.SERVICE_WAIT_S
    monkeypatch.setenv(services.SERVICE_WAIT_ENV, "2.5")
    assert services.service_wait_s() == 2.5


async def test_an_app_with_prices_and_limits_runs_in_the_kit_without_the_llm_features() -> None:
    # The LLM layer's state needs Redis; the kit runs such an app as before (no limit, no
    # bill), with results and guard off too, and gives the app back able to use them.
    from weclaw_mq.llm import Limit, Price

    app = offline_app(results_enabled=False)
    app.prices = {"m": Price(input_per_1k=1.0, output_per_1k=1.0)}
    ran: list[int] = []

    @app.handler(Q, idempotent=False, limit=Limit(concurrency=1))
    async def handle(task: dict[str, int], ctx: Context) -> None:
        ctx.usage(input_tokens=1, output_tokens=1, model="m")
        ran.append(task["n"])

    async with TestBroker(app) as broker:
        await app.publish_many(Q, [{"n": 1}, {"n": 2}])
        await broker.run_until_idle()
    assert sorted(ran) == [1, 2]
    assert app._models.used  # given back

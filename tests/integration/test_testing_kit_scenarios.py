"""The test broker keeps the real broker's word: one set of scenarios, run on both.

Each scenario builds an app, starts its handlers, publishes, waits for the task's end and
asserts what a user's test would: the status, result and attempt, the dead letter's reason,
error type and attempts, the handler's calls and how the worker ended each delivery
(``outcome_counts``). The ``backend`` fixture runs it once on ``weclaw_mq.testing.TestBroker``
(memory) and once on the shared RabbitMQ and Redis with a real ``Worker``. The assertions are
the same lines for both: where the two disagreed, one of these tests fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel

from tests.conftest import wait_until
from tests.integration.scenario_backends import WAIT_S, MemoryBackend, RealBackend
from weclaw_mq import App, Reject, RetryPolicy, TaskState, TaskStatus
from weclaw_mq.testing import DeadLetter, outcome_counts

# Short enough for the real broker's delay queues, long enough to be a delay.
FAST_RETRY = RetryPolicy(max_retries=2, delay_s=0.05, multiplier=2.0)


class Order(BaseModel):
    n: int


class QuotaExceeded(Exception):
    """A user's own error type, as a dead letter names it."""


class Backend:
    """Where a scenario runs: ``memory`` (TestBroker) or ``rabbitmq`` (real Worker)."""

    name: str

    def app(self, **settings: Any) -> App:
        raise NotImplementedError

    async def start(self, app: App) -> None:
        raise NotImplementedError

    async def publish_raw(self, queue: str, body: bytes, task_id: str) -> None:
        """As a producer that is not an App: no model check."""
        raise NotImplementedError

    async def final(self, app: App, task_id: str, queue: str) -> TaskState:
        """The task's final state, once it has one."""
        raise NotImplementedError

    async def dead_letters(self, app: App, queue: str) -> list[DeadLetter]:
        raise NotImplementedError

    async def outcomes(self, app: App, queue: str, expected: dict[str, int]) -> dict[str, int]:
        """The outcome counts, once they are ``expected`` (a worker counts an ack after the
        result is stored) or as they stand."""
        return outcome_counts(app, queue)


class Memory(MemoryBackend, Backend):
    app_name = "kit"

    async def start(self, app: App) -> None:
        await self.open_broker(app)

    async def publish_raw(self, queue: str, body: bytes, task_id: str) -> None:
        await self._broker().publish_raw(queue, body, task_id=task_id)


class Real(RealBackend, Backend):
    def app(self, **settings: Any) -> App:
        return self.make_app("kit", **settings)

    async def start(self, app: App) -> None:
        await self.start_worker(app)

    async def publish_raw(self, queue: str, body: bytes, task_id: str) -> None:
        await self.publish_body(queue, body, task_id)

    async def outcomes(self, app: App, queue: str, expected: dict[str, int]) -> dict[str, int]:
        with contextlib.suppress(AssertionError):
            await wait_until(lambda: outcome_counts(app, queue) == expected, WAIT_S / 3)
        return outcome_counts(app, queue)


@pytest.fixture
async def memory_backend() -> AsyncIterator[Backend]:
    async with contextlib.AsyncExitStack() as stack:
        yield Memory(stack)


@pytest.fixture
def rabbitmq_backend(
    make_app: Callable[..., App], start_worker: Callable[..., Any], broker_url: str
) -> Backend:
    return Real(make_app, start_worker, broker_url)


@pytest.fixture(params=["memory", "rabbitmq"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each scenario on both; only the rabbitmq run needs (and checks for) the services."""
    found: Backend = request.getfixturevalue(f"{request.param}_backend")
    return found


async def test_a_handler_that_returns_succeeds_with_its_result(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    calls: list[int] = []

    @app.handler(qname)
    async def double(order: Order) -> dict[str, int]:
        calls.append(order.n)
        return {"doubled": order.n * 2}

    await backend.start(app)
    task_id = await app.publish(qname, {"n": 21})
    state = await backend.final(app, task_id, qname)

    assert (state.status, state.result, state.attempt) == (TaskStatus.SUCCEEDED, {"doubled": 42}, 1)
    assert calls == [21]
    assert await backend.outcomes(app, qname, {"acked": 1}) == {"acked": 1}
    assert await backend.dead_letters(app, qname) == []


async def test_a_failing_handler_is_retried_through_the_delay_queues_until_it_succeeds(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    attempts: list[int] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def flaky(order: Order) -> str:
        attempts.append(order.n)
        if len(attempts) < 3:
            raise ConnectionError("the model is busy")
        return "done"

    await backend.start(app)
    task_id = await app.publish(qname, {"n": 1})
    state = await backend.final(app, task_id, qname)

    assert (state.status, state.result, state.attempt) == (TaskStatus.SUCCEEDED, "done", 3)
    assert attempts == [1, 1, 1]
    expected = {"retried": 2, "acked": 1}
    assert await backend.outcomes(app, qname, expected) == expected
    assert await backend.dead_letters(app, qname) == []


async def test_a_handler_that_keeps_failing_is_dead_lettered_with_its_error_type(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    calls: list[int] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def over_quota(order: Order) -> None:
        calls.append(order.n)
        raise QuotaExceeded("monthly quota used up")

    await backend.start(app)
    task_id = await app.publish(qname, {"n": 7})
    state = await backend.final(app, task_id, qname)

    assert (state.status, state.reason, state.attempt) == (
        TaskStatus.DEAD_LETTERED,
        "retries_exhausted",
        3,
    )
    assert state.error == "QuotaExceeded: monthly quota used up"
    assert len(calls) == 3
    expected = {"retried": 2, "dead_lettered": 1}
    assert await backend.outcomes(app, qname, expected) == expected
    [dead] = await backend.dead_letters(app, qname)
    assert (dead.task_id, dead.reason, dead.error_type, dead.attempts, dead.original_queue) == (
        task_id,
        "retries_exhausted",
        "QuotaExceeded",
        3,
        qname,
    )
    assert dead.error_message == "monthly quota used up"
    # The broker's record of the two hops through the delay queues, most recent first.
    deaths = [(d["reason"], d["queue"], d["count"]) for d in dead.headers["x-death"]]
    assert deaths == [
        ("expired", "weclaw_mq.delay.100ms", 1),
        ("expired", "weclaw_mq.delay.50ms", 1),
    ]
    assert dead.headers["x-first-death-queue"] == "weclaw_mq.delay.50ms"


async def test_a_body_the_model_refuses_is_dead_lettered_as_invalid_payload_unrun(
    backend: Backend, qname: str
) -> None:
    app = backend.app()
    calls: list[int] = []

    @app.handler(qname)
    async def typed(order: Order) -> None:
        calls.append(order.n)

    await backend.start(app)
    await backend.publish_raw(qname, b'{"n": "not a number"}', "raw-task-1")
    state = await backend.final(app, "raw-task-1", qname)

    assert (state.status, state.reason, state.attempt) == (
        TaskStatus.DEAD_LETTERED,
        "invalid_payload",
        1,
    )
    assert calls == []
    assert await backend.outcomes(app, qname, {"dead_lettered": 1}) == {"dead_lettered": 1}
    [dead] = await backend.dead_letters(app, qname)
    assert (dead.task_id, dead.reason, dead.error_type, dead.attempts) == (
        "raw-task-1",
        "invalid_payload",
        "weclaw_mq.InvalidPayload",
        1,
    )


async def test_a_rejected_task_goes_to_the_dead_letter_queue_without_a_retry(
    backend: Backend, qname: str
) -> None:
    app = backend.app()

    @app.handler(qname, retry=FAST_RETRY)
    async def refuse(order: Order) -> None:
        raise Reject("the document is empty")

    await backend.start(app)
    task_id = await app.publish(qname, {"n": 0})
    state = await backend.final(app, task_id, qname)

    assert (state.status, state.reason, state.attempt) == (TaskStatus.DEAD_LETTERED, "rejected", 1)
    assert await backend.outcomes(app, qname, {"dead_lettered": 1}) == {"dead_lettered": 1}
    [dead] = await backend.dead_letters(app, qname)
    assert (dead.reason, dead.error_type) == ("rejected", "weclaw_mq.Reject")


async def test_the_same_task_id_published_twice_runs_once(backend: Backend, qname: str) -> None:
    app = backend.app()
    calls: list[int] = []

    @app.handler(qname)
    async def charge(order: Order) -> int:
        calls.append(order.n)
        return order.n

    await backend.start(app)
    first = await app.publish(qname, {"n": 5}, task_id="order-5")
    again = await app.publish(qname, {"n": 5}, task_id="order-5")
    assert first == again == "order-5"
    state = await backend.final(app, "order-5", qname)

    assert (state.status, state.result) == (TaskStatus.SUCCEEDED, 5)
    expected = {"acked": 1, "duplicate": 1}
    assert await backend.outcomes(app, qname, expected) == expected
    assert calls == [5]


async def test_a_retry_that_would_outlive_the_task_ends_it_as_expired(
    backend: Backend, qname: str
) -> None:
    app = backend.app()

    @app.handler(qname, retry=RetryPolicy(max_retries=3, delay_s=60.0))
    async def slow_upstream(order: Order) -> None:
        raise TimeoutError("upstream timed out")

    await backend.start(app)
    task_id = await app.publish(qname, {"n": 1}, ttl_s=30.0)
    state = await backend.final(app, task_id, qname)

    assert (state.status, state.reason, state.attempt) == (TaskStatus.EXPIRED, "expired", 1)
    assert await backend.outcomes(app, qname, {"dead_lettered": 1}) == {"dead_lettered": 1}
    [dead] = await backend.dead_letters(app, qname)
    assert (dead.reason, dead.error_type, dead.attempts) == ("expired", "weclaw_mq.TaskExpired", 1)

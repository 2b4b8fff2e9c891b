"""Model fallback chains on the real broker and Redis (issue 31 item 2), against the local
stand-in for a provider (``weclaw_mq.testing.fake_provider``): a failed attempt's retry goes
to the next model, a model that keeps failing is skipped by every new task until its
cool-down ends and then used first again, a 429's Retry-After takes a model down for that
long, every model down parks the task without spending an attempt, and the dead-letter copy
names the models it failed on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.conftest import get_message, outcome_count, wait_until
from weclaw_mq import (
    App,
    Context,
    Limit,
    Retry,
    RetryPolicy,
    TaskStatus,
    UpstreamDown,
    retry_after_s,
)
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name, models_key
from weclaw_mq.policy.fallback import Fallback
from weclaw_mq.state.model_health import health_of
from weclaw_mq.testing.fake_provider import FakeProvider, ModelLimits, serving

A, B = "model-a", "model-b"
FAST = RetryPolicy(max_retries=3, delay_s=0.05, multiplier=1)


@pytest.fixture
async def provider() -> AsyncIterator[tuple[FakeProvider, httpx.AsyncClient]]:
    limits = ModelLimits(tokens=10**9, requests=10**6, window_s=60)
    fake = FakeProvider({A: limits, B: limits})
    async with serving(fake) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        yield fake, client


def build(
    make_app: Callable[..., App],
    qname: str,
    client: httpx.AsyncClient,
    redis_url: str,
    forget: list[str],
    *,
    fallback: Fallback,
    retry: RetryPolicy = FAST,
) -> tuple[App, list[tuple[int, str]]]:
    app = make_app(f"fallback-{qname}")
    forget.append(models_key(app.name))
    seen: list[tuple[int, str]] = []  # (attempt, model) of every run

    @app.handler(qname, fallback=fallback, retry=retry)
    async def complete(task: dict[str, str], ctx: Context) -> str:
        assert ctx.model is not None
        seen.append((ctx.attempt, ctx.model))
        response = await client.post(
            "/v1/complete", json={"model": ctx.model, "prompt": task["prompt"], "max_tokens": 4}
        )
        if response.status_code == 429:
            raise Retry("rate limited", after_s=retry_after_s(response.headers.get("Retry-After")))
        if response.status_code == 503:
            raise UpstreamDown(f"{ctx.model} is down")
        return ctx.model

    return app, seen


@pytest.fixture
async def forget(redis_url: str) -> AsyncIterator[list[str]]:
    keys: list[str] = []
    yield keys
    client = aioredis.from_url(redis_url)
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_a_retry_moves_down_the_list_and_a_failing_model_is_skipped_until_it_recovers(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    redis_url: str,
    forget: list[str],
) -> None:
    fake, client = provider
    app, seen = build(
        make_app,
        qname,
        client,
        redis_url,
        forget,
        fallback=Fallback([A, B], failures=2, cool_down_s=1.5),
    )
    await start_worker(app, concurrency=1)
    fake.down.add(A)
    first = await app.publish(qname, {"prompt": "one"})
    done = await app.result(first, timeout_s=20)
    assert done.result == B
    assert seen == [(1, A), (2, B)]  # its retry went to the next model
    assert done.model == B  # the status names the model of the attempt that wrote it
    second = await app.publish(qname, {"prompt": "two"})
    assert (await app.result(second, timeout_s=20)).result == B
    # Two failures in a row on A: A is down for 1.5 s, new tasks start on B.
    third = await app.publish(qname, {"prompt": "three"})
    assert (await app.result(third, timeout_s=20)).result == B
    assert seen[-1] == (1, B)
    fake.down.clear()
    taken_down = app.metrics.registry.get_sample_value(
        "weclaw_mq_model_attempts_total", {"queue": qname, "model": A, "outcome": "taken_down"}
    )
    assert taken_down == 1
    # After the cool-down, A is up again and first in line.
    await _until_up(app, A)
    fourth = await app.publish(qname, {"prompt": "four"})
    assert (await app.result(fourth, timeout_s=20)).result == A
    assert seen[-1] == (1, A)


async def _until_up(app: App, model: str) -> None:
    health = health_of(app.store, app.name)

    async def up() -> bool:
        _, down = await health.down_until([model])
        return model not in down

    await wait_until(up, 10, f"{model} up again")


async def test_a_429_takes_the_model_down_for_its_retry_after_for_every_task(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    redis_url: str,
    forget: list[str],
) -> None:
    fake, client = provider
    fake.limits[A] = ModelLimits(tokens=5, requests=10**6, window_s=30)  # one call fits
    app, seen = build(make_app, qname, client, redis_url, forget, fallback=Fallback([A, B]))
    await start_worker(app, concurrency=1)
    ids = [await app.publish(qname, {"prompt": f"p{n}"}) for n in range(3)]
    results = [(await app.result(t, timeout_s=20)).result for t in ids]

    assert results == [A, B, B]
    assert fake.refused == 1  # one 429: then A was down for its Retry-After, for every task
    assert sorted(seen) == [
        (1, A),
        (1, A),
        (1, B),
        (2, B),
    ]  # task 2 retried on B, task 3 began there


async def test_every_model_down_parks_the_task_and_the_dead_letter_names_the_models(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    redis_url: str,
    forget: list[str],
    amqp: Any,
) -> None:
    fake, client = provider
    app, seen = build(
        make_app,
        qname,
        client,
        redis_url,
        forget,
        fallback=Fallback([A, B], failures=1, cool_down_s=0.5),
        retry=RetryPolicy(max_retries=2, delay_s=0.05, multiplier=1),
    )
    await start_worker(app, concurrency=1)
    fake.down.update({A, B})
    parked = await app.publish(qname, {"prompt": "nobody answers yet"})

    def probes_failed() -> float:
        value = app.metrics.registry.get_sample_value(
            "weclaw_mq_model_attempts_total",
            {"queue": qname, "model": A, "outcome": "probe_failed"},
        )
        return value or 0.0

    # A failed (down), B failed (down), then both were down: parked, no attempt spent; each
    # cool-down's end, one probe, whose failure parks it again without spending one either.
    await wait_until(lambda: probes_failed() >= 2, 30, "two failed probes of A")
    assert seen[:2] == [(1, A), (2, B)]
    assert max(a for a, _ in seen) == 3  # every probe ran as attempt 3, none spent it
    assert outcome_count(app, qname, "deferred") >= 2
    state = await app.status(parked)
    assert state is not None and state.status is not TaskStatus.DEAD_LETTERED
    fake.down.clear()
    assert (await app.result(parked, timeout_s=30)).status is TaskStatus.SUCCEEDED

    # Its retries spent while models still answer at times: the dead letter names them.
    fake.down.update({A, B})
    app_dl, seen_dl = build(
        make_app,
        f"{qname}-dl",
        client,
        redis_url,
        forget,
        fallback=Fallback([A, B], failures=5, cool_down_s=0.5),
        retry=RetryPolicy(max_retries=2, delay_s=0.05, multiplier=1),
    )
    await start_worker(app_dl, concurrency=1)
    task_id = await app_dl.publish(f"{qname}-dl", {"prompt": "nobody answers"})
    final = await app_dl.result(task_id, timeout_s=30)
    assert final.status is TaskStatus.DEAD_LETTERED and final.reason == "retries_exhausted"
    assert final.model == A  # its last attempt's
    assert seen_dl == [(1, A), (2, B), (3, A)]
    copy = await get_message(amqp, dlq_name(f"{qname}-dl"))
    assert copy is not None
    assert copy.headers[h.MODEL] == A
    assert [m.decode() if isinstance(m, bytes) else m for m in copy.headers[h.MODELS_TRIED]] == [
        A,
        B,
        A,
    ]


async def test_a_running_status_names_the_model_the_attempt_calls(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget: list[str],
) -> None:
    app = make_app(f"fallback-running-{qname}")
    forget.append(models_key(app.name))
    release = asyncio.Event()

    @app.handler(qname, fallback=Fallback([A, B]))
    async def answer(task: dict[str, str], ctx: Context) -> str:
        await release.wait()
        return ctx.model or ""

    await start_worker(app, concurrency=1)
    task_id = await app.publish(qname, {"prompt": "hi"})

    async def running_on_a() -> bool:
        state = await app.status(task_id)
        return state is not None and state.status is TaskStatus.RUNNING and state.model == A

    # The claim wrote "running" before the model was chosen; the record then names it.
    await wait_until(running_on_a, 10, "a running record naming the model")
    release.set()
    assert (await app.result(task_id, timeout_s=10)).model == A


async def test_a_per_model_limit_gives_each_model_of_the_chain_its_own_budget(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget: list[str],
) -> None:
    app = make_app(f"fallback-per-model-{qname}")
    forget.append(models_key(app.name))
    release = asyncio.Event()
    running: list[str] = []

    @app.handler(qname, fallback=Fallback([A, B]), limit=Limit(per_model=True, concurrency=1))
    async def answer(task: dict[str, str], ctx: Context) -> str:
        running.append(ctx.model or "")
        await release.wait()
        return ctx.model or ""

    await start_worker(app, concurrency=3)
    first = await app.publish(qname, {"prompt": "one"})
    await wait_until(lambda: running == [A], 10, "the first task running on A")
    await health_of(app.store, app.name).block(A, 60_000)  # A answered 429: B from now on
    second = await app.publish(qname, {"prompt": "two"})
    # A's one slot is taken, B's is not: the second task runs beside the first.
    await wait_until(lambda: running == [A, B], 10, "the second task running on B")
    third = await app.publish(qname, {"prompt": "three"})
    # B's slot is taken now: the third waits in the delay queues, it does not start.
    await wait_until(lambda: outcome_count(app, qname, "deferred") >= 1, 10, "a deferral")
    assert running == [A, B]
    release.set()
    finals = [await app.result(t, timeout_s=30) for t in (first, second, third)]
    assert [f.result for f in finals] == [A, B, B]


def test_a_per_model_limit_needs_a_model_to_count() -> None:
    from weclaw_mq import ConfigurationError, Settings

    app = App("per-model", settings=Settings(_env_file=None))  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="per_model limit"):

        @app.handler("q", limit=Limit(per_model=True, rate=1))
        async def answer(task: dict[str, str]) -> None: ...


async def test_an_outage_of_every_model_is_probed_by_one_task_and_dead_letters_none(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    redis_url: str,
    forget: list[str],
) -> None:
    # Issue 38 item 4: once a cool-down ended, every free slot sent a task to the model at
    # once, each spending an attempt, and a long outage dead-lettered many of them.
    fake, client = provider
    cool_down_s, concurrency, outage_s = 0.5, 10, 8.0
    app, seen = build(
        make_app,
        qname,
        client,
        redis_url,
        forget,
        fallback=Fallback([A, B], failures=2, cool_down_s=cool_down_s),
        retry=RetryPolicy(max_retries=2, delay_s=0.05, multiplier=1),
    )
    await start_worker(app, concurrency=concurrency)
    health = health_of(app.store, app.name)
    fake.down.update({A, B})
    ids = [await app.publish(qname, {"prompt": f"p{n}"}) for n in range(30)]

    async def both_down() -> bool:
        _, down = await health.down_until([A, B])
        return A in down and B in down

    await wait_until(both_down, 20, "both models taken down")
    loop = asyncio.get_running_loop()
    tripped_at, calls_at_trip = loop.time(), fake.calls
    await asyncio.sleep(outage_s)  # the outage lasts: this is the time under test
    failed_calls = fake.calls - calls_at_trip
    elapsed = loop.time() - tripped_at
    fake.down.clear()
    finals = [await app.result(t, timeout_s=60) for t in ids]

    assert [f.status for f in finals] == [TaskStatus.SUCCEEDED] * 30  # none dead-lettered
    # After the trip, one probe per model per cool-down (each fails fast), plus the attempts
    # that were already running when the second model went down.
    probes_bound = 2 * (elapsed / cool_down_s + 2) + concurrency
    assert failed_calls <= probes_bound, (failed_calls, probes_bound)
    probe_failures = app.metrics.registry.get_sample_value(
        "weclaw_mq_model_attempts_total", {"queue": qname, "model": A, "outcome": "probe_failed"}
    )
    assert probe_failures is not None and probe_failures >= 1
    # No task spent an attempt on a failed probe: at most one per model before it was parked.
    assert max(attempt for attempt, _ in seen) <= 3


async def test_a_handlers_own_timeout_does_not_count_as_the_models_failure(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget: list[str],
) -> None:
    app = make_app(f"fallback-timeout-{qname}")
    forget.append(models_key(app.name))
    seen: list[tuple[int, str]] = []

    @app.handler(
        qname,
        fallback=Fallback([A, B], failures=1, cool_down_s=60),
        retry=RetryPolicy(max_retries=1, delay_s=0.05),
        timeout_s=0.2,
    )
    async def answer(task: dict[str, str], ctx: Context) -> str:
        seen.append((ctx.attempt, ctx.model or ""))
        if ctx.attempt == 1:
            await asyncio.sleep(30)  # past the handler's own timeout
        return ctx.model or ""

    await start_worker(app, concurrency=1)
    task_id = await app.publish(qname, {"prompt": "slow"})
    assert (await app.result(task_id, timeout_s=20)).status is TaskStatus.SUCCEEDED
    _, down = await health_of(app.store, app.name).down_until([A, B])
    assert down == {}  # one failure would take A down for 60 s: the timeout did not count
    taken_down = app.metrics.registry.get_sample_value(
        "weclaw_mq_model_attempts_total", {"queue": qname, "model": A, "outcome": "taken_down"}
    )
    assert taken_down is None

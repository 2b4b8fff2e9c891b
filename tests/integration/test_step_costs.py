"""The cost ledger equals the provider's bill, kill -9 included (issue 40), on the real broker and
Redis against the local stand-in for a provider (``weclaw_mq.testing.fake_provider``), which
bills each task's tokens as it answers them.

A step's model calls are billed in the ledger as the step is recorded, so an agent whose worker
is SIGKILLed at its 19th call of 20 has its 18 recorded calls in the ledger already; the re-run
replays them (billed nothing) and calls the last two: the ledger is the provider's bill to the
token, and the bill stays within 5 % of a clean run's. A streamed generation killed at 90 %
continues from what its stream holds (``ctx.emitted()`` as the prefix), so its billed output
stays within 15 % of a clean run's. The ratios are printed (``-s``). A replayed step bills
nothing, and a plain ``def``'s ``step_sync`` is in the ledger before its attempt ends.

``measure_agent_kill`` and ``measure_stream_kill`` are shared with the drill
(tests/drills/test_step_costs_drill.py: longer generations, more runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import collect, delete_queues, forget_task_keys, settings_for, wait_until
from tests.integration.fixture_apps.bill_app import MODEL, PRICES, BillJob, build_app
from tests.integration.processes import WorkerProcess, queue_names, spawned_workers
from weclaw_mq import App, Context, Retry, TaskStatus
from weclaw_mq.contract.naming import costs_key, usage_key
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.testing.fake_provider import FakeProvider, ModelLimits, answer_tokens, serving

# The bounds the issue sets: what a kill may add to a clean run's bill.
AGENT_BILL_BOUND = 1.05
STREAM_OUTPUT_BOUND = 1.15
AGENT_CALLS = 20
KILLED_AT_CALL = 19
# The short generation: 200 tokens at 10 ms each, 2 s a run.
STREAM_TOKENS = 200
STREAM_TOKEN_S = 0.01
STREAM_KILLED_AT = 0.9


@dataclass
class Fleet:
    """The bill fixture app built here (to publish and read the ledger), the provider its
    workers call, and a starter of those workers in processes of their own."""

    app: App
    provider: FakeProvider
    start: Callable[[], WorkerProcess]
    queue: str
    ids: list[str]


@pytest.fixture
async def fleet(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> AsyncIterator[Fleet]:
    async with bill_fleet(broker_url, redis_url, qname, tmp_path) as made:
        yield made


@contextlib.asynccontextmanager
async def bill_fleet(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path, *, token_s: float = STREAM_TOKEN_S
) -> AsyncIterator[Fleet]:
    """A fleet on ``qname`` (its provider streams a token per ``token_s``); at the end its
    workers are killed by pid, and its queues, its tasks' keys and its App's totals of today
    deleted."""
    limits = ModelLimits(tokens=10**9, requests=10**6, window_s=60)
    provider = FakeProvider({MODEL: limits}, stream_token_s=token_s)
    # Short heartbeats: a killed worker's claim lapses in a second, not 30.
    settings = settings_for(broker_url, redis_url, guard_heartbeat_ttl_s=0.5)
    name = f"bill-{qname}"
    async with serving(provider) as url:
        app = build_app(name, qname, settings=settings, provider_url=url)
        await app.declare()
        env = {"BILL_APP_NAME": name, "BILL_APP_QUEUE": qname, "BILL_APP_PROVIDER": url}
        app_path = "tests.integration.fixture_apps.bill_app:app"
        ids: list[str] = []
        try:
            with spawned_workers(app_path, settings=settings, app_env=env, log_dir=tmp_path) as s:
                yield Fleet(app, provider, s, qname, ids)
        finally:
            await app.close()
            await delete_queues(broker_url, queue_names(app))
            await forget_task_keys(redis_url, [qname])
            client = aioredis.Redis.from_url(redis_url)
            day = datetime.now(UTC).date().isoformat()
            await client.delete(costs_key(name, day), *(usage_key(t) for t in ids))
            await client.aclose()


async def ledger_tokens(app: App, task_id: str) -> tuple[int, int, int]:
    """(input tokens, output tokens, calls) of the task in the App's cost ledger."""
    calls = await app.calls(task_id)
    return sum(c.input_tokens for c in calls), sum(c.output_tokens for c in calls), len(calls)


async def succeeded(app: App, task_id: str, timeout_s: float = 60) -> None:
    final = await app.result(task_id, timeout_s=timeout_s)
    assert final.status is TaskStatus.SUCCEEDED, final


@dataclass
class Measured:
    clean: int  # the clean run's billed tokens (all, or output only)
    killed: int  # the killed run's
    ratio: float


async def measure_agent_kill(fleet: Fleet, calls: int, killed_at: int) -> Measured:
    """A clean agent run, then one whose worker is SIGKILLed while its ``killed_at``-th call
    is at the provider; its re-run (another worker) finishes it. Asserts the ledger is the
    provider's bill for both; returns the bills' tokens."""
    app, provider = fleet.app, fleet.provider
    first = fleet.start()
    await first.wait_consuming()
    clean = await app.publish(fleet.queue, BillJob(calls=calls))
    fleet.ids.append(clean)
    await succeeded(app, clean)

    killed = str(uuid.uuid4())
    fleet.ids.append(killed)
    held = provider.hold(killed, killed_at)
    await app.publish(fleet.queue, BillJob(calls=calls), task_id=killed)
    await asyncio.wait_for(held.arrived.wait(), 30)
    first.kill()  # SIGKILL by pid, reaped: its call never got its answer
    assert first.popen.returncode == -9, first.describe()
    await asyncio.wait_for(held.dropped.wait(), 10)
    second = fleet.start()
    await second.wait_consuming()
    await succeeded(app, killed)

    for task_id in (clean, killed):
        billed = provider.billed_for(task_id)
        assert await ledger_tokens(app, task_id) == (
            billed.input_tokens,
            billed.output_tokens,
            billed.calls,
        ), f"the ledger of {task_id} is not the provider's bill {billed}"
    # Each call answered once: the re-run replayed the first killed_at - 1 and called the rest.
    assert provider.billed_for(killed).calls == calls
    assert len(await app.steps(killed)) == calls
    clean_tokens = provider.billed_for(clean).tokens
    killed_tokens = provider.billed_for(killed).tokens
    return Measured(clean_tokens, killed_tokens, killed_tokens / clean_tokens)


async def measure_stream_kill(fleet: Fleet, tokens: int, killed_at: float) -> Measured:
    """A clean streamed generation, then one whose worker is SIGKILLed once the provider sent
    ``killed_at`` of it; its re-run continues from the stream. Asserts the stream's readers
    got the whole answer once; returns the billed output tokens."""
    app, provider = fleet.app, fleet.provider
    # A generation's own time, twice, and some for the workers' starts.
    timeout_s = 30 + 2 * tokens * provider.stream_token_s
    first = fleet.start()
    await first.wait_consuming()
    clean = await app.publish(fleet.queue, BillJob(tokens=tokens))
    fleet.ids.append(clean)
    await succeeded(app, clean, timeout_s)

    killed = await app.publish(fleet.queue, BillJob(tokens=tokens))
    fleet.ids.append(killed)
    reader = asyncio.create_task(collect(app.stream(killed), timeout_s=2 * timeout_s))
    cut = int(tokens * killed_at)
    await wait_until(
        lambda: provider.billed_for(killed).output_tokens >= cut,
        timeout_s,
        f"{cut} tokens streamed",
    )
    first.kill()
    assert first.popen.returncode == -9, first.describe()
    second = fleet.start()
    await second.wait_consuming()
    await succeeded(app, killed, timeout_s)

    events = await reader
    chunks = [e.data for e in events if e.kind == "chunk"]
    assert chunks == answer_tokens(tokens)  # no gap, no duplicate
    final = await app.result(killed, timeout_s=5)
    assert final.result["continued_from"] > 0, final.result  # the re-run went on
    clean_out = provider.billed_for(clean).output_tokens
    killed_out = provider.billed_for(killed).output_tokens
    assert clean_out == tokens
    return Measured(clean_out, killed_out, killed_out / clean_out)


async def test_an_agent_killed_at_its_19th_call_is_billed_each_real_call_once(
    fleet: Fleet,
) -> None:
    measured = await measure_agent_kill(fleet, AGENT_CALLS, KILLED_AT_CALL)
    print(
        f"\nagent of {AGENT_CALLS} calls, kill -9 at call {KILLED_AT_CALL}: billed "
        f"{measured.killed} tokens vs {measured.clean} clean = {measured.ratio:.3f}x "
        f"(bound {AGENT_BILL_BOUND}x); ledger == bill"
    )
    assert measured.ratio <= AGENT_BILL_BOUND


async def test_a_stream_killed_at_90_percent_continues_and_bills_little_more_output(
    fleet: Fleet,
) -> None:
    measured = await measure_stream_kill(fleet, STREAM_TOKENS, STREAM_KILLED_AT)
    print(
        f"\nstream of {STREAM_TOKENS} tokens, kill -9 at {STREAM_KILLED_AT:.0%}: billed output "
        f"{measured.killed} vs {measured.clean} clean = {measured.ratio:.3f}x "
        f"(bound {STREAM_OUTPUT_BOUND}x)"
    )
    assert measured.ratio <= STREAM_OUTPUT_BOUND


# -- a replayed step costs nothing (a worker in this process) ---------------------------------

FAST_RETRY = RetryPolicy(max_retries=3, delay_s=0.05, max_delay_s=0.05)


async def test_a_replayed_step_costs_nothing_and_a_call_outside_steps_is_billed_per_attempt(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    redis_url: str,
    redis_client: aioredis.Redis,
) -> None:
    app = make_app(f"bill-{qname}")
    app.prices = dict(PRICES)

    def call_model(prompt: str, ctx: Context) -> str:
        ctx.usage(input_tokens=len(prompt), output_tokens=3, model=MODEL)
        return prompt.upper()

    @app.handler(qname, retry=FAST_RETRY)
    async def agent(task: dict[str, str], ctx: Context) -> list[str]:
        answers = [await ctx.step("call", call_model, p, ctx) for p in ("ab", "cde")]
        ctx.usage(input_tokens=7, output_tokens=1, model=MODEL)  # outside any step
        if ctx.attempt == 1:
            raise Retry("the first attempt fails after its steps", after_s=0.05)
        return answers

    await start_worker(app)
    task_id = await app.publish(qname, {})
    day = datetime.now(UTC).date().isoformat()
    try:
        final = await app.result(task_id, timeout_s=20)
        assert final.status is TaskStatus.SUCCEEDED, final

        calls = [(c.attempt, c.input_tokens, c.output_tokens) for c in await app.calls(task_id)]
        # The steps' calls once, from attempt 1 (the replay in attempt 2 billed nothing), and
        # the call outside them once per attempt.
        assert sorted(calls) == [(1, 2, 3), (1, 3, 3), (1, 7, 1), (2, 7, 1)]
        totals = await redis_client.hgetall(costs_key(app.name, day))
        price = PRICES[MODEL]
        expected = sum(round(price.of(i, o) * 1_000_000) for _, i, o in calls)
        assert int(totals[f"model:{MODEL}:cost".encode()]) == expected
        # Two attempts ended with calls: two runs of the queue, not one per step.
        assert int(totals[f"queue:{qname}:runs".encode()]) == 2
    finally:
        await redis_client.delete(costs_key(app.name, day), usage_key(task_id))
        await forget_task_keys(redis_url, [qname])


async def test_a_plain_def_handlers_step_is_billed_once_across_a_retry(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    redis_url: str,
    redis_client: aioredis.Redis,
) -> None:
    app = make_app(f"bill-{qname}")
    app.prices = dict(PRICES)

    def call_model(ctx: Context) -> str:
        ctx.usage(input_tokens=11, output_tokens=4, model=MODEL)
        return "answer"

    seen: list[int] = []

    @app.handler(qname, retry=FAST_RETRY)
    def agent(task: dict[str, str], ctx: Context) -> str:
        answer: str = ctx.step_sync("call", call_model, ctx)  # billed from the worker's loop
        assert ctx.loop is not None
        # In the ledger already, before the attempt ends.
        billed = asyncio.run_coroutine_threadsafe(app.calls(ctx.task_id), ctx.loop).result()
        seen.append(len(billed))
        if ctx.attempt == 1:
            raise Retry("the retry replays the step", after_s=0.05)
        return answer

    await start_worker(app)
    task_id = await app.publish(qname, {})
    day = datetime.now(UTC).date().isoformat()
    try:
        final = await app.result(task_id, timeout_s=20)
        assert final.status is TaskStatus.SUCCEEDED, final
        calls = [(c.attempt, c.input_tokens, c.output_tokens) for c in await app.calls(task_id)]
        assert calls == [(1, 11, 4)]
        assert seen == [1, 1]
    finally:
        await redis_client.delete(costs_key(app.name, day), usage_key(task_id))
        await forget_task_keys(redis_url, [qname])

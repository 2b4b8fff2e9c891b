"""Costs per task and per tenant on the real broker and Redis (issue 31 item 3), against the
local stand-in for a provider (``weclaw_mq.testing.fake_provider``): the costs per tenant sum
exactly to the provider's own bill, retries included; a tenant at its daily cap is shed,
parked or downgraded as its ``Cap`` says, losing nothing; ``weclaw-mq costs`` prints them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import httpx
import pytest
import redis.asyncio as aioredis
from aio_pika.abc import AbstractIncomingMessage

from tests.conftest import outcome_count, wait_until
from tests.integration.processes import run_cli, settings_env
from weclaw_mq import App, Context, RetryPolicy, TaskStatus
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import CAP_KEY_PREFIX, MIDNIGHT_QUEUE, costs_key, usage_key
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability.metrics import UNPRICED_MODEL
from weclaw_mq.policy.costs import Cap, Price
from weclaw_mq.state.cost_ledger import MICROS
from weclaw_mq.testing.fake_provider import FakeProvider, ModelLimits, serving

BIG, SMALL = "big-1", "small-1"
PRICES = {
    BIG: Price(input_per_1k=0.5, output_per_1k=1.5),
    SMALL: Price(input_per_1k=0.05, output_per_1k=0.15),
}
ONCE = RetryPolicy(max_retries=1, delay_s=0.05, multiplier=1)


@pytest.fixture
async def provider() -> AsyncIterator[tuple[FakeProvider, httpx.AsyncClient]]:
    limits = ModelLimits(tokens=10**9, requests=10**6, window_s=60)
    fake = FakeProvider({BIG: limits, SMALL: limits})
    async with serving(fake) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        yield fake, client


async def take_from_midnight(broker_url: str, ids: list[str]) -> list[AbstractIncomingMessage]:
    """Take the tasks ``ids`` out of the vhost's midnight queue, leaving every other message
    there (the queue is shared): a test's parked task must not come back at midnight."""
    taken: list[AbstractIncomingMessage] = []
    conn = await aio_pika.connect(broker_url)
    try:
        channel = await conn.channel()
        try:
            queue = await channel.declare_queue(MIDNIGHT_QUEUE, passive=True)
        except aio_pika.exceptions.ChannelClosed:  # no handler parks at midnight: none declared
            return taken
        # Held unacked until the connection closes, so each message is read once.
        for _ in range(queue.declaration_result.message_count):
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            if message.message_id in ids:
                await message.ack()
                taken.append(message)
    finally:
        await conn.close()  # what was not ours goes back to the queue
    return taken


@pytest.fixture
async def forget(redis_url: str, broker_url: str) -> AsyncIterator[list[tuple[str, list[str]]]]:
    """(app name, task ids) to forget: the app's totals of today, the tasks' calls, and any of
    them still parked until midnight."""
    apps: list[tuple[str, list[str]]] = []
    yield apps
    await take_from_midnight(broker_url, [t for _, ids in apps for t in ids])
    client = aioredis.from_url(redis_url)
    day = datetime.now(UTC).date().isoformat()
    for name, ids in apps:
        await client.delete(costs_key(name, day), *(usage_key(t) for t in ids))
        # The tenants' reservations against their caps.
        async for key in client.scan_iter(
            match=f"{CAP_KEY_PREFIX}:{len(name)}:{name}:*", count=1000
        ):
            await client.delete(key)
    await client.aclose()


def build(
    make_app: Callable[..., App],
    qname: str,
    client: httpx.AsyncClient,
    *,
    cap: Cap | None = None,
    fail_first: bool = False,
) -> App:
    app = make_app(f"costs-{qname}")
    app.prices = dict(PRICES)

    @app.handler(qname, tenant=lambda t: t["tenant"], cap=cap, retry=ONCE)
    async def complete(task: dict[str, Any], ctx: Context) -> str:
        model = ctx.model or task["model"]
        body = {
            "model": model,
            "prompt": task["prompt"],
            "max_tokens": 20,
            "tenant": task["tenant"],
        }
        response = await client.post("/v1/complete", json=body)
        usage = response.json()["usage"]
        ctx.usage(
            input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"], model=model
        )
        if fail_first and ctx.attempt == 1:
            raise RuntimeError("the answer did not parse")  # paid for, then retried
        return model

    return app


async def test_costs_per_tenant_sum_exactly_to_the_providers_bill_retries_included(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    forget: list[tuple[str, list[str]]],
) -> None:
    fake, client = provider
    app = build(make_app, qname, client, fail_first=True)
    await start_worker(app, concurrency=4)
    tasks = [
        {"tenant": tenant, "model": model, "prompt": "z" * size}
        for tenant, model, size in [
            ("acme", BIG, 400),
            ("acme", SMALL, 40),
            ("globex", BIG, 120),
            ("globex", BIG, 4000),
            ("initech", SMALL, 8),
        ]
    ]
    ids = await app.publish_many(qname, tasks)
    forget.append((app.name, ids))
    finals = [await app.result(t, timeout_s=30) for t in ids]
    assert [f.status for f in finals] == [TaskStatus.SUCCEEDED] * 5

    by_tenant = {t.name: t for t in await app.costs(by="tenant")}
    for tenant in ("acme", "globex", "initech"):
        billed = sum(n for (_, who), n in fake.bill.items() if who == tenant)
        ours = by_tenant[tenant]
        assert ours.input_tokens + ours.output_tokens == billed, tenant
    by_model = {t.name: t for t in await app.costs(by="model")}
    for model, price in PRICES.items():
        billed_calls = [c for t in ids for c in await app.calls(t) if c.model == model]
        expected = sum(
            round(price.of(c.input_tokens, c.output_tokens) * MICROS) for c in billed_calls
        )
        assert by_model[model].cost_micros == expected
    calls = await app.calls(ids[0])
    assert [c.attempt for c in calls] == [1, 2]  # the failed attempt's call is on the bill too
    assert sum(by_tenant[t].cost_micros for t in by_tenant) == sum(
        m.cost_micros for m in by_model.values()
    )


@pytest.mark.parametrize("action", ["shed", "park", "downgrade"])
async def test_a_tenant_at_its_cap_is_shed_parked_or_downgraded_and_others_go_on(
    action: str,
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    forget: list[tuple[str, list[str]]],
) -> None:
    fake, client = provider
    # One big call costs more than the cap: the tenant's next tasks are over it.
    cap = Cap(per_day=0.001, action=action, model=SMALL if action == "downgrade" else None)  # type: ignore[arg-type]
    app = build(make_app, qname, client, cap=cap)
    await start_worker(app, concurrency=1)
    first = await app.publish(qname, {"tenant": "acme", "model": BIG, "prompt": "a" * 400})
    forget.append((app.name, [first]))
    assert (await app.result(first, timeout_s=30)).result == BIG
    later = await app.publish(qname, {"tenant": "acme", "model": BIG, "prompt": "b" * 40})
    other = await app.publish(qname, {"tenant": "globex", "model": BIG, "prompt": "c" * 40})
    forget[-1][1].extend([later, other])
    assert (await app.result(other, timeout_s=30)).result == BIG  # not capped
    calls_before = fake.calls

    if action == "shed":
        final = await app.result(later, timeout_s=30)
        assert (final.status, final.reason) == (TaskStatus.DEAD_LETTERED, "budget_exceeded")
        assert final.error is not None and "spent" in final.error
    elif action == "downgrade":
        final = await app.result(later, timeout_s=30)
        assert (final.status, final.result) == (TaskStatus.SUCCEEDED, SMALL)
    else:  # parked until the next UTC day: still queued, in a delay queue, never run
        await wait_until(
            lambda: outcome_count(app, qname, "deferred") >= 1, 20, "the parked task deferred"
        )
        status = await app.status(later)
        assert status is not None and status.status is TaskStatus.QUEUED
        # It says why it waits and until when: the next UTC day.
        assert status.deferred is not None and status.deferred.by == "cap", status
        assert "reached its cap" in status.deferred.why
        assert status.deferred.next_try_at is not None
        assert status.deferred.next_try_at.date() > status.updated_at.date()
        assert fake.calls == calls_before  # the parked task did not call the model
    capped = app.metrics.registry.get_sample_value(
        "weclaw_mq_capped_tasks_total", {"queue": qname, "action": action}
    )
    assert capped == 1


async def test_the_costs_command_prints_the_tenants_and_a_tasks_calls(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    forget: list[tuple[str, list[str]]],
    tmp_path: Any,
) -> None:
    _, client = provider
    app = build(make_app, qname, client)
    await start_worker(app)
    task_id = await app.publish(qname, {"tenant": "acme", "model": BIG, "prompt": "d" * 400})
    forget.append((app.name, [task_id]))
    await app.result(task_id, timeout_s=30)
    module = tmp_path / "costs_app.py"
    module.write_text(
        "from weclaw_mq import App\n"
        "from weclaw_mq.policy.costs import Price\n"
        f"app = App({app.name!r}, prices={{'big-1': Price(0.5, 1.5)}})\n"
    )
    env = {**settings_env(app.settings), "PYTHONPATH": str(tmp_path)}
    listed = await run_cli("costs", "costs_app:app", "--json", env=env)
    assert listed.code == 0, listed.stderr
    (acme,) = json.loads(listed.stdout)
    assert acme["name"] == "acme" and acme["input_tokens"] == 100 and acme["output_tokens"] == 20
    assert acme["cost"] == pytest.approx((100 * 0.5 + 20 * 1.5) / 1000)
    table = await run_cli("costs", "costs_app:app", "--task", task_id, env=env)
    assert table.code == 0 and "big-1" in table.stdout and "acme" in table.stdout
    bad = await run_cli("costs", "costs_app:app", "--by", "user", env=env)
    assert bad.code == 2 and "'user' is not tenant or model" in bad.stderr


@pytest.mark.parametrize(("task_id", "says"), [("", "task id is empty"), ("a\nb", "control")])
async def test_the_calls_of_a_task_id_no_task_can_have_are_refused_not_answered_empty(
    make_app: Callable[..., App], task_id: str, says: str
) -> None:
    # As cancel and result refuse it: an empty list would read as "this task cost nothing".
    with pytest.raises(ConfigurationError, match=says):
        await make_app().calls(task_id)


async def test_models_without_a_price_share_one_metrics_label_and_keep_their_names_in_the_ledger(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget: list[tuple[str, list[str]]],
) -> None:
    # Model names are handlers' strings: a label per name would grow the metrics without end.
    app = make_app(f"costs-{qname}")
    app.prices = dict(PRICES)

    @app.handler(qname)
    async def complete(task: dict[str, str], ctx: Context) -> None:
        ctx.usage(input_tokens=10, output_tokens=1, model=task["model"])

    await start_worker(app)
    made_up = [f"user-model-{n}" for n in range(20)]
    ids = [await app.publish(qname, {"model": m}) for m in [BIG, *made_up]]
    forget.append((app.name, ids))
    for task_id in ids:
        assert (await app.result(task_id, timeout_s=30)).status is TaskStatus.SUCCEEDED

    def tokens_by_model() -> dict[str, float]:
        family = next(
            f for f in app.metrics.registry.collect() if f.name == "weclaw_mq_model_tokens"
        )
        return {
            s.labels["model"]: s.value
            for s in family.samples
            if s.name.endswith("_total")
            and s.labels["queue"] == qname
            and s.labels["kind"] == "input"
        }

    assert tokens_by_model() == {BIG: 10, UNPRICED_MODEL: 10 * len(made_up)}
    assert {c.model for c in await app.calls(ids[-1])} == {made_up[-1]}  # named where it is kept


async def test_a_cap_at_concurrency_10_ends_within_one_runs_cost_of_it(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    forget: list[tuple[str, list[str]]],
) -> None:
    # Issue 38 item 5: the cap was check-then-run, so ten tasks started at once past it (a
    # cap of 2.0 ended at 10.0). Each run now reserves its estimate (here the day's mean run,
    # learned from the first) before it starts and settles to its real cost when it ends.
    _, client = provider
    app = make_app(f"costs-cap10-{qname}")
    run_cost = 0.25  # 100 prompt tokens at 2.0 per 1k + 20 answer tokens at 2.5 per 1k
    app.prices = {BIG: Price(input_per_1k=2.0, output_per_1k=2.5)}

    @app.handler(qname, tenant=lambda t: t["tenant"], cap=Cap(per_day=2.0, action="shed"))
    async def complete(task: dict[str, Any], ctx: Context) -> str:
        body = {"model": BIG, "prompt": "a" * 400, "max_tokens": 20, "tenant": "acme"}
        usage = (await client.post("/v1/complete", json=body)).json()["usage"]
        await asyncio.sleep(0.2)  # a model call takes a while: the runs overlap
        ctx.usage(
            input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"], model=BIG
        )
        return BIG

    await start_worker(app, concurrency=10)
    ids = [await app.publish(qname, {"tenant": "acme"}) for _ in range(20)]
    forget.append((app.name, ids))
    finals = [await app.result(t, timeout_s=60) for t in ids]

    spent = sum(t.cost for t in await app.costs(days=1, by="tenant"))
    assert spent <= 2.0 + run_cost + 1e-9, spent  # the cap, plus at most one run's error
    ran = [f for f in finals if f.status is TaskStatus.SUCCEEDED]
    shed = [f for f in finals if f.reason == "budget_exceeded"]
    assert len(ran) + len(shed) == 20
    assert len(ran) >= 7  # the cap was used, not left idle


async def test_a_task_parked_until_midnight_takes_one_move_into_the_midnight_queue(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    provider: tuple[FakeProvider, httpx.AsyncClient],
    forget: list[tuple[str, list[str]]],
    broker_url: str,
) -> None:
    # Issue 38 item 5: a task parked until the next UTC day hopped through the delay ladder
    # (1,024 s at most per hop: ~84 moves a day). It now waits in one place, expiring then.
    _, client = provider
    app = build(make_app, qname, client, cap=Cap(per_day=0.001, action="park"))
    await start_worker(app, concurrency=1)
    first = await app.publish(qname, {"tenant": "acme", "model": BIG, "prompt": "a" * 400})
    forget.append((app.name, [first]))
    assert (await app.result(first, timeout_s=30)).result == BIG
    parked = await app.publish(qname, {"tenant": "acme", "model": BIG, "prompt": "b"})
    forget[-1][1].append(parked)
    now = datetime.now(UTC)
    midnight = datetime.combine(now.date(), datetime.min.time(), UTC) + timedelta(days=1)

    async def parked_until_midnight() -> bool:
        # Its record says where it waits (a first deferral may be a 1 s wait for a reservation
        # that the first run had not settled yet).
        state = await app.status(parked)
        due = None if state is None or state.deferred is None else state.deferred.next_try_at
        return due is not None and due >= midnight - timedelta(seconds=1)

    await wait_until(parked_until_midnight, 30, "the park until midnight")
    taken: list[AbstractIncomingMessage] = []

    async def moved() -> bool:  # the record is written as the move is made, not after it
        taken.extend(await take_from_midnight(broker_url, [parked]))
        return bool(taken)

    await wait_until(moved, 30, "the parked task in the midnight queue")
    moves = outcome_count(app, qname, "deferred")
    found = taken[0]
    assert found.expiration is not None
    left_s = (midnight - now).total_seconds()
    assert left_s - 60 <= float(found.expiration) <= left_s + 1  # expires at midnight
    assert found.headers[h.NOT_BEFORE] == int(midnight.timestamp() * 1000)
    assert outcome_count(app, qname, "deferred") == moves  # one move, no hop since

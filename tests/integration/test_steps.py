"""Memoized steps (``ctx.step``) and continued streams (``ctx.emitted``) on the real broker and
Redis: a step's function runs once per task across a Retry and across a worker killed with
SIGKILL; a step that raised runs again; a result over the bound or not JSON records nothing;
plain-def handlers step too; the records expire with the task's record; ``App.steps`` and
``weclaw-mq status`` show them; a re-run that continues its stream leaves readers no gap and
no duplicate."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import collect, delete_queues, forget_task_keys, settings_for, wait_until
from tests.integration.fixture_apps.steps_app import StepsJob, build_app, read_calls
from tests.integration.processes import (
    queue_names,
    run_cli,
    settings_env,
    spawned_workers,
)
from tests.private_servers import PrivateRedisCluster
from weclaw_mq import App, Context, Retry, TaskStatus
from weclaw_mq.contract.naming import state_key, steps_key
from weclaw_mq.errors import StepError
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.state import Claim, TaskState
from weclaw_mq.state.redis_clients import open_client
from weclaw_mq.state.steps import StepMemo, made

FAST_RETRY = RetryPolicy(max_retries=3, delay_s=0.05, max_delay_s=0.05)


async def test_a_step_runs_once_across_a_retry_and_the_retry_replays_its_result(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    calls: list[str] = []
    keys: list[str] = []

    async def fetch(url: str) -> dict[str, Any]:
        calls.append(f"fetch {url}")
        return {"url": url, "words": (1, 2)}  # a tuple: JSON makes it a list, both times

    def call_model(prompt: str, ctx: Context) -> str:
        calls.append(f"call {prompt}")
        keys.append(ctx.step_key)
        ctx.usage(input_tokens=len(prompt), output_tokens=3, model="m-1")
        return prompt.upper()

    @app.handler(qname, retry=FAST_RETRY)
    async def agent(task: dict[str, str], ctx: Context) -> dict[str, Any]:
        page = await ctx.step("fetch", fetch, task["url"])
        first = await ctx.step("call", call_model, "a", ctx)
        second = await ctx.step("call", call_model, "b", ctx)
        if ctx.attempt == 1:
            raise Retry("the first attempt fails after its steps", after_s=0.05)
        return {"page": page, "answers": [first, second], "attempt": ctx.attempt}

    await start_worker(app)
    task_id = await app.publish(qname, {"url": "u1"})
    final = await app.result(task_id, timeout_s=20)

    assert final.status is TaskStatus.SUCCEEDED, final
    assert final.result == {
        "page": {"url": "u1", "words": [1, 2]},
        "answers": ["A", "B"],
        "attempt": 2,
    }
    assert calls == ["fetch u1", "call a", "call b"]  # each once, across two attempts
    assert keys == [f"{task_id}:{qname}:call:1", f"{task_id}:{qname}:call:2"]
    steps = await app.steps(task_id)
    assert [(s.name, s.occurrence, s.attempt) for s in steps] == [
        ("fetch", 1, 1),
        ("call", 1, 1),
        ("call", 2, 1),
    ]
    assert steps[0].result == {"url": "u1", "words": [1, 2]} and steps[0].usage == ()
    assert [s.usage for s in steps[1:]] == [(("m-1", 1, 3),), (("m-1", 1, 3),)]
    assert all(s.duration_s >= 0 for s in steps)
    assert await app.steps(task_id, queue=qname) == steps


async def test_a_step_that_raised_is_not_recorded_and_runs_again(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(len(calls))
        if len(calls) == 1:
            raise ConnectionError("the provider hung up")
        return "ok"

    @app.handler(qname, retry=FAST_RETRY)
    async def agent(task: dict[str, str], ctx: Context) -> str:
        result: str = await ctx.step("flaky", flaky)
        return result

    await start_worker(app)
    task_id = await app.publish(qname, {})
    final = await app.result(task_id, timeout_s=20)

    assert (final.status, final.result, final.attempt) == (TaskStatus.SUCCEEDED, "ok", 2)
    assert calls == [0, 1]
    (step,) = await app.steps(task_id)
    assert (step.name, step.attempt, step.result) == ("flaky", 2, "ok")


async def test_a_result_over_the_bound_or_not_json_raises_step_error_and_records_nothing(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app(step_max_bytes=64)
    seen: list[str] = []

    @app.handler(qname)
    async def agent(task: dict[str, str], ctx: Context) -> list[str]:
        for name, value in (("big", "x" * 100), ("an object", object()), ("nan", float("nan"))):
            try:
                await ctx.step(name, lambda v=value: v)
            except StepError as e:
                seen.append(str(e))
        # The failed steps lost nothing else: the next one records as ever.
        small: str = await ctx.step("small", lambda: "x" * 62)  # 64 bytes as JSON
        return [small]

    await start_worker(app)
    task_id = await app.publish(qname, {})
    final = await app.result(task_id, timeout_s=20)

    assert final.status is TaskStatus.SUCCEEDED and final.result == ["x" * 62]
    assert len(seen) == 3
    assert "102 bytes of JSON, over the limit of 64 (WECLAW_MQ_STEP_MAX_BYTES)" in seen[0]
    assert all("is not JSON" in message for message in seen[1:])
    assert [s.name for s in await app.steps(task_id)] == ["small"]


async def test_steps_do_not_nest_and_step_key_is_read_inside_a_step_only(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()

    @app.handler(qname)
    async def agent(task: dict[str, str], ctx: Context) -> list[str]:
        said = []
        try:
            _ = ctx.step_key
        except RuntimeError as e:
            said.append(str(e))

        async def outer() -> str:
            try:
                await ctx.step("inner", lambda: 1)
            except StepError as e:
                said.append(str(e))
            return "outer"

        said.append(await ctx.step("outer", outer))
        return said

    await start_worker(app)
    task_id = await app.publish(qname, {})
    final = await app.result(task_id, timeout_s=20)

    assert final.status is TaskStatus.SUCCEEDED, final
    off, nested, outer = final.result
    assert "inside a step's function" in off and "steps do not nest" in nested
    assert outer == "outer"
    assert [s.name for s in await app.steps(task_id)] == ["outer"]


async def test_a_plain_def_handler_steps_with_step_sync_once_across_a_retry(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    calls: list[str] = []

    def summarise(text: str, ctx: Context) -> dict[str, str]:
        calls.append(ctx.step_key)
        ctx.usage(input_tokens=7, output_tokens=2)
        return {"summary": text[:3]}

    @app.handler(qname, retry=FAST_RETRY)
    def work(task: dict[str, str], ctx: Context) -> dict[str, Any]:
        done = ctx.step_sync("summarise", summarise, task["text"], ctx)
        if ctx.attempt == 1:
            raise Retry("again", after_s=0.05)
        return {"done": done, "attempt": ctx.attempt}

    await start_worker(app)
    task_id = await app.publish(qname, {"text": "hello"})
    final = await app.result(task_id, timeout_s=20)

    assert final.status is TaskStatus.SUCCEEDED, final
    assert final.result == {"done": {"summary": "hel"}, "attempt": 2}
    assert calls == [f"{task_id}:{qname}:summarise:1"]
    (step,) = await app.steps(task_id)
    assert step.usage == (("-", 7, 2),) and step.attempt == 1


async def test_step_records_expire_with_the_task_record(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    redis_client: aioredis.Redis,
) -> None:
    app = make_app(result_ttl_s=3)

    @app.handler(qname)
    async def agent(task: dict[str, str], ctx: Context) -> int:
        value: int = await ctx.step("one", lambda: 1)
        return value

    await start_worker(app)
    task_id = await app.publish(qname, {})
    assert (await app.result(task_id, timeout_s=20)).status is TaskStatus.SUCCEEDED

    record, steps = state_key(qname, task_id), steps_key(qname, task_id)
    # The final record's write renewed the steps' TTL: both lapse at the same moment.
    ttls = await asyncio.gather(redis_client.pttl(record), redis_client.pttl(steps))
    assert 0 < ttls[0] <= 3000 and abs(ttls[0] - ttls[1]) < 200, ttls
    await wait_until(
        lambda: _both_gone(redis_client, record, steps), 10, "the record and steps to go"
    )
    assert await app.steps(task_id, queue=qname) == []


async def _both_gone(client: aioredis.Redis, *keys: str) -> bool:
    return int(await client.exists(*keys)) == 0


async def test_a_rerun_that_continues_its_stream_leaves_readers_no_gap_and_no_duplicate(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    words = [f"w{i} " for i in range(10)]
    resumed_from: list[int] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def generate(task: dict[str, str], ctx: Context) -> str:
        before = await ctx.emitted()
        resumed_from.append(len(before))
        for word in words[len(before) :]:
            if ctx.attempt == 1 and word == "w6 ":
                raise Retry("the model call broke off at 60 %", after_s=0.05)
            await ctx.emit(word)
        return "".join([*before, *words[len(before) :]])

    await start_worker(app)
    task_id = await app.publish(qname, {})
    events = await collect(app.stream(task_id))

    assert resumed_from == [0, 6]
    kinds = [e.kind for e in events]
    assert kinds == ["attempt", *["chunk"] * 10, "final"], kinds  # one marker: no restart
    assert [e.data for e in events if e.kind == "chunk"] == words
    assert [e.attempt for e in events if e.kind == "chunk"] == [1] * 6 + [2] * 4
    assert events[-1].status == "succeeded" and events[-1].result == "".join(words)


# -- a worker killed with SIGKILL (a process of its own) --------------------------------------


@pytest.fixture
async def steps_fleet(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> AsyncIterator[tuple[App, Callable[..., Any]]]:
    """The steps fixture app built here (to publish and read) and a starter of its workers in
    processes of their own (killed by pid at teardown, then the queues and keys go)."""
    settings = settings_for(broker_url, redis_url, guard_heartbeat_ttl_s=0.5)
    app = build_app(qname, settings=settings, record_dir=tmp_path)
    await app.declare()
    env = {"TEST_QUEUE": qname, "TEST_RECORD_DIR": str(tmp_path)}
    app_path = "tests.integration.fixture_apps.steps_app:app"
    try:
        with spawned_workers(app_path, settings=settings, app_env=env, log_dir=tmp_path) as start:
            yield app, start
    finally:
        await app.close()
        await delete_queues(broker_url, queue_names(app))
        await forget_task_keys(redis_url, [qname])


async def test_a_step_runs_once_across_a_worker_killed_after_it(
    steps_fleet: tuple[App, Callable[..., Any]], tmp_path: Path
) -> None:
    app, start = steps_fleet
    first = start()
    await first.wait_consuming()
    task_id = await app.publish(app_queue(app), StepsJob(kill_after="fetch"))

    # The handler SIGKILLs its own process once its first step is recorded.
    assert await first.wait_exit(30) == -9, first.describe()
    second = start()
    await second.wait_consuming()
    final = await app.result(task_id, timeout_s=30)

    assert final.status is TaskStatus.SUCCEEDED, (final, second.describe())
    assert final.result == {"fetch": "fetched", "call": "called", "attempt": final.attempt}
    assert read_calls(tmp_path) == ["fetch", "call"]  # fetch once, though two runs began
    steps = await app.steps(task_id)
    assert [s.name for s in steps] == ["fetch", "call"]
    assert steps[0].usage == (("m-1", 5, 1),)


async def test_a_stream_continued_after_a_worker_killed_mid_reply_has_no_gap_nor_duplicate(
    steps_fleet: tuple[App, Callable[..., Any]], tmp_path: Path
) -> None:
    app, start = steps_fleet
    first = start()
    await first.wait_consuming()
    task_id = await app.publish(app_queue(app), StepsJob(words=20, kill_at_word=18))
    reader = asyncio.create_task(collect(app.stream(task_id), timeout_s=60))

    assert await first.wait_exit(30) == -9, first.describe()
    second = start()
    await second.wait_consuming()
    events = await reader

    chunks = [e.data for e in events if e.kind == "chunk"]
    expected = [f"w{i} " for i in range(20)]
    assert [e.kind for e in events].count("attempt") == 1, events  # the re-run went on
    assert chunks == expected, chunks
    assert events[-1].kind == "final" and events[-1].result == "".join(expected)
    # The re-run read what was written before the kill, and generated only the rest.
    (continued,) = [int(c.split()[1]) for c in read_calls(tmp_path) if c.startswith("resume")]
    assert 0 < continued <= 18


def app_queue(app: App) -> str:
    (queue,) = app.handlers
    return queue


async def test_status_prints_the_steps_and_a_task_without_steps_as_before(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    broker_url: str,
    redis_url: str,
) -> None:
    app = make_app()

    @app.handler(qname)
    async def agent(task: dict[str, bool], ctx: Context) -> str:
        if task["steps"]:

            def call() -> str:
                ctx.usage(input_tokens=4, output_tokens=6, model="m-2")
                return "hi"

            await ctx.step("call", call)
        return "done"

    await start_worker(app)
    with_steps, without = await app.publish_many(qname, [{"steps": True}, {"steps": False}])
    for task_id in (with_steps, without):
        assert (await app.result(task_id, timeout_s=20)).status is TaskStatus.SUCCEEDED
    env = settings_env(settings_for(broker_url, redis_url))

    shown = await run_cli("status", with_steps, env=env)
    plain = await run_cli("status", without, env=env)

    assert shown.code == 0, shown.stderr
    (step,) = json.loads(shown.stdout)["steps"]
    assert step | {"at": None, "duration_s": None} == {
        "name": "call",
        "occurrence": 1,
        "attempt": 1,
        "at": None,
        "duration_s": None,
        "usage": [{"model": "m-2", "input_tokens": 4, "output_tokens": 6}],
        "result": "hi",
    }
    assert plain.code == 0 and "steps" not in json.loads(plain.stdout)
    state = await app.status(without)
    assert state is not None and plain.stdout.strip() == state.model_dump_json(indent=2)


async def test_inspect_steps_lists_a_running_tasks_steps_so_far(
    steps_fleet: tuple[App, Callable[..., Any]],
    start_worker: Callable[..., Any],
    tmp_path: Path,
    broker_url: str,
    redis_url: str,
) -> None:
    app, _ = steps_fleet
    queue = app_queue(app)
    release = asyncio.Event()
    settings = settings_for(broker_url, redis_url, worker_beat_s=0.1)
    worker_app = build_app(queue, settings=settings, record_dir=tmp_path, release=release)
    await start_worker(worker_app)
    task_id = await app.publish(queue, StepsJob(hold_after="fetch"))
    env = {
        **settings_env(settings_for(broker_url, redis_url)),
        "TEST_QUEUE": queue,
        "TEST_RECORD_DIR": str(tmp_path),
    }
    path = "tests.integration.fixture_apps.steps_app:app"
    shown: list[dict[str, Any]] = []

    async def listed() -> bool:
        result = await run_cli("inspect", path, "--steps", "--json", env=env)
        assert result.code == 0, result.stderr
        tasks = [t for w in json.loads(result.stdout)["workers"] for t in w["tasks"]]
        shown[:] = [t for t in tasks if t["task_id"] == task_id and t["steps"]]
        return bool(shown)

    try:
        await wait_until(listed, 30, "inspect to list the running task's step")
        (task,) = shown
        (step,) = task["steps"]
        assert (step["name"], step["occurrence"], step["attempt"]) == ("fetch", 1, 1)
        assert step["usage"] == [{"model": "m-1", "input_tokens": 5, "output_tokens": 1}]
        text = await run_cli("inspect", path, "--steps", env=env)
        assert f"  steps of {task_id}: fetch " in text.stdout, text.stdout
        assert "m-1 5+1 tokens" in text.stdout
    finally:
        release.set()
    assert (await app.result(task_id, timeout_s=20)).status is TaskStatus.SUCCEEDED
    await worker_app.close()


async def test_steps_on_a_redis_cluster_live_in_their_tasks_slot_and_expire_with_the_record(
    redis_cluster: PrivateRedisCluster,
) -> None:
    from tests.integration.test_redis_cluster import QUEUE, _ids_on_every_node, _store

    store = _store(redis_cluster.url)
    client = open_client(settings_for("amqp://unused", redis_cluster.url))
    try:
        book = store.step_book()
        ids = _ids_on_every_node(redis_cluster, per_node=1)
        for task_id in ids:  # the record's script renews the steps' TTL on the task's node
            running = TaskState(task_id=task_id, queue=QUEUE, status=TaskStatus.RUNNING)
            assert await store.claim(QUEUE, task_id, "me", running=running) is Claim.ACQUIRED
            memo = StepMemo(book, QUEUE, task_id)
            assert await memo.recorded("call", 1) is None
            await memo.save(*made("call", 1, task_id, **_bounded()))
            await client.pexpire(steps_key(QUEUE, task_id), 5_000)  # shorter than the record's
            done = TaskState(task_id=task_id, queue=QUEUE, status=TaskStatus.SUCCEEDED)
            await store.finish(QUEUE, task_id, done, owner="me")
        for task_id in ids:
            replayed = await StepMemo(book, QUEUE, task_id).recorded("call", 1)
            assert replayed is not None and replayed.result == task_id
            ttls = [
                await client.pttl(k) for k in (state_key(QUEUE, task_id), steps_key(QUEUE, task_id))
            ]
            assert ttls[1] > 100_000 and abs(ttls[0] - ttls[1]) < 1_000, ttls
    finally:
        await client.aclose()
        await store.close()


def _bounded() -> dict[str, Any]:
    return {"duration_s": 0.0, "attempt": 1, "usage": [], "max_bytes": 10_000}

"""The how-to pages' code runs as the pages say, against the real broker and Redis.

Each page's Python block is a section of a file in docs/examples/howto/, included by
pymdownx.snippets; here each file is loaded as a module and its scenario run with a Worker
in this event loop (the ``start_worker`` fixture). The files build their ``App`` as a user's
module does, from the WECLAW_MQ_* environment, so the test sets WECLAW_MQ_AMQP_URL and
WECLAW_MQ_REDIS_URL to the test's services before it loads one.

Queue names: a file writes them as literal strings, as a user writes them and as the page
shows them (module-level constants would make the shown code read ``@app.handler(QUEUE)``).
Two runs of the suite on one machine share the broker and Redis, and would consume each
other's tasks under fixed names. So the loader parses the file and replaces every string
constant that is one of the file's queue names by that name behind a prefix unique to the
test, then executes the result: whole constants only (never a comment, never part of
another string), and the prefix keeps derived names right (``notify=True`` announces to
"<queue>.results", which maps like "ai-replies.results" itself). Paths such as the outbox
file are replaced the same way by temporary ones. Line numbers are the file's own. At
teardown every App a loaded module holds is closed, and its queues and Redis keys deleted.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel

from tests.conftest import delete_queues, forget_task_keys, next_message, wait_until
from tests.integration.dead_endpoints import closed_port
from tests.integration.postgres_db import PgSchema
from tests.parsing import parse_source
from weclaw_mq import App, CancelOutcome, TaskStatus, Worker
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import (
    CHAIN_RECORD_QUEUE,
    GROUP_RECORD_QUEUE,
    LIMIT_KEY_PREFIX,
    dlq_name,
    inbox_key,
    inbox_trace_key,
    latest_key,
    state_key,
    workflow_key,
    workflow_parts_key,
)
from weclaw_mq.wire.topology import queue_declarations

HOWTO = Path(__file__).resolve().parents[2] / "docs" / "examples" / "howto"


class _Rename(ast.NodeTransformer):
    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = names

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str) and node.value in self.names:
            return ast.copy_location(ast.Constant(self.names[node.value]), node)
        return node


class Examples:
    """Loads docs/examples/howto/ files with this test's queue names and services."""

    def __init__(self, broker_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.broker_url = broker_url
        self.redis_url = redis_url
        self.monkeypatch = monkeypatch
        self.prefix = f"t-docs-{uuid.uuid4().hex[:8]}-"
        self.modules: list[ModuleType] = []
        self.redis_keys: list[str] = []

    def queue(self, name: str) -> str:
        """The name the loaded files use for the queue a page calls ``name``."""
        return self.prefix + name

    def load(
        self,
        file: str,
        *,
        queues: Iterable[str],
        paths: Mapping[str, str] | None = None,
        amqp_url: str | None = None,
    ) -> ModuleType:
        names = {q: self.queue(q) for q in queues} | dict(paths or {})
        self.monkeypatch.setenv("WECLAW_MQ_AMQP_URL", amqp_url or self.broker_url)
        self.monkeypatch.setenv("WECLAW_MQ_REDIS_URL", self.redis_url)
        path = HOWTO / file
        tree = ast.fix_missing_locations(_Rename(names).visit(parse_source(path.read_text())))
        name = f"docs_howto_{path.stem}_{len(self.modules)}_{self.prefix[7:15]}"
        module = ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module  # dataclasses and pydantic look their module up there
        self.modules.append(module)
        exec(compile(tree, str(path), "exec"), module.__dict__)
        return module

    async def close(self) -> None:
        declared: list[str] = []
        queues: set[str] = set()
        for module in self.modules:
            for value in list(vars(module).values()):
                if isinstance(value, App):
                    await value.close()
                    for spec in value.handlers.values():
                        declared += [n for n, _ in queue_declarations(spec.queue_spec())]
                        queues.add(spec.queue)
                elif isinstance(value, httpx.AsyncClient):
                    await value.aclose()
            sys.modules.pop(module.__name__, None)
        await delete_queues(self.broker_url, sorted(set(declared)))
        await forget_task_keys(self.redis_url, queues)
        client = aioredis.Redis.from_url(self.redis_url)
        try:
            keys = list(self.redis_keys)
            for queue in queues:  # per-key limits' slots and starts (they expire, but later)
                pattern = f"{LIMIT_KEY_PREFIX}:{len(queue.encode())}:{queue}:*"
                keys += [k.decode() async for k in client.scan_iter(pattern, count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


@pytest.fixture
async def examples(
    broker_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Examples]:
    # Requested before start_worker, so torn down after the workers stopped.
    loaded = Examples(broker_url, redis_url, monkeypatch)
    try:
        yield loaded
    finally:
        await loaded.close()


def recording(target: Any, method: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Wrap ``target.method`` (a publish, sync or async) so that what it returns is kept, in
    call order."""
    returned: list[Any] = []
    original = getattr(target, method)

    async def kept(pending: Awaitable[Any]) -> Any:
        value = await pending
        returned.append(value)
        return value

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        if inspect.isawaitable(value):
            return kept(value)
        returned.append(value)
        return value

    monkeypatch.setattr(target, method, wrapper)
    return returned


async def consumer_count(channel: AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return declared.declaration_result.consumer_count or 0


# -- handlers.md ----------------------------------------------------------------------------


async def test_handlers_page_module_replies_and_its_main_prints_the_final_result(
    examples: Examples, start_worker: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    # Two processes in real life: `weclaw-mq worker mymodule:app` and a script running main().
    worker_side = examples.load("handlers.py", queues=["ai-replies"])
    await start_worker(worker_side.app)
    script = examples.load("handlers.py", queues=["ai-replies"])

    await script.main()

    out = capsys.readouterr().out
    assert "succeeded {'reply': 'echo: Write a haiku'}" in out, out
    empty = await worker_side.app.publish(examples.queue("ai-replies"), {"text": "  "})
    final = await worker_side.app.result(empty, timeout_s=15)
    assert (final.status, final.reason, final.attempt) == (TaskStatus.DEAD_LETTERED, "rejected", 1)


async def test_handlers_page_plain_def_runs_in_a_thread_streams_and_rejects_as_async(
    examples: Examples, start_worker: Callable[..., Any]
) -> None:
    example = examples.load("sync_handlers.py", queues=["doc-summaries"])
    app, queue = example.app, examples.queue("doc-summaries")
    assert app.handlers[queue].is_sync
    worker = await start_worker(app)

    task_id = await app.publish(queue, {"text": "threads hold blocking calls"})
    events = [event async for event in app.stream(task_id)]
    assert [e.data for e in events if e.kind == "chunk"] == ["THREADS", "HOLD", "BLOCKING", "CALLS"]
    final = await app.result(task_id, timeout_s=15)
    assert (final.status, final.result) == (
        TaskStatus.SUCCEEDED,
        {"summary": "THREADS HOLD BLOCKING CALLS"},
    )
    assert worker.sync_threads.threads == 1  # made by the first call, not before
    empty = await app.publish(queue, {"text": " "})
    final = await app.result(empty, timeout_s=15)
    assert (final.status, final.reason, final.attempt) == (TaskStatus.DEAD_LETTERED, "rejected", 1)


# -- priorities.md --------------------------------------------------------------------------


async def test_priorities_page_send_starts_its_urgent_task_ahead_of_a_normal_backlog(
    examples: Examples, start_worker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    example = examples.load("priorities.py", queues=["ai-replies"])
    app, queue = example.app, examples.queue("ai-replies")
    await app.declare()  # the backlog waits for the worker
    backlog = [await app.publish(queue, {"prompt": f"n{i}"}, priority="normal") for i in range(8)]
    default = await app.publish(queue, {"prompt": "no priority given"})  # the handler's: high
    sent = recording(app, "publish", monkeypatch)
    sent_many = recording(app, "publish_many", monkeypatch)
    await example.send()
    (urgent,), ((weekly,),) = sent, sent_many

    # One slot: tasks end in the order they start.
    await start_worker(app, concurrency=1)
    ids = [*backlog, default, urgent, weekly]
    finals = [await app.result(t, timeout_s=20) for t in ids]
    assert all(f.status is TaskStatus.SUCCEEDED for f in finals)
    order = [f.task_id for f in sorted(finals, key=lambda f: f.updated_at)]
    # The page: every URGENT task starts before all but concurrency + 2 of the others, every
    # HIGH one before all but concurrency + 2 NORMAL ones.
    assert order.index(urgent) <= 3, order
    assert len([t for t in order[: order.index(default)] if t != urgent]) <= 3, order
    assert order.index(weekly) > order.index(urgent)


# -- delays.md ------------------------------------------------------------------------------


class ModelAPI:
    """A real HTTP server standing in for a rate-limited model API: the first request for
    the prompt "busy" answers 429 with ``Retry-After: 2``; every other one 200 with a text.
    Each request's prompt and time (the loop's clock) is kept."""

    RETRY_AFTER_S = 2

    def __init__(self) -> None:
        self.requests: list[tuple[str, float]] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        prompt = json.loads(await reader.readexactly(length))["prompt"]
        first_busy = prompt == "busy" and all(p != "busy" for p, _ in self.requests)
        self.requests.append((prompt, asyncio.get_running_loop().time()))
        if first_busy:
            status, extra, body = "429 Too Many Requests", f"Retry-After: {self.RETRY_AFTER_S}", b""
        else:
            status, extra = "200 OK", "Content-Type: application/json"
            body = json.dumps({"text": f"{prompt} done"}).encode()
        writer.write(
            f"HTTP/1.1 {status}\r\n{extra}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    def times(self, prompt: str) -> list[float]:
        return [at for p, at in self.requests if p == prompt]


@pytest.fixture
async def model_api() -> AsyncIterator[ModelAPI]:
    api = ModelAPI()
    server = await asyncio.start_server(api.serve, "127.0.0.1", 0)
    api.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/complete"
    try:
        yield api
    finally:
        server.close()
        await server.wait_closed()


async def test_delays_page_retries_a_429_after_its_retry_after_and_runs_a_delayed_task_later(
    examples: Examples,
    start_worker: Callable[..., Any],
    model_api: ModelAPI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MODEL_URL", model_api.url)
    example = examples.load("delays.py", queues=["ai-replies"])
    await start_worker(example.app)
    loop = asyncio.get_running_loop()

    busy = await example.app.publish(examples.queue("ai-replies"), example.Prompt(text="busy"))
    published_later = loop.time()
    later = await example.later()
    busy_final = await example.app.result(busy, timeout_s=20)
    later_final = await example.app.result(later, timeout_s=20)

    assert (busy_final.status, busy_final.attempt) == (TaskStatus.SUCCEEDED, 2)
    assert busy_final.result == {"reply": "busy done"}
    first, second = model_api.times("busy")
    # Never earlier than asked, at most 1 s later plus the lane's wait (an idle worker here).
    assert 2.0 <= second - first <= 3.5, f"retried {second - first:.2f} s after the 429"
    assert (later_final.status, later_final.attempt) == (TaskStatus.SUCCEEDED, 1)
    (ran,) = model_api.times("later")
    assert 2.0 <= ran - published_later <= 3.5, f"ran {ran - published_later:.2f} s after"


# -- ttl.md ---------------------------------------------------------------------------------


async def test_ttl_page_gives_each_task_its_lifetime_and_an_expired_one_lands_in_the_dlq(
    examples: Examples, amqp: AbstractChannel
) -> None:
    example = examples.load("ttl.py", queues=["ai-replies", "ai-reports"])
    app = example.app
    replies, reports = examples.queue("ai-replies"), examples.queue("ai-reports")
    await app.declare()  # no worker: the tasks stay in their queues to be read back

    before = time.time()
    asked = await example.ask(example.Prompt(text="hi"))
    report = await app.publish(reports, example.Report(week="48"))  # the handler's ttl_s

    for queue, task_id, ttl_s in ((replies, asked, 600), (reports, report, 3 * 24 * 3600)):
        message = await next_message(amqp, queue)
        assert message.message_id == task_id
        assert message.headers[h.TTL_MS] == ttl_s * 1000
        assert message.expiration is not None  # RabbitMQ's own per-message TTL
        state = await app.status(task_id)
        assert state is not None and state.expires_at is not None
        assert abs(state.expires_at.timestamp() - (before + ttl_s)) < 5

    # A reply nobody collected within its lifetime leaves a trace: Q.dlq, reason expired.
    short = await app.publish(replies, example.Prompt(text="too late"), ttl_s=0.5)
    dead = await next_message(amqp, dlq_name(replies), timeout_s=10)
    assert dead.message_id == short
    deaths = dead.headers["x-death"]
    assert isinstance(deaths, list) and isinstance(deaths[0], dict)
    assert deaths[0]["reason"] == "expired"
    state = await app.status(short)
    assert state is not None and state.status is TaskStatus.EXPIRED


# -- outbox.md ------------------------------------------------------------------------------


async def test_outbox_page_publish_stores_locally_while_the_broker_is_down_then_it_is_relayed(
    examples: Examples, start_worker: Callable[..., Any], tmp_path: Path
) -> None:
    paths = {"/var/lib/myapi/outbox.db": str(tmp_path / "outbox.db")}
    dead = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    down = examples.load("outbox.py", queues=["summaries"], paths=paths, amqp_url=dead)

    state = await down.accept()

    assert state is not None and state.status is TaskStatus.STORED_LOCALLY
    await down.app.close()
    # The same program started again once the broker answers: its relay sends the file's row.
    up = examples.load("outbox.py", queues=["summaries"], paths=paths)
    await start_worker(up.app)
    await up.app.start_outbox()
    final = await up.app.result(state.task_id, timeout_s=20)
    assert (final.status, final.result) == (TaskStatus.SUCCEEDED, {"summary": "..."})
    assert not await up.app.stored_locally(state.task_id)


async def test_outbox_page_task_added_in_your_own_transaction_is_sent_after_the_commit(
    examples: Examples,
    start_worker: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shop = tmp_path / "shop.db"
    example = examples.load(
        "outbox_transaction.py", queues=["invoices"], paths={"/var/lib/shop/shop.db": str(shop)}
    )
    await start_worker(example.app)
    await example.app.start_outbox()  # creates the outbox's tables in shop.db
    example.create_tables()
    added = recording(example.app, "add_to_outbox", monkeypatch)

    example.place_order()

    (task_id,) = added
    final = await example.app.result(task_id, timeout_s=20)
    assert (final.status, final.result) == (TaskStatus.SUCCEEDED, {"invoice": "for book"})


async def test_outbox_page_postgres_order_and_its_task_commit_together_then_the_task_runs(
    examples: Examples, start_worker: Callable[..., Any], pg_schema: PgSchema
) -> None:
    from weclaw_mq.outbox.postgres import migrate

    await migrate(pg_schema.url)
    example = examples.load(
        "outbox_postgres.py",
        queues=["invoices"],
        paths={"postgresql://shop@localhost/shop": pg_schema.url},
    )
    await start_worker(example.app)
    example.create_tables()
    stop = asyncio.Event()
    relay = asyncio.create_task(example.relay_until(stop))
    try:
        task_id = await asyncio.to_thread(example.place_order)
        final = await example.app.result(task_id, timeout_s=20)
    finally:
        stop.set()
        await asyncio.wait_for(relay, 30)
    assert (final.status, final.result) == (TaskStatus.SUCCEEDED, {"invoice": "for book"})
    assert pg_schema.count() == 0


# -- from-celery.md -------------------------------------------------------------------------


async def test_from_celery_page_port_runs_every_call_it_maps(
    examples: Examples, start_worker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    example = examples.load("from_celery.py", queues=["add", "fetch", "count-words", "total"])
    app = example.app
    chains = recording(app, "chain", monkeypatch)
    groups = recording(app, "group", monkeypatch)
    await start_worker(app)
    try:
        got = await example.calls()
    finally:
        for wid in [*chains, *groups]:
            examples.redis_keys += workflow_keys(wid)

    assert got == {
        "answer": 5,
        "cancelled": CancelOutcome.CANCELLED,
        "fetched": ("<p>the page at https://example.org</p>", 3),
        "words": 4,
        "summed": 10,
    }
    assert "nightly-add" in app.schedules


# -- cancel.md ------------------------------------------------------------------------------


async def test_cancel_page_stops_a_running_task_and_says_too_late_for_an_ended_one(
    examples: Examples, start_worker: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    example = examples.load("cancel.py", queues=["generate"])
    app = example.app
    await start_worker(app)
    words = " ".join(f"word{i}" for i in range(30))  # 30 s of generating, 1 s a word
    task_id = await app.publish(examples.queue("generate"), {"text": words})

    async def running() -> bool:
        state = await app.status(task_id)
        return state is not None and state.status is TaskStatus.RUNNING

    await wait_until(running, 15, what="the task running")
    loop = asyncio.get_running_loop()
    started = loop.time()

    answer = await example.stop_generating(task_id)

    assert answer.changed and answer.outcome is CancelOutcome.CANCELLED
    final = await app.result(task_id, timeout_s=10)
    assert final.status is TaskStatus.CANCELLED
    assert loop.time() - started < 5  # the handler was stopped, not run to its end
    assert capsys.readouterr().out == ""

    again = await example.stop_generating(task_id)

    assert not again.changed and again.outcome is CancelOutcome.FINISHED
    assert capsys.readouterr().out == "too late: it already ended (cancelled)\n"


# -- workflows.md ---------------------------------------------------------------------------


async def test_workflows_page_chain_answers_and_group_merges_once_in_order(
    examples: Examples, start_worker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    queues = ["understand", "lookup", "generate", "summarise", "merge", "merge-what-came"]
    example = examples.load("workflows.py", queues=queues)
    app = example.app
    chains = recording(app, "chain", monkeypatch)
    groups = recording(app, "group", monkeypatch)
    await start_worker(app)

    try:
        answered = await example.answer("What is Sirius?")
        summed = await example.summary(["first chunk of a long text", "second chunk", "third"])
        despite = await example.summary_despite_failures(["one", "two"])
    finally:
        for wid in [*chains, *groups]:
            examples.redis_keys += workflow_keys(wid)

    assert (answered.status, answered.result) == (
        TaskStatus.SUCCEEDED,
        "What is Sirius? Sirius is a star.",
    )
    stage = await app.status(f"{chains[0]}.2", queue=examples.queue("generate"))
    assert stage is not None and stage.status is TaskStatus.SUCCEEDED
    assert (summed.status, summed.result) == (
        TaskStatus.SUCCEEDED,
        "first chunk of a lon / second chunk / third",
    )
    assert (despite.status, despite.result) == (
        TaskStatus.SUCCEEDED,
        {"summary": "one / two", "missing": []},
    )


def workflow_keys(workflow_id: str) -> list[str]:
    """A workflow's Redis keys (its record, plan and parts; its tasks' go with their queues)."""
    records = [state_key(q, workflow_id) for q in (CHAIN_RECORD_QUEUE, GROUP_RECORD_QUEUE)]
    return [
        *records,
        latest_key(workflow_id),
        workflow_key(workflow_id),
        workflow_parts_key(workflow_id),
    ]


# -- notifications.md -----------------------------------------------------------------------


async def test_notifications_page_tells_the_user_of_a_reply_and_of_a_failure(
    examples: Examples, start_worker: Callable[..., Any]
) -> None:
    example = examples.load("notifications.py", queues=["ai-replies", "ai-replies.results"])
    await start_worker(example.app)
    queue = examples.queue("ai-replies")

    ok = await example.app.publish(queue, {"text": "hi"})
    rejected = await example.app.publish(queue, {"text": " "})

    await wait_until(lambda: len(example.PUSHED) >= 2, 20, what="two notifications handled")
    assert sorted(example.PUSHED) == sorted(
        [
            (ok, "result", {"reply": "echo: hi"}),
            (rejected, "failure", ("rejected", "Reject: empty prompt")),
        ]
    )


# -- streaming.md ---------------------------------------------------------------------------


async def test_streaming_page_watch_prints_the_chunks_in_order_then_final_and_deliver_confirms(
    examples: Examples, start_worker: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    example = examples.load("streaming.py", queues=["chat"])
    app = example.app
    session = f"user-{examples.prefix}"
    examples.redis_keys += [inbox_key(session), inbox_trace_key(session)]
    await start_worker(app)
    text = "queues that survive crashes"

    task_id = await app.publish(examples.queue("chat"), {"text": text}, session_id=session)
    await asyncio.wait_for(example.watch(task_id, None), 20)

    events = [line.split(" ", 2) for line in capsys.readouterr().out.splitlines()]
    assert [kind for _, kind, _ in events] == ["attempt", *["chunk"] * 4, "final"]
    assert [data for _, kind, data in events if kind == "chunk"] == text.split()
    ids = [tuple(map(int, event_id.split("-"))) for event_id, _, _ in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # Resumed after the last chunk: only the final.
    await asyncio.wait_for(example.watch(task_id, events[-2][0]), 20)
    assert [line.split(" ", 2)[1] for line in capsys.readouterr().out.splitlines()] == ["final"]

    printed: list[str] = []
    deliver = asyncio.create_task(example.deliver(session))
    try:

        def final_delivered() -> bool:
            printed.extend(capsys.readouterr().out.splitlines())
            return any(line.split(" ", 2)[1] == "final" for line in printed)

        await wait_until(final_delivered, 20, what="the final reply in the session's inbox")
    finally:
        deliver.cancel()
        await asyncio.gather(deliver, return_exceptions=True)
    assert printed[-1] == f"{task_id} final {{'text': '{text}'}}"
    assert [line.split(" ", 2)[1] for line in printed].count("chunk") == 4
    assert await app.inbox(session).pending() == []  # each confirmed: the inbox is empty


# -- limits.md ------------------------------------------------------------------------------


async def test_limits_page_holds_one_users_replies_to_two_at_once_without_spending_attempts(
    examples: Examples, start_worker: Callable[..., Any]
) -> None:
    example = examples.load("limits.py", queues=["ai-replies", "embeddings"])
    app = example.app
    await start_worker(app, concurrency=6)  # slots enough for all six at once

    replies = [
        await app.publish(examples.queue("ai-replies"), {"text": f"p{i}", "user_id": "u1"})
        for i in range(6)
    ]
    embedded = await app.publish(examples.queue("embeddings"), {"text": "abc", "user_id": "u1"})

    finals = [await app.result(t, timeout_s=30) for t in replies]
    assert all(f.status is TaskStatus.SUCCEEDED for f in finals)
    assert [f.attempt for f in finals] == [1] * 6  # a deferral spends no attempt
    assert example.PEAK["u1"] == 2, example.PEAK  # reached, never exceeded
    assert (await app.result(embedded, timeout_s=10)).result == [3.0]


# -- admission.md ---------------------------------------------------------------------------


async def test_admission_page_quota_parks_the_third_run_and_dead_letters_an_unknown_customer(
    examples: Examples, start_worker: Callable[..., Any]
) -> None:
    now = datetime.now(UTC)
    if now.minute == 59 and now.second >= 30:  # the quota's hour must not turn during the test
        await asyncio.sleep(61 - now.second)
    example = examples.load("admission.py", queues=["questions"])
    app, queue = example.app, examples.queue("questions")
    try:
        await start_worker(app)
        acme = [await app.publish(queue, {"customer": "acme"}) for _ in range(3)]
        mallory = await app.publish(queue, {"customer": "mallory"})
        finals = [await app.result(t, timeout_s=30) for t in (*acme[:2], mallory)]

        async def parked() -> bool:
            state = await app.status(acme[2])
            return state is not None and state.deferred is not None

        await wait_until(parked, 30, "the third run parked by the quota")
        third = await app.status(acme[2])
        assert third is not None and third.deferred is not None
        assert (third.status, third.deferred.by) == (TaskStatus.QUEUED, "quota")
        assert third.deferred.why == "customer 'acme' used its 2 runs this hour"
        assert [f.result for f in finals[:2]] == [
            {"answer": "hello, acme", "calls": [["small", 12, 3]]}
        ] * 2
        assert finals[2].status is TaskStatus.DEAD_LETTERED
        assert finals[2].error == "Reject: customer 'mallory' has no contract"
    finally:
        client = example.quota.redis
        examples.redis_keys += [
            k.decode() async for k in client.scan_iter(f"quota:{queue}:*", count=1000)
        ]
        await client.aclose()


# -- breaker.md -----------------------------------------------------------------------------


async def test_breaker_page_pauses_the_queue_after_five_failures(
    examples: Examples, start_worker: Callable[..., Any], amqp: AbstractChannel
) -> None:
    example = examples.load("breaker.py", queues=["chat"])
    app, queue = example.app, examples.queue("chat")
    example.UPSTREAM.down = True
    await app.declare()
    await app.publish_many(queue, [{"prompt": f"p{i}"} for i in range(8)])
    # One slot: the bound is failures + concurrency - 1 = 5 failed attempts before the pause.
    await start_worker(app, concurrency=1)

    async def paused() -> bool:
        return await consumer_count(amqp, queue) == 0

    await wait_until(paused, 10, what="the breaker cancelling the worker's consumer")
    state = app.metrics.registry.get_sample_value(
        "weclaw_mq_breaker_state", {"queue": queue, "state": "open"}
    )
    assert state == 1
    assert example.UPSTREAM.failures == 5
    await asyncio.sleep(1)  # open for cooldown_s (20 s): nothing more is taken meanwhile
    assert example.UPSTREAM.failures == 5
    assert await consumer_count(amqp, queue) == 0


# -- reference/task-store.md ----------------------------------------------------------------


async def test_task_store_page_lists_dead_lettered_tasks_and_the_newest_ones_timeline(
    examples: Examples, start_worker: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    example = examples.load("task_index.py", queues=["ai-replies"])
    app = example.app
    await start_worker(app)
    queue = examples.queue("ai-replies")
    first = await app.publish(queue, {"model": "gpt-0"})
    assert (await app.result(first, timeout_s=15)).status is TaskStatus.DEAD_LETTERED
    newest = await app.publish(queue, {"model": "gpt-1"})
    assert (await app.result(newest, timeout_s=15)).status is TaskStatus.DEAD_LETTERED

    await example.triage()

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{newest} ") and lines[0].endswith(" rejected"), lines
    assert lines[1] == "and 1 older"
    assert [line.split(" ")[2:4] for line in lines[2:]] == [
        ["queued", "0"],
        ["running", "1"],
        ["dead_lettered", "1"],
    ], lines
    assert lines[-1].endswith("Reject: no model named 'gpt-1'")


async def test_task_store_page_app_keeps_its_records_in_the_memory_store_and_closes_both(
    examples: Examples,
) -> None:
    example = examples.load("task_store.py", queues=["tests"])
    app, store = example.app, example.store
    # The worker shares the process with whoever reads the results, as the page says.
    worker = Worker(app)
    run = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.ready.wait(), 20)
        task_id = await app.publish(examples.queue("tests"), {"n": 21})
        final = await app.result(task_id, timeout_s=15)
        assert (final.status, final.result) == (TaskStatus.SUCCEEDED, 42)
        in_store = await store.get(task_id)
        assert in_store is not None and in_store.result == 42
    finally:
        worker.stop()
        await asyncio.wait_for(run, 30)

    await example.shutdown()


# -- handlers.md: the lifespan and middleware -------------------------------------------------


async def test_handlers_page_resource_serves_every_run_and_middleware_sees_each_outcome(
    examples: Examples, start_worker: Callable[..., Any]
) -> None:
    example = examples.load("lifespan.py", queues=["answers"])
    app, queue = example.app, examples.queue("answers")
    worker = await start_worker(app)
    client = app.use(example.model)  # open while the worker runs

    ids = [await app.publish(queue, {"prompt": p}) for p in ("hi", "again")]
    finals = [await app.result(t, timeout_s=15) for t in ids]
    await wait_until(lambda: len(example.timing.lines) == 2, 10, "both runs timed")
    worker.stop()
    await wait_until(lambda: not client.open, 30, "the client closed after the drain")

    assert [f.result for f in finals] == ["an answer to 'hi'", "an answer to 'again'"]
    assert all(line.startswith(f"{queue} attempt 1: acked in ") for line in example.timing.lines)


# -- schedules.md -------------------------------------------------------------------------------


async def test_schedules_page_fires_the_interval_once_per_tick_and_lists_the_nightly_one(
    examples: Examples, start_worker: Callable[..., Any], redis_url: str
) -> None:
    from weclaw_mq.contract.naming import schedule_key, scheduler_lease_key
    from weclaw_mq.scheduling.scheduler import describe_schedules

    example = examples.load("schedules.py", queues=["rescore-day", "heartbeat"])
    app = example.app
    app.name = f"rescoring-{examples.queue('heartbeat')}"  # its lease is its own in this run
    worker = await start_worker(app, schedules=True)
    try:
        await wait_until(lambda: _fired(app) >= 2, 20, "two ticks of pulse fired")
        views, leader = await describe_schedules(app)
        by_name = {v.name: v for v in views}
        assert leader
        nightly = by_name["nightly-rescore"]
        assert nightly.every == "cron 0 3 * * * (Europe/Berlin)" and nightly.fired == 0
        assert nightly.next_tick is not None and nightly.next_tick.hour == 3
        beat = by_name["pulse"]
        assert beat.last_status == "succeeded" and beat.last_task_id is not None
        assert beat.last_task_id.startswith("schedule:pulse:")
        assert beat.every == "every 2 s"
    finally:
        worker.stop()
        client = aioredis.from_url(redis_url)
        await client.delete(
            scheduler_lease_key(app.name),
            *(schedule_key(app.name, n) for n in app.schedules),
        )
        await client.aclose()


def _fired(app: App) -> float:
    sample = app.metrics.registry.get_sample_value(
        "weclaw_mq_schedule_ticks_total", {"schedule": "pulse", "outcome": "fired"}
    )
    return sample or 0.0


# -- limits.md: token limits ------------------------------------------------------------------


async def test_limits_page_token_limit_keeps_a_provider_with_its_own_limits_from_429s(
    examples: Examples,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
) -> None:
    from tests.conftest import forget_limit_keys
    from weclaw_mq.testing.fake_provider import FakeProvider, ModelLimits, serving

    fake = FakeProvider({"small": ModelLimits(tokens=90_000, requests=500, window_s=60)})
    async with serving(fake) as base_url:
        monkeypatch.setenv("PROVIDER_URL", base_url)
        example = examples.load("token_limits.py", queues=["answers"])
        app, queue = example.app, examples.queue("answers")
        try:
            await start_worker(app, concurrency=4)
            ids = await app.publish_many(
                queue, [{"model": "small", "prompt": "hello " * 50, "max_tokens": 64}] * 5
            )
            finals = [await app.result(t, timeout_s=30) for t in ids]
        finally:
            await example.client.aclose()
            await forget_limit_keys(redis_url, queue)
    assert [f.status for f in finals] == [TaskStatus.SUCCEEDED] * 5
    assert fake.refused == 0 and fake.calls == 5


# -- costs.md --------------------------------------------------------------------------------


async def test_costs_page_records_each_call_per_tenant_and_model(
    examples: Examples, start_worker: Callable[..., Any], redis_url: str
) -> None:
    from datetime import UTC, datetime

    from weclaw_mq.contract.naming import costs_key, usage_key

    example = examples.load("costs.py", queues=["answers"])
    app, queue = example.app, examples.queue("answers")
    app.name = f"costs-{queue}"  # its totals are its own in this run
    await start_worker(app)
    ids = await app.publish_many(
        queue,
        [
            {"tenant": "acme", "model": "big-1", "prompt": "p" * 400},
            {"tenant": "globex", "model": "small-1", "prompt": "p" * 40},
        ],
    )
    try:
        assert [(await app.result(t, timeout_s=15)).result for t in ids] == [
            "big-1 says hi",
            "small-1 says hi",
        ]
        by_tenant = {t.name: t for t in await app.costs(by="tenant")}
        # acme: 100 input and 20 output tokens of big-1; globex: 10 and 20 of small-1.
        assert by_tenant["acme"].cost == (100 * 0.5 + 20 * 1.5) / 1000
        assert by_tenant["globex"].cost == (10 * 0.05 + 20 * 0.15) / 1000
        (call,) = await app.calls(ids[0])
        assert (call.model, call.tenant, call.attempt) == ("big-1", "acme", 1)
    finally:
        client = aioredis.from_url(redis_url)
        day = datetime.now(UTC).date().isoformat()
        await client.delete(costs_key(app.name, day), *(usage_key(t) for t in ids))
        await client.aclose()


# -- fallbacks.md ----------------------------------------------------------------------------


async def test_fallbacks_page_sends_the_retry_to_the_next_model_while_the_first_is_down(
    examples: Examples,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
) -> None:
    from weclaw_mq.contract.naming import models_key
    from weclaw_mq.testing.fake_provider import FakeProvider, ModelLimits, serving

    limits = ModelLimits(tokens=10**6, requests=10**4, window_s=60)
    fake = FakeProvider({m: limits for m in ("big-1", "big-2", "small-1")})
    fake.down.add("big-1")
    async with serving(fake) as base_url:
        monkeypatch.setenv("PROVIDER_URL", base_url)
        example = examples.load("fallbacks.py", queues=["answers"])
        app, queue = example.app, examples.queue("answers")
        app.name = f"fallbacks-{queue}"  # its models' health is its own in this run
        try:
            await start_worker(app)
            task_id = await app.publish(queue, {"prompt": "hello"})
            final = await app.result(task_id, timeout_s=30)
        finally:
            await example.client.aclose()
            client = aioredis.from_url(redis_url)
            await client.delete(models_key(app.name))
            await client.aclose()
    assert final.status is TaskStatus.SUCCEEDED and final.attempt == 2
    assert final.result.startswith("big-2: ")


# -- fair-share.md --------------------------------------------------------------------------


async def test_fair_share_page_starts_another_tenants_task_before_the_backlog_ends(
    examples: Examples, start_worker: Callable[..., Any]
) -> None:
    example = examples.load("fair_share.py", queues=["answers"])
    app, queue = example.app, examples.queue("answers")
    await app.declare()
    backlog = await app.publish_many(
        queue, [example.Question(tenant="big", prompt=f"q{i}") for i in range(100)]
    )
    await start_worker(app, concurrency=2)
    small = await app.publish(queue, example.Question(tenant="small", prompt="hello"))
    final = await app.result(small, timeout_s=30)
    assert final.status is TaskStatus.SUCCEEDED and final.result == "small: hello"
    # The backlog is far from done when the other tenant's answer is there.
    states = [await app.status(t) for t in backlog]
    done = sum(1 for s in states if s is not None and s.status is TaskStatus.SUCCEEDED)
    assert done < 50, done


# -- steps.md --------------------------------------------------------------------------------


async def test_steps_page_replays_recorded_steps_after_a_failure_and_continues_the_story(
    examples: Examples, start_worker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WECLAW_MQ_RETRY_DELAY_S", "0.05")  # the retries come at once
    example = examples.load("steps.py", queues=["agent", "story"])
    app = example.app
    example.BREAK_ONCE.update({"Answer", "generate"})  # each breaks off on its first call
    await start_worker(app)

    asked = await app.publish(examples.queue("agent"), {"question": "why queues"})
    final = await app.result(asked, timeout_s=30)

    assert final.status is TaskStatus.SUCCEEDED and final.attempt == 2, final
    assert final.result["answer"].startswith("Answer why queues from")
    # The retry replayed search and both summaries: only the answer was asked twice.
    assert example.CALLS == [
        "search",
        "small-1 summarise:1",
        "small-1 summarise:2",
        "big-1 answer:1",
        "big-1 answer:1",
    ]
    steps = await app.steps(asked)
    assert [(s.name, s.occurrence, s.attempt) for s in steps] == [
        ("search", 1, 1),
        ("summarise", 1, 1),
        ("summarise", 2, 1),
        ("answer", 1, 2),
    ]
    assert [u[0] for s in steps for u in s.usage] == ["small-1", "small-1", "big-1"]

    example.CALLS.clear()
    told = await app.publish(examples.queue("story"), {"prompt": "a task"})
    events = []
    async with asyncio.timeout(30):
        async for event in app.stream(told):
            events.append(event)

    whole = "Once upon a time a task met a queue that never lost "
    assert [e.kind for e in events].count("attempt") == 1  # the re-run went on, no restart
    assert "".join(e.data for e in events if e.kind == "chunk") == whole
    assert events[-1].kind == "final" and events[-1].result == whole
    assert example.CALLS == ["generate after 0 chars", "generate after 19 chars"]


# -- long-runs.md ----------------------------------------------------------------------------


async def test_long_runs_page_hands_a_run_over_at_a_stop_and_replays_its_steps(
    examples: Examples, start_worker: Callable[..., Any]
) -> None:
    example = examples.load("long_runs.py", queues=["agent.run"])
    app = example.app
    first = await start_worker(app)
    second = await start_worker(app)

    task_id = await app.publish(examples.queue("agent.run"), {"goal": "ship it"})
    await wait_until(lambda: len(example.CALLS) >= 3, 20, "the plan and two parts")
    (running,) = [w for w in (first, second) if w.in_flight]
    running.stop()  # a SIGTERM: its long run is handed over, not waited for
    final = await app.result(task_id, timeout_s=30)

    assert final.status is TaskStatus.SUCCEEDED, final
    assert final.result == [f"SHIP IT, PART {i}" for i in range(1, 9)]
    # The plan was made once; each part once, but the one the stop interrupted.
    assert example.CALLS.count("plan") == 1, example.CALLS
    parts = [c for c in example.CALLS if c != "plan"]
    assert sorted(set(parts)) == [f"ship it, part {i}" for i in range(1, 9)]
    assert len(parts) <= 9, parts

"""Memoized steps' pure parts (``state.steps``): a record's stored form both ways and its bound,
the hash field and key, one read per attempt however many steps start at once; a fresh step's
usage billed before its record, a replay's never; and what a re-run reads of its stream
(``streaming.emitter.emitted_chunks``) and writes after it. The steps on the real broker and
Redis: tests/integration/test_steps.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from tests.unit.test_naming_keys import _hash_tag
from weclaw_mq import App, Context, Retry
from weclaw_mq.contract.naming import guard_key, state_key, steps_key, task_keys
from weclaw_mq.errors import StepError
from weclaw_mq.handlers.middleware import Usage as MiddlewareUsage
from weclaw_mq.llm.usage import unbilled
from weclaw_mq.state.steps import (
    HasSteps,
    MemoryStepBook,
    StepMemo,
    Usage,
    decode,
    made,
    step_billing,
    step_field,
    step_key,
    steps_of,
)
from weclaw_mq.streaming import MemoryStreamStore
from weclaw_mq.streaming.emitter import Emitter, emitted_chunks
from weclaw_mq.streaming.events import attempt_entry, chunk_entry, encode_data, final_entry
from weclaw_mq.testing import TestBroker


def test_a_record_reads_back_as_made_with_its_result_as_json_data() -> None:
    record, body = made(
        "call",
        2,
        {"words": ("a", "b"), "n": 1.5},
        duration_s=0.25,
        attempt=3,
        usage=[("m-1", 10, 4), ("m-2", 1, 2)],
        max_bytes=1024,
    )

    back = decode(body)

    assert back == record
    assert back.result == {"words": ["a", "b"], "n": 1.5}  # a tuple is a list, both times
    assert (back.input_tokens, back.output_tokens, back.models) == (11, 6, ["m-1", "m-2"])
    assert back.to_dict()["usage"][0] == {"model": "m-1", "input_tokens": 10, "output_tokens": 4}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("x" * 30, "32 bytes of JSON, over the limit of 31"),
        (object(), "is not JSON"),
        (float("inf"), "is not JSON"),
    ],
)
def test_a_result_over_the_bound_or_not_json_is_a_step_error(value: Any, message: str) -> None:
    with pytest.raises(StepError, match=message):
        made("s", 1, value, duration_s=0, attempt=1, usage=[], max_bytes=31)


def test_a_result_exactly_at_the_bound_is_kept() -> None:
    record, _ = made("s", 1, "x" * 29, duration_s=0, attempt=1, usage=[], max_bytes=31)
    assert record.result == "x" * 29


def test_fields_and_keys_tell_every_name_and_occurrence_apart() -> None:
    pairs = [("a", 1), ("a", 11), ("a:1", 1), ("1:a", 1), ("a", 2), ("", 1)]
    assert len({step_field(n, o) for n, o in pairs}) == len(pairs)
    assert step_key("t-1", "q", "call", 2) == "t-1:q:call:2"


@pytest.mark.parametrize("task_id", ["t-1", "}x", "{}", "a{b}c", ""])
def test_the_steps_key_is_in_the_slot_of_the_tasks_other_keys(task_id: str) -> None:
    keys = [steps_key("q", task_id), *task_keys("q", task_id)]
    assert len({_hash_tag(k) for k in keys}) == 1, keys
    # The record's key with another prefix: the record script renews the steps' TTL by it.
    assert steps_key("q", task_id).split(":", 2)[2] == state_key("q", task_id).split(":", 2)[2]
    assert steps_key("q", task_id) != guard_key("q", task_id)
    assert steps_key("a:b", "c") != steps_key("a", "b:c")


class CountingBook(MemoryStepBook):
    def __init__(self) -> None:
        super().__init__(ttl_s=60, clock=lambda: 0.0)
        self.loads = 0

    async def load(self, queue: str, task_id: str) -> dict[str, bytes]:
        self.loads += 1
        await asyncio.sleep(0)  # concurrent first steps find the read under way
        return await super().load(queue, task_id)


async def test_an_attempt_reads_its_steps_once_and_replays_from_memory() -> None:
    book = CountingBook()
    first = StepMemo(book, "q", "t")
    for occurrence in (1, 2):
        assert first.next_occurrence("call") == (occurrence, occurrence - 1)
        assert await first.recorded("call", occurrence) is None
        await first.save(*made("call", occurrence, occurrence * 10, **_plain()))
    assert book.loads == 1

    again = StepMemo(book, "q", "t")  # the next attempt
    found = await asyncio.gather(*(again.recorded("call", n) for n in (1, 2, 3)))

    assert [r.result if r else None for r in found] == [10, 20, None]
    assert book.loads == 2  # one more read, shared by the three steps
    assert [r.name for r in steps_of(await book.load("q", "t"))] == ["call", "call"]
    assert await book.load("other", "t") == {}  # per queue: another stage's steps are apart


def _plain() -> dict[str, Any]:
    return {"duration_s": 0.0, "attempt": 1, "usage": [], "max_bytes": 1000}


async def test_the_memory_book_forgets_a_tasks_steps_ttl_after_its_last_one() -> None:
    now = [0.0]
    book = MemoryStepBook(ttl_s=10, clock=lambda: now[0])
    await book.save("q", "t", "1:a", b"{}")
    now[0] = 9.9
    assert await book.load("q", "t") == {"1:a": b"{}"}
    now[0] = 10.0
    assert await book.load("q", "t") == {}


async def _write(streams: MemoryStreamStore, task_id: str, *entries: Any) -> None:
    await streams.write(task_id, list(entries), session_id=None)


def chunk(task_id: str, attempt: int, text: str) -> Any:
    return chunk_entry(task_id, attempt, encode_data(text))


async def test_emitted_is_the_text_after_the_last_marker_and_nothing_after_a_final() -> None:
    from weclaw_mq.state import TaskState, TaskStatus

    streams = MemoryStreamStore()
    assert await emitted_chunks(streams, "t") == []
    await _write(streams, "t", attempt_entry("t", 1), chunk("t", 1, "old"))
    await _write(streams, "t", attempt_entry("t", 2), chunk("t", 2, "a"), chunk("t", 2, "b"))
    await _write(streams, "t", chunk("t", 3, "c"))  # a run that continued: no marker
    assert await emitted_chunks(streams, "t") == ["a", "b", "c"]

    final = TaskState(task_id="t", queue="q", status=TaskStatus.DEAD_LETTERED)
    await streams.end("t", final_entry(final))
    assert await emitted_chunks(streams, "t") == []  # a run after it (a requeue) starts anew


async def test_emitted_reads_past_one_batch() -> None:
    streams = MemoryStreamStore()
    words = [f"w{i}" for i in range(1203)]
    await _write(streams, "t", attempt_entry("t", 1), *(chunk("t", 1, w) for w in words))
    assert await emitted_chunks(streams, "t") == words


@pytest.mark.parametrize("continues", [True, False])
async def test_a_run_that_continues_writes_no_marker_and_one_that_does_not_writes_one(
    continues: bool,
) -> None:
    streams = MemoryStreamStore()
    emitter = Emitter(
        lambda: streams, task_id="t", attempt=2, session_id=None, max_chunk_bytes=100, max_chunks=10
    )
    if continues:
        emitter.continue_text()
    await emitter.emit("x")
    await emitter.drain()
    emitter.continue_text()  # once emitted, it changes nothing

    kinds = [e.kind for e in await streams.read("t", "0-0", 0)]
    assert kinds == (["chunk"] if continues else ["attempt", "chunk"])


def test_the_task_page_lists_steps_as_text_fresh_or_cached_with_their_cost() -> None:
    from datetime import UTC, datetime

    from weclaw_mq.console import rendering
    from weclaw_mq.console.task_views import step_row
    from weclaw_mq.policy.costs import Price

    evil = "<script>alert(1)</script>"
    old, _ = made(evil, 1, 1, duration_s=0.5, attempt=1, usage=[("m-1", 1000, 2000)], **_bounded())
    run_started = datetime.now(UTC)
    new, _ = made("later", 1, 2, duration_s=0.25, attempt=2, usage=[("free", 1, 1)], **_bounded())
    prices = {"m-1": Price(input_per_1k=0.5, output_per_1k=1.5)}
    rows = [step_row(s, run_started, prices) for s in (old, new)]

    assert [(r["cached"], r["cost"]) for r in rows] == [(True, 3.5), (False, None)]
    html = rendering._env.get_template("task_status.html").render(
        task_id="t", problem=None, state=None, timeline=[], timeline_problem=None, steps=rows
    )
    assert evil not in html and "&lt;script&gt;" in html
    assert ">cached</span>" in html and "<td>fresh</td>" in html and "3.500000" in html


def _bounded() -> dict[str, Any]:
    return {"max_bytes": 100}


async def test_the_test_kit_replays_steps_and_continues_a_stream_in_memory() -> None:
    app = App("kit-steps")
    calls: list[str] = []

    def fetch() -> str:
        calls.append("fetch")
        return "page"

    @app.handler("kit-steps")
    async def agent(task: dict[str, str], ctx: Context) -> str:
        page: str = await ctx.step("fetch", fetch)
        before = await ctx.emitted()
        if ctx.attempt == 1:
            await ctx.emit("half ")
            raise Retry("broke off", after_s=1)
        await ctx.emit("done")
        return page + ":" + "".join([*before, "done"])

    async with TestBroker(app) as broker:
        task_id = await app.publish("kit-steps", {})
        await broker.run_until_idle()
        state = await app.status(task_id)
        events = await app.streams.read(task_id, "0-0", 0)

    assert state is not None and (state.result, state.attempt) == ("page:half done", 2)
    assert calls == ["fetch"]
    assert [(e.kind, e.data) for e in events] == [
        ("attempt", None),
        ("chunk", "half "),
        ("chunk", "done"),  # one marker: the retry went on (a reader appends the final)
    ]


async def test_a_fresh_steps_usage_is_billed_before_its_record_and_a_replay_bills_nothing() -> None:
    app = App("kit-bill")
    ids: list[str] = []
    billed: list[tuple[tuple[Usage, ...], list[str]]] = []

    def call(ctx: Context) -> str:
        ctx.usage(input_tokens=5, output_tokens=2, model="m-1")
        return "answer"

    @app.handler("kit-bill")
    async def agent(task: dict[str, str], ctx: Context) -> str:
        answer: str = await ctx.step("call", call, ctx)
        await ctx.step("plain", str, "no usage")  # nothing to bill
        if ctx.attempt == 1:
            raise Retry("the replay bills nothing", after_s=1)
        return answer

    async def bill(used: Sequence[Usage]) -> None:
        assert isinstance(app.store, HasSteps)
        recorded = await app.store.step_book().load("kit-bill", ids[0])
        billed.append((tuple(used), sorted(recorded)))  # what was recorded as it was billed

    token = step_billing.set(bill)  # as the LLM middleware sets it for a run (llm.calls)
    try:
        async with TestBroker(app) as broker:
            ids.append(await app.publish("kit-bill", {}))
            await broker.run_until_idle()
            state = await app.status(ids[0])
    finally:
        step_billing.reset(token)

    assert state is not None and (state.result, state.attempt) == ("answer", 2)
    assert billed == [((("m-1", 5, 2),), [])]  # once, before the step's record was written


def test_unbilled_leaves_the_calls_no_step_billed_each_billed_call_taken_once() -> None:
    usage = [MiddlewareUsage("m", 5, 2), MiddlewareUsage("m", 7, 1), MiddlewareUsage("m", 5, 2)]

    assert unbilled(usage, [("m", 5, 2)]) == [("m", 7, 1), ("m", 5, 2)]
    assert unbilled(usage, []) == [("m", 5, 2), ("m", 7, 1), ("m", 5, 2)]
    assert unbilled(usage, [("m", 5, 2), ("m", 5, 2), ("m", 7, 1)]) == []

"""Hostile input at a live worker (guard and results on): each message a hostile or foreign
producer may send ends in the DLQ with a reason or is processed, a good task sent right
behind it still succeeds at once, and the worker never stops."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel
from hypothesis import example, given
from pydantic import BaseModel

from tests.conftest import get_message, next_message, outcome_count, queue_depth, wait_until
from tests.hostile import bodies, fuzz_settings, nested, properties
from weclaw_mq import App
from weclaw_mq.contract import header_values
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.state import TaskStatus
from weclaw_mq.worker import Worker

# The canary is acked; the hostile message acked (processed) or moved to the DLQ, never
# retried, parked or given back.
_ENDS = {Outcome.ACKED, Outcome.DEAD_LETTERED}
MAX_BYTES = 16 * 1024  # small, so bodies past the limit stay cheap to send


class Prompt(BaseModel):
    text: str


async def test_hostile_messages_end_in_the_dlq_or_succeed_and_delay_nothing(
    make_app: Callable[..., App],
    qname: str,
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
) -> None:
    app = make_app("hostile", max_message_bytes=MAX_BYTES, concurrency=2)
    done: list[str] = []

    @app.handler(qname)
    async def work(task: Prompt) -> dict[str, int]:
        done.append(task.text)
        return {"chars": len(task.text)}

    worker: Worker = await start_worker(app)
    dlq = dlq_name(qname)
    canaries = 0

    @fuzz_settings(25, shrink=False)
    @given(props=properties(), body=bodies(MAX_BYTES))
    @example(props={"headers": {h.ATTEMPT: "3"}, "message_id": "a\nb"}, body=b'{"text":"x"}')
    @example(props={"headers": {h.ATTEMPT: -5, h.TRACE_ID: "t" * 10_000}}, body=b"{}")
    @example(props={"headers": {h.TRACE_ID: "\x00\n"}}, body=nested(10**4))
    @example(props={"headers": {h.EXPIRES_AT: 2**62}}, body=b'{"text":"far"}')
    @example(props={}, body=b'{"text":"' + b"y" * MAX_BYTES + b'"}')
    @example(props={"content_type": "text/plain"}, body="é".encode("latin-1"))
    def one(props: dict[str, Any], body: bytes) -> None:
        # Hypothesis runs examples synchronously: this thread hands each to the test's loop.
        asyncio.run_coroutine_threadsafe(send(props, body), loop).result(timeout=60)

    async def send(props: dict[str, Any], body: bytes) -> None:
        nonlocal canaries
        before = {o: outcome_count(app, qname, o) for o in Outcome}
        # Unique, so no example is a duplicate of another. aiormq gives a message without an
        # id a random one, from the random module Hypothesis seeds alike for every example.
        headers = props.get("headers") or {}
        if h.SESSION_ID in headers and header_values.checked({h.SESSION_ID: headers[h.SESSION_ID]}):
            # A valid session id would write an inbox in the shared Redis, under a name other
            # tests may use: only invalid ones are sent here (the stream tests cover the rest).
            props = {**props, "headers": {**headers, h.SESSION_ID: "{not valid}"}}
        unique = uuid.uuid4().hex[:8] + (props.get("message_id") or "")
        props = {**props, "message_id": unique.encode()[:255].decode(errors="ignore")}
        await amqp.default_exchange.publish(aio_pika.Message(body, **props), routing_key=qname)
        # A good task right behind it: processed at once, whatever the one before did.
        canary = await app.publish(qname, Prompt(text="canary"))
        canaries += 1
        state = await app.result(canary, timeout_s=10)
        assert state.status is TaskStatus.SUCCEEDED, state

        # The hostile one ended too: processed, or in the DLQ (nothing retried, parked, lost).
        def ended() -> bool:
            now = {o: outcome_count(app, qname, o) - before[o] for o in Outcome}
            assert not any(now[o] for o in Outcome if o not in _ENDS), now
            return sum(now.values()) == 2

        await wait_until(ended, 10, "the hostile message to end")
        assert worker.ready.is_set(), "the worker stopped consuming"

    loop = asyncio.get_running_loop()
    await asyncio.to_thread(one)
    assert done.count("canary") == canaries
    assert await queue_depth(amqp, qname) == 0
    while (dead := await get_message(amqp, dlq)) is not None:
        assert (dead.headers or {}).get(h.DEAD_LETTER_REASON), dead.headers


async def test_a_body_over_max_message_bytes_is_dead_lettered_unparsed(
    make_app: Callable[..., App],
    qname: str,
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
) -> None:
    app = make_app("hostile", max_message_bytes=MAX_BYTES)
    ran: list[int] = []

    @app.handler(qname)
    async def work(task: Prompt) -> None:
        ran.append(len(task.text))

    await start_worker(app)
    body = b'{"text":"' + b"y" * MAX_BYTES + b'"}'  # valid, but another producer's and too big
    await amqp.default_exchange.publish(aio_pika.Message(body), routing_key=qname)
    dead = await next_message(amqp, dlq_name(qname))
    assert dead.body == body and ran == []
    headers = dead.headers or {}
    assert headers[h.DEAD_LETTER_REASON] == "invalid_payload"
    assert f"over max_message_bytes ({MAX_BYTES})" in str(headers[h.ERROR_MESSAGE])

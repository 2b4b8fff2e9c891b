"""Looking at a DLQ never changes or endangers it, and one odd message never fails the rest.

The DLQ holds three kinds of dead letters, all real messages in a real quorum queue: one our
worker would write, one from another producer with header values of unexpected types, and
one RabbitMQ itself dead-lettered at its delivery limit.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from pydantic import BaseModel

from tests.conftest import get_message, next_message, queue_depth, wait_until
from tests.integration.processes import run_cli, settings_env
from tests.integration.raw_amqp import publish_undecodable
from weclaw_mq import App
from weclaw_mq.admin import dlq
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name

LOOKS = 25  # past RabbitMQ 4.0's default quorum delivery limit of 20

# What a reader sees of a message, beyond its headers.
PROPERTIES = (
    "body",
    "message_id",
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "timestamp",
    "type",
    "user_id",
    "app_id",
    "redelivered",
)


class Prompt(BaseModel):
    text: str


def ours() -> aio_pika.Message:
    return aio_pika.Message(
        b'{"text": "doc-1"}',
        message_id="ours-1",
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=datetime(2026, 11, 30, 12, 0, tzinfo=UTC),
        headers={
            h.TRACE_ID: "trace-1",
            h.ATTEMPT: 2,
            h.DEAD_LETTER_REASON: "retries_exhausted",
            h.ERROR_TYPE: "builtins.RuntimeError",
            h.ERROR_MESSAGE: "model down",
            h.ERROR_TRACEBACK: "Traceback ...\nRuntimeError: model down\n",
            h.ORIGINAL_QUEUE: "q",
            h.FIRST_FAILURE_AT: "2026-11-30T11:59:00+00:00",
            h.LAST_FAILURE_AT: "2026-11-30T12:00:00+00:00",
        },
    )


# Header values another producer may write where we expect text, numbers or x-death's list.
ODD_HEADERS: dict[str, Any] = {
    h.X_DEATH: 7,
    h.DEAD_LETTER_REASON: 5,
    h.ATTEMPT: "three",
    h.ERROR_TYPE: bytearray(b"\xff\xfe not utf-8"),
    h.ERROR_MESSAGE: {"nested": {"table": [1, "two", None]}},
    h.FIRST_FAILURE_AT: datetime(2026, 11, 30, 10, 0, tzinfo=UTC),
    h.LAST_FAILURE_AT: 1234567890,
    h.TRACE_ID: ["a", "list"],
    h.ORIGINAL_QUEUE: True,
    "x-amount": Decimal("12.50"),
    "x-ratio": 0.25,
    "x-big": 2**40,
    "x-negative": -3,
    "x-nothing": None,
}


def odd() -> aio_pika.Message:
    return aio_pika.Message(
        b"\x00\xff binary body",
        message_id="odd-2",
        content_type="application/octet-stream",
        content_encoding="identity",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=3,
        correlation_id="corr-2",
        reply_to="somewhere",
        type="foreign.event",
        app_id="another-producer",
        user_id="guest",
        timestamp=datetime(2026, 11, 30, 12, 1, tzinfo=UTC),
        headers=ODD_HEADERS,
    )


def without_delivery_count(headers: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in headers.items() if k != h.X_DELIVERY_COUNT}


def seen(message: AbstractIncomingMessage) -> dict[str, Any]:
    """Everything a reader sees of ``message``."""
    view = {name: getattr(message, name) for name in PROPERTIES}
    view["headers"] = dict(message.headers or {})
    return view


@dataclass
class OddDlq:
    app: App
    queue: str
    ids: list[str]  # in queue order
    before: dict[str, dict[str, Any]]  # task id -> what a reader saw before any look


@pytest.fixture
async def odd_dlq(make_app: Callable[..., App], qname: str, amqp: AbstractChannel) -> OddDlq:
    app = make_app()

    @app.handler(qname, delivery_limit=1)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in these tests")

    await app.declare()
    for message in (ours(), odd()):  # aio-pika channels confirm by default
        await amqp.default_exchange.publish(message, routing_key=dlq_name(qname))
    # The third: a task whose consumer died on it twice; the quorum queue dead-letters it.
    await app.publish(qname, Prompt(text="crash loop"), task_id="loop-3", trace_id="trace-3")
    for _ in range(2):
        taken = await next_message(amqp, qname, no_ack=False)
        await taken.nack(requeue=True)
    await wait_until(
        lambda: queue_depth(amqp, dlq_name(qname)), 10, "the broker to dead-letter loop-3"
    )
    await wait_until(lambda: _depth_is(amqp, dlq_name(qname), 3), 10, "three dead letters")
    # What a reader saw of the first two is what was published; of the broker's own, the
    # headers it wrote, read once through the library (a plain get would change it).
    before = {m.message_id: _published_view(m) for m in (ours(), odd())}
    [*_, loop] = await dlq.inspect(app, qname)
    before["loop-3"] = {"headers": without_delivery_count(loop.headers), "body": loop.body}
    return OddDlq(app, qname, ["ours-1", "odd-2", "loop-3"], before)


async def _depth_is(channel: AbstractChannel, queue: str, n: int) -> bool:
    return await queue_depth(channel, queue) == n


def _published_view(message: aio_pika.Message) -> dict[str, Any]:
    view = {name: getattr(message, name) for name in PROPERTIES if name != "redelivered"}
    view["headers"] = dict(message.headers or {})
    return view


async def drain(channel: AbstractChannel, queue: str) -> list[AbstractIncomingMessage]:
    out = []
    while (message := await get_message(channel, queue)) is not None:
        out.append(message)
    return out


async def test_25_rounds_of_list_show_export_leave_every_dead_letter_identical_and_in_order(
    odd_dlq: OddDlq, amqp: AbstractChannel, tmp_path: Path
) -> None:
    app, queue = odd_dlq.app, odd_dlq.queue
    path = tmp_path / "dead.jsonl"

    for look in range(LOOKS):
        listed = await dlq.inspect(app, queue)
        assert [d.task_id for d in listed] == odd_dlq.ids, f"look {look}"
        shown = await dlq.find(app, queue, "odd-2")
        assert shown is not None
        assert without_delivery_count(shown.headers) == ODD_HEADERS
        assert shown.headers.get(h.X_DELIVERY_COUNT, 0) == 0  # never handed back
        assert await dlq.export(app, queue, path) == 3
        exported = [json.loads(line)["task_id"] for line in path.read_text().splitlines()]
        assert exported == odd_dlq.ids, f"look {look}"

    # The CLI reads the same way (and shows the odd message instead of failing on it).
    env = settings_env(app.settings)
    cli_list = await run_cli("dlq", "list", queue, env=env)
    assert cli_list.code == 0, cli_list.stderr
    assert [r.split()[0] for r in cli_list.stdout.splitlines()[1:]] == odd_dlq.ids
    cli_show = await run_cli("dlq", "show", queue, "odd-2", env=env)
    assert cli_show.code == 0, cli_show.stderr

    after = await drain(amqp, dlq_name(queue))

    assert [m.message_id for m in after] == odd_dlq.ids
    for message in after:
        view = seen(message)
        assert view["redelivered"] is False
        # 3.10 shows a basic.get of a never-returned message "x-delivery-count: 0"; 26 before.
        assert view["headers"].get(h.X_DELIVERY_COUNT, 0) == 0, view["headers"]
        view["headers"] = without_delivery_count(view["headers"])
        expected = odd_dlq.before[message.message_id or ""]
        for name, value in expected.items():
            assert view[name] == value, (message.message_id, name)


async def test_an_odd_message_is_listed_exported_and_requeued_with_the_others(
    odd_dlq: OddDlq, amqp: AbstractChannel, tmp_path: Path
) -> None:
    app, queue = odd_dlq.app, odd_dlq.queue

    listed = {d.task_id: d for d in await dlq.inspect(app, queue)}
    strange = listed["odd-2"]
    assert strange.reason == "unknown"  # the reason header is not text: not ours to read
    assert strange.attempts is None and strange.trace_id is None
    assert strange.first_failure_at == datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    assert strange.headers[h.X_DEATH] == 7
    assert listed["loop-3"].reason == "delivery_limit"
    assert listed["ours-1"].reason == "retries_exhausted"
    # Written before stable error names ("builtins.RuntimeError"): read as the stable name.
    assert listed["ours-1"].error_type == "RuntimeError"
    assert listed["ours-1"].headers[h.ERROR_TYPE] == "builtins.RuntimeError"  # as it came

    path = tmp_path / "dead.jsonl"
    assert await dlq.export(app, queue, path) == 3
    record = [json.loads(line) for line in path.read_text().splitlines()][1]
    assert record["task_id"] == "odd-2" and record["body_encoding"] == "base64"
    assert record["headers"]["x-amount"] == "12.50"

    assert await dlq.requeue(app, queue) == 3

    moved = await drain(amqp, queue)
    assert [m.message_id for m in moved] == odd_dlq.ids
    copy = moved[1]
    assert copy.body == b"\x00\xff binary body"
    assert copy.headers is not None and copy.headers["x-amount"] == Decimal("12.50")
    assert copy.headers[h.ATTEMPT] == 1 and copy.headers[h.REQUEUED] == 1
    assert await queue_depth(amqp, dlq_name(queue)) == 0


async def test_requeue_by_task_id_leaves_the_others_identical_and_in_order(
    odd_dlq: OddDlq, amqp: AbstractChannel
) -> None:
    app, queue = odd_dlq.app, odd_dlq.queue

    assert await dlq.requeue(app, queue, task_ids=["odd-2"]) == 1

    [moved] = await drain(amqp, queue)
    assert moved.message_id == "odd-2"
    left = await drain(amqp, dlq_name(queue))
    assert [m.message_id for m in left] == ["ours-1", "loop-3"]
    for m in left:
        assert not m.redelivered and (m.headers or {}).get(h.X_DELIVERY_COUNT, 0) == 0
    assert without_delivery_count(seen(left[0])["headers"]) == odd_dlq.before["ours-1"]["headers"]


async def test_25_looks_at_well_formed_dead_letters_never_raise_their_delivery_count(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel, tmp_path: Path
) -> None:
    app = make_app()

    @app.handler(qname)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    await amqp.default_exchange.publish(ours(), routing_key=dlq_name(qname))

    for _ in range(LOOKS):
        assert [d.task_id for d in await dlq.inspect(app, qname)] == ["ours-1"]
        assert await dlq.find(app, qname, "ours-1") is not None
        assert await dlq.export(app, qname, tmp_path / "dead.jsonl") == 1

    [after] = await drain(amqp, dlq_name(qname))
    view = seen(after)
    assert view["redelivered"] is False
    assert view["headers"].get(h.X_DELIVERY_COUNT, 0) == 0, view["headers"]
    assert without_delivery_count(view["headers"]) == dict(ours().headers or {})
    assert view["body"] == ours().body and view["timestamp"] == ours().timestamp


async def test_a_message_whose_properties_cannot_be_decoded_is_listed_kept_intact_and_skipped(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel, broker_url: str
) -> None:
    app = make_app()

    @app.handler(qname)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    await amqp.default_exchange.publish(ours(), routing_key=dlq_name(qname))
    await publish_undecodable(
        broker_url,
        dlq_name(qname),
        b'{"text": "bad properties"}',
        headers={"x-weclaw-trace-id": "trace-bad"},
    )
    tail = ours()
    tail.message_id = "tail-3"
    await amqp.default_exchange.publish(tail, routing_key=dlq_name(qname))

    first = await dlq.inspect(app, qname)
    assert [d.reason for d in first] == [
        "retries_exhausted",
        "undecodable_properties",
        "retries_exhausted",
    ]
    bad = first[1]
    raw = bytes(bad.headers[h.UNDECODABLE_PROPERTIES])
    assert b"\xff\xfe\xfd\xfc" in raw
    assert bad.error_message is not None and "utf-8" in bad.error_message
    assert bad.body == b'{"text": "bad properties"}'

    for _ in range(5):
        again = await dlq.inspect(app, qname)
        assert [d.task_id for d in again] == ["ours-1", "", "tail-3"]
        assert bytes(again[1].headers[h.UNDECODABLE_PROPERTIES]) == raw  # byte for byte

    listed = await run_cli("dlq", "list", qname, env=settings_env(app.settings))
    assert listed.code == 0, listed.stderr
    assert "undecodable_properties" in listed.stdout

    assert await dlq.requeue(app, qname) == 2

    [left] = await dlq.inspect(app, qname)
    assert left.reason == "undecodable_properties"
    assert bytes(left.headers[h.UNDECODABLE_PROPERTIES]) == raw
    assert sorted(m.message_id or "" for m in await drain(amqp, qname)) == ["ours-1", "tail-3"]


async def test_a_dead_letter_whose_properties_cannot_be_decoded_exports_and_imports_intact(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel, broker_url: str
) -> None:
    app = make_app()

    @app.handler(qname)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    await publish_undecodable(broker_url, dlq_name(qname), b'{"text": "bad properties"}')
    await amqp.default_exchange.publish(ours(), routing_key=dlq_name(qname))
    [bad, _] = await dlq.inspect(app, qname)
    raw = bytes(bad.headers[h.UNDECODABLE_PROPERTIES])
    lines = io.StringIO()
    assert await dlq.export(app, qname, lines) == 2
    assert await dlq.purge(app, qname) == 2

    # The import's check reads the bytes as RabbitMQ does: a message id that is not UTF-8
    # passes in the record of an undecodable dead letter, and goes back as it came.
    assert await dlq.import_records(app, qname, lines.getvalue().splitlines()) == 2

    [back, good] = await dlq.inspect(app, qname)
    assert back.reason == "undecodable_properties"
    assert bytes(back.headers[h.UNDECODABLE_PROPERTIES]) == raw
    assert good.task_id == "ours-1"

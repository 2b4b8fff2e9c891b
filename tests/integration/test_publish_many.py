"""publish_many: one channel, pipelined confirms, and exact news of what was not stored."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import aio_pika
import pytest
from pydantic import BaseModel

from tests.conftest import delete_queues, get_message
from weclaw_mq import (
    App,
    BatchPublishError,
    ConfigurationError,
    PayloadValidationError,
    PublishNackedError,
    TaskStatus,
    UnroutableError,
)


class Prompt(BaseModel):
    text: str


async def _drain_ids(channel: aio_pika.abc.AbstractChannel, queue: str) -> list[str]:
    """Every message id in ``queue``, in queue order (messages are acked: the test owns Q)."""
    ids: list[str] = []
    while (message := await get_message(channel, queue)) is not None:
        assert message.message_id is not None
        ids.append(message.message_id)
    return ids


async def _declared(make_app: Callable[..., App], qname: str, **options: object) -> App:
    app = make_app()

    @app.handler(qname, **options)  # type: ignore[arg-type]
    async def reply(task: Prompt) -> None:
        return None

    await app.declare()
    return app


async def test_publish_many_returns_the_task_ids_in_order_and_all_are_stored(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _declared(make_app, qname)
    ids = await app.publish_many(qname, [Prompt(text=f"p{i}") for i in range(50)])
    assert len(ids) == len(set(ids)) == 50
    assert await _drain_ids(amqp, qname) == ids
    states = [await app.status(t) for t in ids]
    assert all(s is not None and s.status is TaskStatus.QUEUED for s in states)


async def test_publish_many_keeps_given_task_ids(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _declared(make_app, qname)
    given = [f"batch-{uuid.uuid4()}" for _ in range(3)]
    ids = await app.publish_many(qname, [Prompt(text="a")] * 3, task_ids=given)
    assert ids == given
    assert await _drain_ids(amqp, qname) == given


async def test_a_partly_full_queue_names_each_refused_message_and_stores_the_rest(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    # A quorum queue's length limit is soft: a burst overshoots it before the leader refuses
    # (measured: room for 50 took 62-77 of 100; once, in a loaded full run, room for 10 took
    # a whole batch of 200). Batches go on until one is refused; each earlier one was whole.
    app = await _declared(make_app, qname, max_length=10)
    accepted: list[str] = []
    error: BatchPublishError | None = None
    for batch in range(5):
        try:
            accepted += await app.publish_many(
                qname, [Prompt(text=f"b{batch}-p{i}") for i in range(200)]
            )
        except BatchPublishError as refused_batch:
            error = refused_batch
            break
    assert error is not None, f"a queue of 10 took {len(accepted)} messages"
    assert error.failed, "a queue of 10 took 200 messages"
    assert error.confirmed or accepted, "an empty queue refused everything"
    assert all(isinstance(e, PublishNackedError) for e in error.failed.values())
    assert len(error.confirmed) + len(error.failed) == 200
    stored = await _drain_ids(amqp, qname)
    confirmed = accepted + error.confirmed
    assert sorted(stored) == sorted(confirmed), "confirmed and stored must be the same set"
    refused = [error.task_ids[i] for i in error.failed]
    assert not set(refused) & set(stored)
    # A refused task never existed: no status may claim it is queued.
    assert all([await app.status(t) is None for t in refused])


async def test_a_batch_to_a_missing_queue_reports_every_message_unroutable(
    make_app: Callable[..., App], broker_url: str
) -> None:
    app = make_app()
    missing = f"t-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(BatchPublishError) as caught:
        await app.publish_many(missing, [{"n": i} for i in range(5)])
    assert sorted(caught.value.failed) == [0, 1, 2, 3, 4]
    assert all(isinstance(e, UnroutableError) for e in caught.value.failed.values())
    assert caught.value.confirmed == []
    await delete_queues(broker_url, [missing])  # in case a broker ever auto-created it


async def test_one_invalid_payload_refuses_the_whole_batch_before_sending(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _declared(make_app, qname)
    with pytest.raises(PayloadValidationError):
        await app.publish_many(qname, [{"text": "ok"}, {"wrong": 1}, {"text": "ok"}])
    assert await _drain_ids(amqp, qname) == []


async def test_task_ids_of_another_length_than_the_payloads_are_refused(
    make_app: Callable[..., App], qname: str
) -> None:
    app = await _declared(make_app, qname)
    with pytest.raises(ConfigurationError):
        await app.publish_many(qname, [Prompt(text="a")], task_ids=["x", "y"])
    assert await app.publish_many(qname, []) == []

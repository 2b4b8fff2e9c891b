"""Confirmed publishing against the real broker: what lands, and every way it refuses."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import pytest
from pydantic import BaseModel

from tests.conftest import (
    close_connections,
    delete_queues,
    forget_task_keys,
    get_message,
    queue_depth,
)
from weclaw_mq import (
    App,
    ConnectionLostError,
    PayloadError,
    PayloadTooLargeError,
    PayloadValidationError,
    PublishFailedError,
    PublishNackedError,
    TaskStatus,
    UnroutableError,
    WeclawMQError,
)
from weclaw_mq.contract import headers as h


class Prompt(BaseModel):
    text: str


async def _app_with_prompt_handler(
    make_app: Callable[..., App],
    qname: str,
    *,
    max_length: int | None = None,
    **settings: object,
) -> App:
    app = make_app(**settings)

    @app.handler(qname, max_length=max_length)
    async def summarise(task: Prompt) -> None:
        return None

    await app.declare()
    return app


async def test_publish_returns_the_task_id_of_a_stored_persistent_json_message(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname)

    task_id = await app.publish(qname, Prompt(text="hello"))

    # publish returned only after the confirm, so the message is already in the queue
    message = await get_message(amqp, qname)
    assert message is not None, "a confirmed publish must already be in the queue"
    assert message.message_id == task_id
    uuid.UUID(task_id)  # a uuid unless the producer gives one
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.content_type == "application/json"
    assert message.timestamp is not None
    assert Prompt.model_validate_json(message.body) == Prompt(text="hello")
    headers = message.headers or {}
    assert isinstance(headers[h.TRACE_ID], str) and headers[h.TRACE_ID]
    assert headers[h.ATTEMPT] == 1


async def test_publish_keeps_the_given_task_id_trace_id_and_extra_headers(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname)
    # task ids key the result store too: unique per run, never a shared constant
    given = f"order-{uuid.uuid4()}"

    task_id = await app.publish(
        qname,
        {"text": "hi"},
        task_id=given,
        trace_id="trace-abc",
        headers={"x-tenant": "acme"},
    )

    assert task_id == given
    message = await get_message(amqp, qname)
    assert message is not None
    assert message.message_id == given
    headers = message.headers or {}
    assert headers[h.TRACE_ID] == "trace-abc"
    assert headers[h.ATTEMPT] == 1
    assert headers["x-tenant"] == "acme"


async def test_two_publishes_get_different_task_and_trace_ids(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname)

    first = await app.publish(qname, Prompt(text="a"))
    second = await app.publish(qname, Prompt(text="b"))

    assert first != second
    m1, m2 = await get_message(amqp, qname), await get_message(amqp, qname)
    assert m1 is not None and m2 is not None
    assert [m1.message_id, m2.message_id] == [first, second]
    assert (m1.headers or {})[h.TRACE_ID] != (m2.headers or {})[h.TRACE_ID]


async def _fill(app: App, queue: str) -> list[str]:
    """Publish until the broker starts refusing; returns the ids it accepted.

    A quorum queue checks its length before it enqueues, so ``max_length=1`` admits a second
    message and refuses from the third on (measured on RabbitMQ 3.10); we do not bake in which.
    """
    accepted: list[str] = []
    for i in range(3):
        try:
            accepted.append(await app.publish(queue, Prompt(text=f"filler {i}")))
        except PublishNackedError:
            return accepted
    raise AssertionError(f"a queue with max_length=1 accepted {len(accepted)} messages")


async def test_publish_to_a_full_queue_is_nacked(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname, max_length=1)
    kept = await _fill(app, qname)
    assert 1 <= len(kept) <= 2

    with pytest.raises(PublishNackedError) as info:
        await app.publish(qname, Prompt(text="one too many"), task_id=f"{qname}-overflow")

    assert info.value.queue == qname
    assert info.value.task_id == f"{qname}-overflow"
    # reject-publish: the queue kept what it accepted and stored nothing it refused
    assert await queue_depth(amqp, qname) == len(kept)
    stored = [await get_message(amqp, qname) for _ in kept]
    assert [m.message_id for m in stored if m is not None] == kept


async def test_publish_to_a_missing_queue_is_unroutable(
    make_app: Callable[..., App], qname: str
) -> None:
    app = make_app()

    with pytest.raises(UnroutableError) as info:
        await app.publish(qname, {"text": "nobody listens"}, task_id=f"{qname}-lost")

    assert info.value.queue == qname
    assert info.value.task_id == f"{qname}-lost"
    assert qname in str(info.value)


async def test_oversized_payload_is_refused_before_sending(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname, max_message_bytes=64)

    with pytest.raises(PayloadTooLargeError) as info:
        await app.publish(qname, Prompt(text="x" * 100))

    assert info.value.limit == 64
    assert info.value.size > 64
    assert await queue_depth(amqp, qname) == 0
    # a payload at the limit still goes through: the limit is on size, not a blanket refusal
    await app.publish(qname, Prompt(text="ok"))
    assert await queue_depth(amqp, qname) == 1


async def test_payload_failing_the_handler_model_is_refused_before_sending(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname)

    with pytest.raises(PayloadValidationError, match="text"):
        await app.publish(qname, {"prompt": "wrong field"})

    assert await queue_depth(amqp, qname) == 0


async def test_payload_that_is_not_json_serialisable_is_refused(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname)

    with pytest.raises(PayloadError):
        await app.publish(qname, {"text": object()})

    assert await queue_depth(amqp, qname) == 0


async def test_app_publishes_again_after_a_refused_publish(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    app = await _app_with_prompt_handler(make_app, qname, max_length=1)
    missing = f"{qname}-missing"

    kept = await _fill(app, qname)
    with pytest.raises(UnroutableError):
        await app.publish(missing, {"text": "unroutable"})
    with pytest.raises(PublishNackedError):
        await app.publish(qname, Prompt(text="refused"))

    # make room, then the same App must publish again on a working channel
    for _ in kept:
        assert await get_message(amqp, qname) is not None
    task_id = await app.publish(qname, Prompt(text="after the errors"))

    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == task_id


async def test_refused_publish_leaves_no_queued_status_behind(
    make_app: Callable[..., App], qname: str
) -> None:
    # The caller was told nothing is stored; a "queued" status would tell status() readers
    # the opposite for the next 24 h.
    app = await _app_with_prompt_handler(make_app, qname, max_length=1)
    await _fill(app, qname)
    nacked, unroutable, too_big = (f"{qname}-{n}" for n in ("nacked", "unroutable", "big"))

    with pytest.raises(PayloadTooLargeError):
        await app.publish(qname, Prompt(text="x" * 2_000_000), task_id=too_big)
    with pytest.raises(UnroutableError):
        await app.publish(f"{qname}-missing", {"text": "?"}, task_id=unroutable)
    with pytest.raises(PublishNackedError):
        await app.publish(qname, Prompt(text="refused"), task_id=nacked)

    assert await app.status(too_big) is None
    assert await app.status(unroutable) is None, "unroutable task reported as queued"
    assert await app.status(nacked) is None, "nacked task reported as queued"


async def test_app_publishes_again_after_the_broker_closed_its_connection(
    make_app: Callable[..., App], qname: str, amqp: aio_pika.abc.AbstractChannel
) -> None:
    # Named after the queue: the connection to close is found by its name.
    app = await _app_with_prompt_handler(make_app, qname, name=qname)
    await app.publish(qname, Prompt(text="opens the producer connection"))
    assert await asyncio.to_thread(close_connections, f"{qname}-producer") == 1

    # The client may or may not have seen the close yet: one publish may fail with
    # ConnectionLostError (outcome unknown), the next must open a fresh connection and work.
    try:
        task_id = await app.publish(qname, Prompt(text="after the close"))
    except ConnectionLostError:
        task_id = await app.publish(qname, Prompt(text="after the close"))

    two = [await get_message(amqp, qname), await get_message(amqp, qname)]
    ids = [m.message_id for m in two if m]
    assert task_id in ids


async def test_publish_reaches_a_queue_the_app_has_no_handler_for(
    make_app: Callable[..., App],
    qname: str,
    broker_url: str,
    redis_url: str,
    amqp: aio_pika.abc.AbstractChannel,
) -> None:
    app = make_app()
    await amqp.declare_queue(qname, durable=True, arguments={"x-queue-type": "quorum"})
    try:
        # no handler, so no model check: any JSON goes
        task_id = await app.publish(qname, {"anything": [1, 2, 3]})
        message = await get_message(amqp, qname)
        assert message is not None and message.message_id == task_id
        assert message.body == b'{"anything":[1,2,3]}'
    finally:
        await delete_queues(broker_url, [qname])
        await forget_task_keys(redis_url, [qname])


@pytest.mark.parametrize(
    "error",
    [
        PayloadTooLargeError,
        PayloadValidationError,
        PayloadError,
        PublishFailedError,
        ConnectionLostError,
        PublishNackedError,
        UnroutableError,
    ],
)
def test_every_publish_error_is_a_weclaw_mq_error(error: type[Exception]) -> None:
    assert issubclass(error, WeclawMQError)


async def test_the_queued_record_of_a_publish_is_started_with_no_task_of_its_own(
    make_app: Callable[..., App], qname: str
) -> None:
    """With results on, the "queued" record leaves with the store's next pipeline batch, not
    from a task scheduled for it (a loop iteration later, often after the broker's confirm,
    which the publish then waited past): at most the pipeline's own send per publish."""
    plain = await _app_with_prompt_handler(make_app, qname, results_enabled=False)
    with_results = await _app_with_prompt_handler(make_app, qname, results_enabled=True)
    loop = asyncio.get_running_loop()
    created: list[str] = []

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(getattr(coro, "__qualname__", "?"))
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def tasks_per_publish(app: App, n: int = 20) -> float:
        await app.publish(qname, Prompt(text="warm"))  # connections, scripts
        del created[:]
        loop.set_task_factory(counting)
        try:
            ids = [await app.publish(qname, Prompt(text=str(i))) for i in range(n)]
        finally:
            loop.set_task_factory(None)
        if app is with_results:  # the rule holds: a returned publish has its record
            for task_id in ids:
                state = await app.status(task_id, queue=qname)
                assert state is not None and state.status is TaskStatus.QUEUED
        return len(created) / n

    base = await tasks_per_publish(plain)
    results_on = await tasks_per_publish(with_results)
    assert results_on - base <= 1, (
        f"a publish with results on made {results_on - base:.1f} more tasks than one with "
        f"results off: {sorted(set(created))}"
    )

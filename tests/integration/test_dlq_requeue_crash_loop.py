"""A task dead-lettered for crashing its workers runs again once an operator requeues it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import outcome_count, queue_depth, wait_until
from weclaw_mq import App, TaskStatus
from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_message import requeue_headers
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.message import build_message
from weclaw_mq.contract.naming import dlq_name


class Prompt(BaseModel):
    text: str


async def test_requeued_crash_loop_task_runs_again_instead_of_dying_on_its_old_return_count(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app()
    ran: list[str] = []

    @app.handler(qname, delivery_limit=2)
    async def summarise(task: Prompt) -> dict[str, str]:
        ran.append(task.text)
        return {"summary": task.text.upper()}

    await app.declare()
    # The copy of a task whose workers died on it three times, carried through a delay
    # queue hop in our return-count header (the path message.read_delivery sums up).
    task_id = "crash-loop-1"
    await amqp.default_exchange.publish(
        build_message(
            b'{"text": "fixed now"}',
            task_id=task_id,
            headers={h.RETURNS: 3, h.ATTEMPT: 1, h.TRACE_ID: "trace-crash"},
        ),
        routing_key=qname,
    )
    await start_worker(app)
    await wait_until(
        lambda: outcome_count(app, qname, "dead_lettered") == 1, 15, "the crash-loop dead letter"
    )
    [letter] = await dlq.inspect(app, qname)
    assert letter.reason == "delivery_limit"
    assert ran == []  # dead-lettered for its returns, never run

    # The operator fixed the crash; the requeued copy must run, not die again on arrival.
    assert await dlq.requeue(app, qname) == 1

    state = await app.result(task_id, timeout_s=15)
    assert state.status is TaskStatus.SUCCEEDED, state
    assert state.result == {"summary": "FIXED NOW"}
    assert ran == ["fixed now"]
    assert outcome_count(app, qname, "dead_lettered") == 1
    assert await queue_depth(amqp, dlq_name(qname)) == 0


def test_requeue_headers_drop_the_carried_return_count_and_the_brokers_delivery_count() -> None:
    out = requeue_headers(
        {h.RETURNS: 11, h.X_DELIVERY_COUNT: 4, h.TRACE_ID: "t", h.ATTEMPT: 3, "custom": "kept"}
    )

    assert h.RETURNS not in out and h.X_DELIVERY_COUNT not in out
    assert out == {h.TRACE_ID: "t", h.ATTEMPT: 1, h.REQUEUED: 1, "custom": "kept"}

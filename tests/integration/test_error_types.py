"""The error type on a dead letter is the documented stable name, whatever raised it.

``x-weclaw-error-type`` is part of the wire format (docs/reference/errors.md): an
operator's filter on it must keep matching after our modules move. Each kind below is
dead-lettered by a real worker and read back from the broker's ``Q.dlq``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import ignoring_cancels, next_message
from weclaw_mq import App, ConfigurationError, Reject, Retry, RetryPolicy
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name

NO_RETRIES = RetryPolicy(max_retries=0, delay_s=0.05)
DELIVERY_LIMIT = 3


class Job(BaseModel):
    kind: str


class UsersOwnError(ConfigurationError):
    """A user's subclass of one of ours is the user's: named by its own class name."""


class Unstorable:
    """A return value that is not JSON."""


# kind -> the error type its dead letter must carry (docs/reference/errors.md's table; our
# names start with "weclaw_mq.", a user's exception is its class __name__).
EXPECTED = {
    "user-error": "RuntimeError",
    "user-subclass": "UsersOwnError",
    "reject": "weclaw_mq.Reject",
    "retry": "weclaw_mq.Retry",
    "timeout": "weclaw_mq.HandlerTimeout",
    "abandoned": "weclaw_mq.HandlerAbandoned",
    "unserialisable": "weclaw_mq.UnserialisableResult",
    "invalid-payload": "weclaw_mq.InvalidPayload",
    "undecodable": "weclaw_mq.UndecodableBody",
    "crash-loop": "weclaw_mq.WorkerCrashLoop",
}


async def test_each_kind_of_failure_is_dead_lettered_under_its_documented_error_type(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app(handler_cancel_grace_s=0.3)
    release = asyncio.Event()  # lets the abandoned handler end at teardown

    @app.handler(qname, retry=NO_RETRIES, timeout_s=0.5, delivery_limit=DELIVERY_LIMIT)
    async def fails(task: Job) -> object:
        match task.kind:
            case "user-error":
                raise RuntimeError("model API down")
            case "user-subclass":
                raise UsersOwnError("the user's own")
            case "reject":
                raise Reject("bad prompt")
            case "retry":
                raise Retry("busy")
            case "timeout":
                await asyncio.sleep(30)
            case "abandoned":
                await ignoring_cancels(release)
            case "unserialisable":
                return Unstorable()
        return None

    await start_worker(app, concurrency=4)
    try:
        for kind in EXPECTED:
            if kind == "undecodable":
                body = b"{not json"
            elif kind == "invalid-payload":
                body = b'{"no_kind": 1}'
            else:
                body = Job(kind=kind).model_dump_json().encode()
            # Published raw, as a foreign producer would (App.publish refuses bad bodies); the
            # crash loop arrives with its carried return count past the delivery limit.
            returns = {h.RETURNS: DELIVERY_LIMIT + 1} if kind == "crash-loop" else {}
            await amqp.default_exchange.publish(
                aio_pika.Message(body, message_id=kind, headers={h.ATTEMPT: 1, **returns}),
                routing_key=qname,
            )
        found: dict[str, str] = {}
        classes: dict[str, str] = {}
        for _ in EXPECTED:
            dead = await next_message(amqp, dlq_name(qname), timeout_s=15)
            headers = dead.headers or {}
            found[str(dead.message_id)] = str(headers[h.ERROR_TYPE])
            classes[str(dead.message_id)] = str(headers[h.ERROR_CLASS])
    finally:
        release.set()
    assert found == EXPECTED
    # Beside it, for people: where the class lives today (not stable, not for filters).
    assert classes["user-error"] == "builtins.RuntimeError"
    assert classes["timeout"].endswith(".HandlerTimeout")

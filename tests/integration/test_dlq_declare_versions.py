"""A DLQ declared before RabbitMQ 4.0's default delivery limit stays declarable afterwards."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from aio_pika.abc import AbstractChannel

from weclaw_mq import App
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.wire.topology import declare


async def test_a_dlq_declared_on_3_x_is_kept_as_it_is_when_declared_as_on_4_0_with_a_warning(
    make_app: Callable[..., App],
    qname: str,
    amqp: AbstractChannel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app()

    @app.handler(qname)
    async def work(task: dict[str, str]) -> None:
        return None

    spec = app.handlers[qname].queue_spec()
    await declare(amqp, [spec], server_version=ServerVersion(3, 13, 7))

    # After the upgrade: the 4.0 plan asks for x-delivery-limit -1, which the existing DLQ
    # lacks; RabbitMQ refuses to change it, and declare must neither fail nor lose the queue.
    with caplog.at_level(logging.WARNING, logger="weclaw_mq.topology"):
        names = await declare(amqp, [spec], server_version=ServerVersion(4, 0, 5))

    assert dlq_name(qname) in names and qname in names
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert dlq_name(qname) in warning and "set_policy" in warning and "delivery-limit" in warning
    assert not amqp.is_closed
    await amqp.declare_queue(dlq_name(qname), passive=True)  # still there

"""A worker consumes on one connection and publishes (retries, dead letters, notifications)
on another: RabbitMQ blocks a publishing connection under an alarm, acks included (the
alarm itself is drilled in tests/drills/test_alarm_and_pause_drill.py). The two are named
apart, opened together, and the loss of either starts a new session with both."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from typing import Any

from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import (
    close_connections,
    consuming_connection,
    queue_depth,
    wait_until,
)
from weclaw_mq import App, Reject
from weclaw_mq.contract.naming import dlq_name


class Job(BaseModel):
    n: int


def connection_names(prefix: str) -> list[str]:
    listing = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "client_properties"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    marker = '{"connection_name","'
    names = []
    for line in listing.splitlines():
        start = line.find(marker + prefix)
        if start != -1:
            rest = line[start + len(marker) :]
            names.append(rest[: rest.index('"')])
    return sorted(names)


async def test_a_worker_publishes_on_a_connection_of_its_own_and_reconnects_both_when_it_dies(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    app = make_app(qname, reconnect_max_delay_s=0.5)

    @app.handler(qname)
    async def work(job: Job) -> int:
        raise Reject("to the DLQ: a publish on the worker's publishing connection")

    worker = await start_worker(app)
    consuming = consuming_connection(qname)
    names = await asyncio.to_thread(connection_names, f"{qname}-worker")
    assert names == [consuming, f"{consuming}-publish"]

    assert await asyncio.to_thread(close_connections, f"{consuming}-publish") == 1
    reconnects = {"role": "worker"}
    await wait_until(
        lambda: (
            (app.metrics.registry.get_sample_value("weclaw_mq_reconnects_total", reconnects) or 0)
            >= 1
            and worker.health().ok
        ),
        15,
        "a new session after the publishing connection died",
    )
    await app.publish(qname, Job(n=1))
    await wait_until(
        lambda: queue_depth(amqp, dlq_name(qname)),
        15,
        "the dead letter published by the new session",
    )
    names = await asyncio.to_thread(connection_names, f"{qname}-worker")
    assert names == [consuming, f"{consuming}-publish"]

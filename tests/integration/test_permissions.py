"""Least privilege, for real: users made for the test on the shared broker, with exactly the
permissions ``weclaw-mq permissions`` prints, run a worker and a producer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import pytest

from tests.integration.broker_users import apply_line, broker_user
from tests.integration.processes import run_cli
from weclaw_mq import App, RetryPolicy
from weclaw_mq.admin.permissions import Role, grant, vhost_of
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.state import TaskStatus
from weclaw_mq.worker import Worker


async def refused(url: str, queue: str) -> bool:
    """Whether ``url``'s user is refused a basic.get on ``queue``."""
    conn = await aio_pika.connect(url)
    try:
        channel = await conn.channel()
        q = await channel.declare_queue(queue, passive=True)  # allowed to anyone
        try:
            await q.get(no_ack=False, fail=False)
        except aiormq.exceptions.ChannelAccessRefused:
            return True
        return False
    finally:
        await conn.close()


def with_handler(app: App, queue: str, failures: list[str]) -> App:
    """A handler that fails each task's first attempt: its retry is a publish of the worker's."""

    @app.handler(queue, retry=RetryPolicy(max_retries=2, delay_s=0.05))
    async def work(task: dict[str, Any]) -> dict[str, Any]:
        if task["n"] not in failures:
            failures.append(task["n"])
            raise RuntimeError("first attempt fails")
        return {"n": task["n"]}

    return app


async def test_worker_and_producer_users_do_their_work_and_nothing_more(
    make_app: Callable[..., App], qname: str, start_worker: Callable[..., Any], broker_url: str
) -> None:
    failures: list[str] = []
    operator = with_handler(make_app("perm"), qname, failures)
    other = make_app("other")

    @other.handler(f"{qname}-other")
    async def theirs(task: dict[str, Any]) -> None:
        return None

    await operator.declare()  # 'weclaw-mq declare', once, by a user who may configure
    await other.declare()
    specs = list(operator.handlers.values())
    with (
        broker_user(broker_url, grant(Role.WORKER, specs)) as (_, worker_url),
        broker_user(broker_url, grant(Role.PRODUCER, specs)) as (_, producer_url),
    ):
        worker_app = with_handler(make_app("perm", amqp_url=worker_url), qname, failures)
        await start_worker(worker_app)  # no configure permission: the declare checks passively
        producer = make_app("perm", amqp_url=producer_url)
        task_id = await producer.publish(qname, {"n": "a"})
        state = await producer.result(task_id, timeout_s=20)
        assert state.status is TaskStatus.SUCCEEDED and state.attempt == 2, state
        # A delayed publish goes through a delay queue's exchange: the producer may write it.
        delayed = await producer.publish(qname, {"n": "b"}, delay_s=0.2)
        state = await producer.result(delayed, timeout_s=20)
        assert state.status is TaskStatus.SUCCEEDED, state

        assert await refused(worker_url, f"{qname}-other")  # another app's queue
        assert await refused(worker_url, f"{qname}.dlq")  # even its own DLQ: ops' business
        assert await refused(producer_url, qname)  # a producer never consumes


async def test_a_worker_without_configure_permission_names_the_missing_declare(
    make_app: Callable[..., App], qname: str, broker_url: str
) -> None:
    probe = with_handler(make_app("perm"), qname, [])
    with broker_user(broker_url, grant(Role.WORKER, probe.handlers.values())) as (_, url):
        app = with_handler(make_app("perm", amqp_url=url), qname, [])
        with pytest.raises(ConfigurationError, match="weclaw-mq declare"):
            await asyncio.wait_for(Worker(app).run(), 20)


async def test_the_printed_lines_grant_what_each_role_needs(
    qname: str, broker_url: str, tmp_path: Path, make_app: Callable[..., App]
) -> None:
    env = {"TEST_QUEUE": qname, "TEST_RECORD_DIR": str(tmp_path)}
    app_path = "tests.integration.fixture_apps.worker_app:app"
    with broker_user(broker_url) as (user, url):
        every, operator_only = await asyncio.gather(
            run_cli("permissions", app_path, "--user", user, env=env),
            run_cli("permissions", app_path, "--role", "operator", "--user", user, env=env),
        )
        assert every.code == 0 and operator_only.code == 0, every.stderr + operator_only.stderr
        lines = every.stdout.strip().splitlines()
        assert len(lines) == len(Role), lines
        for line in lines:
            assert line.startswith(
                f"rabbitmqctl set_permissions -p {vhost_of(broker_url)} {user} "
            ), line
        assert operator_only.stdout.strip() in lines
        # The operator's line lets it declare every queue of the app (what 'weclaw-mq declare'
        # runs: App.declare), and read them.
        apply_line(operator_only.stdout.strip(), user)
        operator = make_app("fixture", amqp_url=url)  # the same handler as the app_path's

        @operator.handler(qname)
        async def work(task: dict[str, Any]) -> None:
            return None

        assert qname in await operator.declare()
        assert await refused(url, qname) is False

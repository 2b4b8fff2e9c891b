"""The fixtures that find the broker and Redis: a bad moment is waited out, a failure says
why, and the broker's CLI works on the broker of ``WECLAW_MQ_AMQP_URL`` in its vhost."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import pytest

from tests import broker_ctl as ctl
from tests.conftest import AMQP_URL, wait_until
from tests.drills.tcp_proxy import TcpProxy
from weclaw_mq.admin.permissions import vhost_of
from weclaw_mq.testing import services


async def test_a_broker_that_refuses_the_first_connect_is_waited_for(broker_url: str) -> None:
    """The first attempt is cut off (a broker restarting): the check tries again and finds it,
    where a single attempt reported a missing broker for the whole session."""
    target = urlsplit(broker_url)
    async with TcpProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        proxy.blackhole()
        check = asyncio.create_task(
            asyncio.to_thread(services.amqp_problem, proxy.url_for(broker_url), wait_s=30)
        )
        await wait_until(lambda: proxy.open_links >= 1, 15, what="the first connect")
        assert proxy.cut() >= 1
        proxy.pass_traffic()
        assert await check is None


async def test_a_broker_that_never_answers_is_reported_with_its_cause(broker_url: str) -> None:
    target = urlsplit(broker_url)
    async with TcpProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        proxy.blackhole()  # TCP accepted, no handshake: a broker out of file handles
        port = proxy.port
        problem = await asyncio.to_thread(
            services.amqp_problem, proxy.url_for(broker_url), wait_s=1.0
        )
    assert problem is not None
    assert f"127.0.0.1:{port}" in problem, problem
    assert "guest:guest" not in problem, problem  # the password is never shown
    assert "times over 1 s" in problem, problem


def test_a_redis_that_does_not_answer_is_reported_after_the_wait() -> None:
    problem = services.redis_problem("redis://127.0.0.1:1/0", wait_s=1.0)
    assert problem is not None and "times over 1 s" in problem, problem


def test_the_broker_cli_works_on_the_urls_vhost() -> None:
    args = ctl.ctl_args("-q", "list_queues", "name")
    assert args[args.index("-p") + 1] == vhost_of(AMQP_URL)
    assert "-p" not in ctl.ctl_args("-q", "list_connections", "pid")  # node-wide


async def test_the_broker_cli_lists_a_queue_the_tests_declared(amqp: object, qname: str) -> None:
    channel = amqp
    name = f"{qname}-{uuid.uuid4().hex[:6]}"
    queue = await channel.declare_queue(name, auto_delete=True)  # type: ignore[attr-defined]
    try:
        listed = await ctl.abroker_ctl("-q", "list_queues", "name")
        assert name in listed.split()
    finally:
        await queue.delete()


def test_the_broker_cli_refuses_a_node_that_does_not_serve_the_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A URL on another port than the node rabbitmqctl reaches: a failure that says so, not
    users made on the wrong broker."""
    ctl._node_args.cache_clear()
    monkeypatch.setattr(ctl, "AMQP_URL", "amqp://guest:guest@127.0.0.1:1/")
    try:
        with pytest.raises(pytest.fail.Exception, match="not the broker at WECLAW_MQ_AMQP_URL"):
            ctl.broker_ctl("-q", "list_users")
    finally:
        ctl._node_args.cache_clear()

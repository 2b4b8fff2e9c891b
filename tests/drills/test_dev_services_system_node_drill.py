"""Drill: ``ops/dev-services.sh up`` asks the system node whether it runs before it acts.

The script treats a RabbitMQ on the system node's port (root, ``rabbitmqctl`` at hand) as the
system node. It used to take any node that answered ``rabbitmqctl ping`` but not the AMQP
handshake for one whose app was stopped: a broker out of file handles (TCP accepted, no
handshake) got ``rabbitmqctl start_app`` and was recorded as *started*, so a later ``down``
would have stopped a broker other people use.

Here the "system node" is a private node (its port given as the system port, its
``rabbitmqctl`` as the system's command), so the shared broker is never touched:

1. wedged by quorum queues at a low ``ulimit -n``, it runs but takes no new connection:
   ``up`` says so, starts nothing, records nothing, and the node keeps serving;
2. its app stopped (``rabbitmqctl stop_app``): ``up`` starts the app and records that, and
   ``down`` stops the app again (and only that).
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest

from tests.conftest import REDIS_URL
from tests.drills.conftest import CLUSTER_SH, RabbitNode, low_nofile_node, new_connection_opens
from tests.integration.test_dev_services import run_script, script_env
from tests.private_servers import PrivateServers

# Low enough that a few dozen quorum queues exhaust it (about 3 handles each).
NOFILE = 400
WEDGED_PATIENCE_S = 5.0
SCRIPT_TIMEOUT_S = 180
FILE_HANDLES = "file_handle_cache:info([total_limit, total_used])."

pytestmark = [
    pytest.mark.drill,
    pytest.mark.skipif(os.geteuid() != 0, reason="the script's system-node path runs only as root"),
]


@pytest.fixture(scope="module")
def system_node(private_servers: PrivateServers) -> Iterator[RabbitNode]:
    with low_nofile_node(private_servers, "sys", NOFILE) as node:
        yield node


def _ctl_command(node: RabbitNode, folder: Path) -> str:
    """A rabbitmqctl for ``node`` (its cookie and name), as the script's system command."""
    env = {k: v for k, v in node.space.env().items() if k.startswith("WECLAW_")}
    wrapper = folder / "rabbitmqctl"
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    wrapper.write_text(
        f'#!/bin/sh\nexec env {assigns} bash {shlex.quote(str(CLUSTER_SH))} ctl {node.key} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def _run(command: str, node: RabbitNode, state: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **script_env(state, node.url, REDIS_URL),
        "WECLAW_DEV_SERVICES_SYSTEM_PORT": str(node.port),
        "WECLAW_DEV_SERVICES_RABBITMQCTL": _ctl_command(node, state.parent),
        "WECLAW_DEV_SERVICES_RABBITMQ_TIMEOUT_S": "60",
    }
    return run_script(command, env, SCRIPT_TIMEOUT_S)


def _records(state: Path) -> list[str]:
    return [p.read_text() for p in state.glob("*/record")]


async def test_up_leaves_a_running_node_that_takes_no_new_connection_alone(
    system_node: RabbitNode, tmp_path: Path
) -> None:
    node = system_node
    out = await node.ctl("eval", FILE_HANDLES)
    values = dict(re.findall(r"\{(total_limit|total_used),(\d+)\}", out))
    limit, used = int(values["total_limit"]), int(values["total_used"])
    names = [f"sys-wedge-{uuid.uuid4().hex[:6]}-{i}" for i in range((limit - used) // 3 + 10)]
    state = tmp_path / "state"
    async with await aio_pika.connect(node.url) as conn:
        channel = await conn.channel()
        try:
            for name in names:
                await channel.declare_queue(
                    name, durable=True, arguments={"x-queue-type": "quorum"}
                )
            assert not await new_connection_opens(node.url, WEDGED_PATIENCE_S), (
                f"{len(names)} quorum queues at ulimit -n {NOFILE} did not wedge the node: "
                "this drill could not show the overloaded case"
            )

            up = await asyncio.to_thread(_run, "up", node, state)
            text = up.stdout + up.stderr
            assert up.returncode != 0, text
            assert "runs but does not answer the AMQP handshake" in text, text
            assert "nothing was started or stopped" in text, text
            assert "start_app" not in text.replace("'file_handle_cache", ""), text
            assert _records(state) == [], _records(state)
            assert "true" in await node.ctl("eval", "rabbit:is_running().")
        finally:
            for name in names:
                await channel.queue_delete(name)
    assert await new_connection_opens(node.url, 30.0)

    down = await asyncio.to_thread(_run, "down", node, state)
    assert down.returncode == 0 and "nothing to stop" in down.stdout + down.stderr
    assert "true" in await node.ctl("eval", "rabbit:is_running().")


async def test_up_starts_the_app_of_a_stopped_node_and_down_stops_only_that(
    system_node: RabbitNode, tmp_path: Path
) -> None:
    node = system_node
    state = tmp_path / "state"
    await node.stop_app()
    try:
        up = await asyncio.to_thread(_run, "up", node, state)
        text = up.stdout + up.stderr
        assert up.returncode == 0, text
        assert "up but not serving: rabbitmqctl start_app" in text, text
        (record,) = _records(state)
        assert "started=app" in record and "kind=system" in record, record
        assert await new_connection_opens(node.url, 30.0)

        down = await asyncio.to_thread(_run, "down", node, state)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "stop_app" in down.stdout + down.stderr
        assert "false" in await node.ctl("eval", "rabbit:is_running().")
        assert node.pid() is not None  # the Erlang node itself was left running
        assert _records(state) == []
    finally:
        if "false" in await node.ctl("eval", "rabbit:is_running()."):
            await node.start_app()

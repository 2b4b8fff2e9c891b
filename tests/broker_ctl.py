"""``rabbitmqctl`` against the broker the tests use (``WECLAW_MQ_AMQP_URL``), in its vhost.

rabbitmqctl reaches a node by name (the local default node unless told), not by URL: a test
that listed queues, closed connections or made users with a bare ``rabbitmqctl`` worked on the
default node's vhost ``/`` whatever URL the suite was given. Here every call names the node
(``WECLAW_TEST_RABBITMQ_NODE``, else rabbitmqctl's default), checks once that this node serves
the URL's AMQP port, and gives per-vhost commands the URL's vhost.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest

from tests.conftest import AMQP_URL
from weclaw_mq.admin.permissions import vhost_of

NODE_ENV = "WECLAW_TEST_RABBITMQ_NODE"
TIMEOUT_S = 60.0
# Commands that act on one vhost (rabbitmqctl's -p); connections and users are node-wide.
VHOST_SCOPED = frozenset(
    {"list_queues", "list_bindings", "list_consumers", "list_exchanges", "list_permissions"}
)
AMQP_PORTS = "[element(6, L) || L <- rabbit_networking:active_listeners(), element(3, L) =:= amqp]."


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rabbitmqctl", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


@functools.cache
def _node_args() -> tuple[str, ...]:
    """``-n NODE`` (or nothing), once the node is seen to serve the URL's port (not cached
    when it fails: the next test asks again)."""
    if shutil.which("rabbitmqctl") is None:
        pytest.fail(
            "needs rabbitmqctl beside the test broker: apt-get install rabbitmq-server (Debian)",
            pytrace=False,
        )
    node = os.environ.get(NODE_ENV)
    args = ("-n", node) if node else ()
    done = _run([*args, "-q", "eval", AMQP_PORTS], TIMEOUT_S)
    if done.returncode != 0:
        pytest.fail(
            f"rabbitmqctl cannot reach {node or 'the default node'} ({done.stderr.strip()[:200]}); "
            f"set {NODE_ENV} to the node name of the broker at WECLAW_MQ_AMQP_URL",
            pytrace=False,
        )
    ports = {int(p) for p in re.findall(r"\d+", done.stdout)}
    wanted = urlsplit(AMQP_URL).port or 5672
    if wanted not in ports:
        pytest.fail(
            f"rabbitmqctl reaches {node or 'the default node'}, whose AMQP ports are "
            f"{sorted(ports)}, not the broker at WECLAW_MQ_AMQP_URL (port {wanted}): set "
            f"{NODE_ENV} to that broker's node name (its Erlang cookie in ~/.erlang.cookie)",
            pytrace=False,
        )
    return args


def ctl_args(*args: str) -> list[str]:
    """The arguments of a ``rabbitmqctl`` call on the tests' broker (node and vhost set)."""
    command = next((a for a in args if not a.startswith("-")), "")
    vhost = ["-p", vhost_of(AMQP_URL)] if command in VHOST_SCOPED else []
    return [*_node_args(), *vhost, *args]


def broker_ctl(*args: str, timeout_s: float = TIMEOUT_S) -> str:
    """Run ``rabbitmqctl ARGS`` on the tests' broker; its stdout, or AssertionError with its
    stderr when it fails."""
    done = _run(ctl_args(*args), timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"rabbitmqctl {' '.join(args[:2])} failed: {done.stderr.strip()}")
    return done.stdout


async def abroker_ctl(*args: str, timeout_s: float = TIMEOUT_S) -> str:
    """``broker_ctl`` without blocking the event loop."""
    return await asyncio.to_thread(broker_ctl, *args, timeout_s=timeout_s)

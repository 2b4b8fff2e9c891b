"""Drill: a broker at the usual file-descriptor limit (``ulimit -n 1024``) still accepts new
connections with many handlers declared.

RabbitMQ's file handle cache allows 927 handles at ``ulimit -n 1024`` (measured on 3.10.8)
and each quorum queue holds about 3 of them. Past the limit, every NEW connection hangs in
the AMQP handshake, with no error, while the open ones keep working: the shared broker wedged
that way with ~358 quorum queues. A handler used to declare 31 (a delay queue set per
priority lane); its lanes now share one set, 13 in all (``topology``).

On a private node started with ``ulimit -n 1024`` (``WECLAW_CLUSTER_NOFILE``), for
``HANDLERS`` handlers:

1. the control: the topology as versions before the shared delay queues declared it (their
   per-lane delay queues rebuilt here by name and arguments): a new connection does NOT open
   within ``WEDGED_PATIENCE_S``, so this drill can fail;
2. those per-lane delay queues deleted over the connection that made them: a new connection
   opens again;
3. the same handlers declared by ``App.declare`` (today's topology): a new connection opens,
   and the handles in use stay under the limit.

And why the delay queues are shared per handler, not per vhost: a task whose lane no longer
exists stays in the delay queue for good (quorum at-least-once dead-lettering retries it),
while a later task in the same queue goes back to its lane.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest

from tests.conftest import queue_depth, settings_for, wait_until
from tests.drills.conftest import RabbitNode, low_nofile_node, new_connection_opens
from tests.private_servers import PrivateServers
from weclaw_mq import App
from weclaw_mq.broker_version import ServerVersion
from weclaw_mq.naming import RETRY_INFIX, delay_queue_name, retry_queue_name
from weclaw_mq.topology import QueueSpec, delay_queue_arguments, queue_declarations

NOFILE = 1024
# Handlers of the default options: 20 x 31 = 620 quorum queues before (~1860 handles, twice
# the limit), 20 x 13 = 260 now (~780).
HANDLERS = 20
# A healthy node answers a handshake in milliseconds; the wedged one never does.
WEDGED_PATIENCE_S = 5.0
OPEN_PATIENCE_S = 20.0
VERSION = ServerVersion(3, 10, 8)  # the node's: no quorum priorities, so three lanes
FILE_HANDLES = "file_handle_cache:info([total_limit, total_used])."


@pytest.fixture(scope="module")
def nofile_node(private_servers: PrivateServers) -> Iterator[RabbitNode]:
    """A private single node of this module's own, started with ``ulimit -n 1024``."""
    with low_nofile_node(private_servers, "fd", NOFILE) as node:
        yield node


def _open_files_limit(pid: int) -> int:
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max open files\s+(\d+)", limits, re.MULTILINE)
    assert found is not None, limits
    return int(found.group(1))


async def _handles(node: RabbitNode) -> tuple[int, int]:
    """(limit, in use) of the node's file handle cache."""
    out = await node.ctl("eval", FILE_HANDLES)
    values = dict(re.findall(r"\{(total_limit|total_used),(\d+)\}", out))
    return int(values["total_limit"]), int(values["total_used"])


def _per_lane_delay_queues(spec: QueueSpec) -> list[tuple[str, dict[str, object]]]:
    """The delay queues an older version declared for ``spec``: one set per lane, each
    dead-lettering to its lane by name."""
    return [
        (retry_queue_name(lane, d), {**delay_queue_arguments(d), "x-dead-letter-routing-key": lane})
        for lane in spec.lane_queues(VERSION)
        for d in spec.retry_delays_ms
    ]


@pytest.mark.drill
async def test_a_node_at_ulimit_1024_takes_new_connections_with_many_handlers_declared(
    nofile_node: RabbitNode,
) -> None:
    node = nofile_node
    assert _open_files_limit(node.require_pid()) == NOFILE
    _, used_before = await _handles(node)
    app = App("fd-drill", settings=settings_for(node.url, "redis://127.0.0.1:6379/0"))
    run = uuid.uuid4().hex[:8]
    for i in range(HANDLERS):

        async def handle(task: dict[str, int]) -> None:
            return None

        app.handler(f"fd-{run}-{i}")(handle)
    specs = [spec.queue_spec() for spec in app.handlers.values()]
    unchanged = [
        decl
        for spec in specs
        for decl in queue_declarations(spec, VERSION)
        if RETRY_INFIX not in decl[0]
    ]  # the DLQs and lanes: the same in both topologies
    old = [decl for spec in specs for decl in _per_lane_delay_queues(spec)]
    assert len(unchanged) + len(old) == HANDLERS * 31

    async with await aio_pika.connect(node.url) as conn:
        channel = await conn.channel()
        for name, arguments in unchanged + old:
            await channel.declare_queue(name, durable=True, arguments=arguments)  # type: ignore[arg-type]
        # 1. The control: the old topology wedges the node for new connections.
        assert not await new_connection_opens(node.url, WEDGED_PATIENCE_S), (
            f"{len(unchanged) + len(old)} quorum queues at ulimit -n {NOFILE} did not wedge "
            "the node: this drill could not tell the topologies apart"
        )
        # 2. What the node holds in per-lane delay queues goes: it answers again.
        for name, _ in old:
            await channel.queue_delete(name)
        assert await new_connection_opens(node.url, OPEN_PATIENCE_S)

    # 3. Today's topology of the same handlers, declared as a worker declares it.
    declared = await app.declare()
    await app.close()
    quorum = sum(
        args.get("x-queue-type") == "quorum"
        for spec in specs
        for _, args in queue_declarations(spec, VERSION)
    )
    assert len(declared) == quorum == HANDLERS * 13
    assert await new_connection_opens(node.url, OPEN_PATIENCE_S)
    limit, used = await _handles(node)
    per_queue = (used - used_before) / quorum
    print(
        f"ulimit -n {NOFILE}: {limit} file handles; {HANDLERS} handlers, {quorum} quorum "
        f"queues: {used} in use, {per_queue:.2f} per quorum queue"
    )
    assert used < limit
    assert 2.5 <= per_queue <= 3.5  # the README's "about 3"


async def _held_for_dead_lettering(node: RabbitNode, queue: str) -> int:
    """Messages ``queue`` expired but has not forwarded yet (quorum at-least-once
    dead-lettering keeps them until their target takes them)."""
    assert re.fullmatch(r"[A-Za-z0-9_.\-]+", queue), queue  # safe inside an Erlang binary
    resource = f'rabbit_misc:r(<<"/">>, queue, <<"{queue}">>)'
    out = await node.ctl(
        "eval",
        f"{{ok, Q}} = rabbit_amqqueue:lookup({resource}), rabbit_amqqueue:info(Q, [messages_dlx]).",
    )
    found = re.search(r"\{messages_dlx,(\d+)\}", out)
    assert found is not None, out
    return int(found.group(1))


@pytest.mark.drill
async def test_a_task_whose_lane_is_gone_stays_in_the_delay_queue_and_holds_back_no_other(
    nofile_node: RabbitNode,
) -> None:
    node = nofile_node
    queue = f"fd-orphan-{uuid.uuid4().hex[:8]}"
    app = App("fd-orphan", settings=settings_for(node.url, "redis://127.0.0.1:6379/0"))

    async def handle(task: dict[str, int]) -> None:
        return None

    app.handler(queue)(handle)
    await app.declare()
    await app.close()
    delay = delay_queue_name(queue, 1000)
    async with await aio_pika.connect(node.url) as conn:
        channel = await conn.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(delay, ensure=False)
        # First a task for a lane that does not exist (a deleted handler's), then one for Q.
        await exchange.publish(aio_pika.Message(b"{}", message_id="orphan"), f"{queue}-gone")
        await exchange.publish(aio_pika.Message(b"{}", message_id="kept"), queue)

        async def back_in_q() -> bool:
            return await queue_depth(channel, queue) == 1

        await wait_until(back_in_q, 15, "the second task back in Q")
        # Past its TTL and behind nothing: the first is neither forwarded nor dropped. (The
        # second leaves the count within milliseconds of reaching Q; the CLI takes seconds.)
        assert await _held_for_dead_lettering(node, delay) == 1

"""Drill: a broker at the usual file-descriptor limit (``ulimit -n 1024``) still accepts new
connections with many handlers declared, and the vhost's shared delay ladder strands no task.

RabbitMQ's file handle cache allows 927 handles at ``ulimit -n 1024`` (measured on 3.10.8)
and each quorum queue holds about 3 of them. Past the limit, every NEW connection hangs in
the AMQP handshake, with no error, while the open ones keep working: the shared broker wedged
that way with ~358 quorum queues. A handler used to declare 31 (a delay queue set per
priority lane), then 13 (its lanes sharing one set); now 2 (Q and its DLQ; lanes only with
``priorities=True``), the delay ladder being the vhost's (``topology``).

On a private node started with ``ulimit -n 1024`` (``WECLAW_CLUSTER_NOFILE``):

1. the control: ``OLD_HANDLERS`` handlers in the previous version's topology (lanes and
   per-handler delay queues, rebuilt here by name and arguments): a new connection does NOT
   open within ``WEDGED_PATIENCE_S``, so this drill can fail;
2. those delay queues and lanes deleted over the connection that made them: a new connection
   opens again;
3. ``HANDLERS`` handlers declared by ``App.declare`` (today's topology): a new connection
   opens, and the handles in use stay under the limit.

And item 2 of issue 25: a task whose queue was deleted while it waited in the shared ladder
goes to the parking queue (the return exchange's alternate exchange), is not held by the
delay queue for good, and holds back no other task; the control, a delay queue dead-lettering
through the default exchange as before, keeps such a task forever.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from tests.conftest import queue_depth, settings_for, wait_until
from tests.drills.conftest import RabbitNode, low_nofile_node, new_connection_opens
from tests.private_servers import PrivateServers
from weclaw_mq import App
from weclaw_mq.contract.naming import (
    RETURN_EXCHANGE,
    delay_queue_name,
    ladder_queue_name,
    lane_queue_name,
    parking_queue_name,
)
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.wire.topology import QueueSpec, queue_declarations

NOFILE = 1024
# The previous version's 13 quorum queues per handler: 30 x 13 = 390 (~1170 handles, past
# the limit); today's 2 per handler and the vhost's ladder: 100 x 2 + 15 = 215 (~645).
OLD_HANDLERS = 30
HANDLERS = 100
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


def _old_delay_arguments(delay_ms: int) -> dict[str, object]:
    """A per-handler delay queue as the previous version declared it: dead-lettering through
    the default exchange by the message's own routing key."""
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        "x-message-ttl": delay_ms,
    }


def _previous_topology(spec: QueueSpec) -> list[tuple[str, dict[str, object]]]:
    """The lanes and per-handler delay queues the previous version declared beside Q and
    its DLQ."""
    lanes = [lane_queue_name(spec.name, level) for level in ("high", "urgent")]
    work = dict(queue_declarations(spec, VERSION))[spec.name]
    return [(lane, work) for lane in lanes] + [
        (delay_queue_name(spec.name, d), _old_delay_arguments(d)) for d in spec.retry_delays_ms
    ]


def _app(node: RabbitNode, name: str, count: int, run: str) -> App:
    app = App(name, settings=settings_for(node.url, "redis://127.0.0.1:6379/0"))
    for i in range(count):

        async def handle(task: dict[str, int]) -> None:
            return None

        app.handler(f"fd-{run}-{i}")(handle)
    return app


@pytest.mark.drill
async def test_a_node_at_ulimit_1024_takes_new_connections_with_many_handlers_declared(
    nofile_node: RabbitNode,
) -> None:
    node = nofile_node
    assert _open_files_limit(node.require_pid()) == NOFILE
    _, used_before = await _handles(node)
    run = uuid.uuid4().hex[:8]
    before = _app(node, "fd-before", OLD_HANDLERS, run)
    own = [d for s in before.handlers.values() for d in queue_declarations(s.queue_spec())]
    old = [d for s in before.handlers.values() for d in _previous_topology(s.queue_spec())]
    assert len(own) + len(old) == OLD_HANDLERS * 13

    async with await aio_pika.connect(node.url) as conn:
        channel = await conn.channel()
        for name, arguments in own + old:
            await channel.declare_queue(name, durable=True, arguments=arguments)  # type: ignore[arg-type]
        # 1. The control: the previous topology wedges the node for new connections.
        assert not await new_connection_opens(node.url, WEDGED_PATIENCE_S), (
            f"{len(own) + len(old)} quorum queues at ulimit -n {NOFILE} did not wedge "
            "the node: this drill could not tell the topologies apart"
        )
        # 2. The lanes and per-handler delay queues go: it answers again.
        for name, _ in old:
            await channel.queue_delete(name)
        assert await new_connection_opens(node.url, OPEN_PATIENCE_S)

    # 3. Today's topology of many more handlers (the first ones among them), as a worker
    # declares it.
    app = _app(node, "fd-after", HANDLERS, run)
    declared = await app.declare()
    await app.close()
    specs = [spec.queue_spec() for spec in app.handlers.values()]
    per_handler = sum(len(queue_declarations(spec, VERSION)) for spec in specs)
    assert per_handler == HANDLERS * 2
    assert len(declared) == per_handler + len([n for n in declared if n.startswith("weclaw_mq.")])
    assert await new_connection_opens(node.url, OPEN_PATIENCE_S)
    limit, used = await _handles(node)
    per_queue = (used - used_before) / len(declared)
    print(
        f"ulimit -n {NOFILE}: {limit} file handles; {HANDLERS} handlers, {len(declared)} "
        f"quorum queues: {used} in use, {per_queue:.2f} per quorum queue; room for about "
        f"{int((limit - used_before) / per_queue - (len(declared) - per_handler)) // 2} "
        "handlers in all"
    )
    assert used < limit
    assert 2.5 <= per_queue <= 3.5  # docs/design/topology.md's "about 3"


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
async def test_a_task_whose_queue_is_gone_while_it_waits_in_the_shared_ladder_is_parked(
    nofile_node: RabbitNode,
) -> None:
    node = nofile_node
    queue = f"fd-orphan-{uuid.uuid4().hex[:8]}"
    app = App("fd-orphan", settings=settings_for(node.url, "redis://127.0.0.1:6379/0"))

    async def handle(task: dict[str, int]) -> None:
        return None

    app.handler(queue, priorities=True)(handle)
    await app.declare()
    await app.close()
    spec = app.handlers[queue].queue_spec()
    delays = (1000, 4000)
    async with await aio_pika.connect(node.url) as conn:
        channel = await conn.channel(publisher_confirms=True)
        # Tasks of every lane in two of the shared delay queues, as a worker parks them...
        parked = []
        for delay in delays:
            exchange = await channel.get_exchange(ladder_queue_name(delay), ensure=False)
            for lane in spec.lane_queues(VERSION):
                task_id = f"{lane}-{delay}"
                await exchange.publish(aio_pika.Message(b"{}", message_id=task_id), lane)
                parked.append(task_id)
        # ... then the handler's queues deleted while they wait.
        for lane in spec.lane_queues(VERSION):
            await channel.queue_delete(lane)
        # A task for a queue that exists, behind them in the 1 s queue.
        other = f"{queue}-other"
        target = await channel.declare_queue(
            other, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await target.bind(RETURN_EXCHANGE, routing_key=other)
        exchange = await channel.get_exchange(ladder_queue_name(1000), ensure=False)
        await exchange.publish(aio_pika.Message(b"{}", message_id="kept"), other)

        async def all_parked() -> bool:
            return await queue_depth(channel, parking_queue_name()) == len(parked)

        await wait_until(all_parked, 30, "every orphaned task in the parking queue")
        await wait_until(lambda: _depth_is(channel, other, 1), 15, "the other task back")
        for delay in delays:  # none held back for dead-lettering: nothing loops
            assert await _held_for_dead_lettering(node, ladder_queue_name(delay)) == 0
        parking = await channel.get_queue(parking_queue_name(), ensure=False)
        seen = set()
        while (message := await parking.get(no_ack=True, fail=False)) is not None:
            seen.add(message.message_id)
            # Where it was going: the routing key its death recorded (the DLQ tools' requeue).
            deaths: Any = message.headers["x-death"]
            assert deaths[0]["routing-keys"] == [str(message.message_id).rsplit("-", 1)[0]]
        assert seen == set(parked)

        # The control: a delay queue dead-lettering through the default exchange, as the
        # previous version's did, keeps a task whose queue is gone for good.
        control = delay_queue_name(queue, 1000)
        await channel.declare_queue(control, durable=True, arguments=_old_delay_arguments(1000))  # type: ignore[arg-type]
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", message_id="orphan"), routing_key=control
        )
        await wait_until(
            lambda: _held(node, control), 15, "the control's task held for dead-lettering"
        )
        await channel.queue_delete(control)
        await channel.queue_delete(other)


async def _held(node: RabbitNode, queue: str) -> bool:
    return await _held_for_dead_lettering(node, queue) == 1


async def _depth_is(channel: aio_pika.abc.AbstractChannel, queue: str, n: int) -> bool:
    return await queue_depth(channel, queue) == n

"""App.declare() against the real broker: the queues it creates, and what a conflict says."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel

from tests.broker_ctl import broker_ctl
from tests.conftest import get_message, queue_depth, wait_until
from weclaw_mq import App, Limit, RetryPolicy, TopologyConflictError
from weclaw_mq.admin import queue_stats
from weclaw_mq.admin.migrate import migrate
from weclaw_mq.contract.naming import (
    RETURN_EXCHANGE,
    UNROUTABLE,
    delay_queue_name,
    is_shared_name,
    ladder_queue_name,
    lane_queue_name,
    parking_queue_name,
    retry_queue_name,
)
from weclaw_mq.policy.delays import STEP_DELAYS_MS
from weclaw_mq.wire.topology import work_queue_arguments

PARKING = parking_queue_name()


def _list_queues() -> dict[str, dict[str, Any]]:
    """Every queue on the broker as the broker itself reports it (type, durable, arguments)."""
    out = broker_ctl(
        *("-q", "list_queues", "name", "type", "durable", "arguments"), "--formatter", "json"
    )
    queues: dict[str, dict[str, Any]] = {}
    for row in json.loads(out):
        # arguments come as [name, amqp-type, value] triples
        row["arguments"] = {name: value for name, _type, value in row["arguments"]}
        queues[row["name"]] = row
    return queues


async def _queues_named(prefix: str) -> dict[str, dict[str, Any]]:
    everything = await asyncio.to_thread(_list_queues)
    return {n: q for n, q in everything.items() if n == prefix or n.startswith(f"{prefix}.")}


def _ladder(*delays_ms: int) -> list[str]:
    """The vhost's shared delay queues of ``delays_ms`` and of the steps every handler has
    beside its policy's (weclaw_mq.policy.delays)."""
    return [ladder_queue_name(d) for d in sorted({*delays_ms, *STEP_DELAYS_MS})]


def _list_bindings() -> set[tuple[str, str, str]]:
    """Every (source exchange, destination queue, routing key) binding of a named exchange."""
    out = broker_ctl(
        *("-q", "list_bindings", "source_name", "destination_name", "destination_kind"),
        *("routing_key", "--formatter", "json"),
    )
    return {
        (b["source_name"], b["destination_name"], b["routing_key"])
        for b in json.loads(out)
        if b["source_name"] and b["destination_kind"] == "queue"
    }


def _register(app: App, queue: str, **options: Any) -> None:
    async def summarise(task: dict[str, str]) -> None:
        return None

    app.handler(queue, **options)(summarise)


async def test_declare_creates_the_work_queue_its_dlq_and_the_vhosts_shared_ladder(
    make_app: Callable[..., App], qname: str
) -> None:
    app = make_app()
    _register(
        app,
        qname,
        retry=RetryPolicy(max_retries=2, delay_s=0.2, multiplier=2),
        delivery_limit=4,
    )

    names = await app.declare()

    # Q and its DLQ of its own (no priorities: no lanes); the ladder is the vhost's.
    ladder = _ladder(200, 400)
    assert sorted(names) == sorted([qname, f"{qname}.dlq"])
    assert sorted(names.shared) == sorted([PARKING, *ladder])
    queues = await _queues_named(qname)
    assert set(queues) == {qname, f"{qname}.dlq"}
    everything = await asyncio.to_thread(_list_queues)
    for name in [*names, *names.shared]:
        assert everything[name]["type"] == "quorum"
        assert everything[name]["durable"] is True
    assert queues[qname]["arguments"] == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": f"{qname}.dlq",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        "x-delivery-limit": 4,
    }
    # Each shared delay queue dead-letters through the return exchange by the message's own
    # routing key (its lane): no x-dead-letter-routing-key.
    for delay_ms in (200, 400, 1000):
        assert everything[ladder_queue_name(delay_ms)]["arguments"] == {
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": RETURN_EXCHANGE,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
            "x-message-ttl": delay_ms,
        }
    # ... behind a fanout exchange of its own name, bound to it; Q is bound to the return
    # exchange by its name, and the parking queue to the return exchange's alternate.
    bindings = await asyncio.to_thread(_list_bindings)
    assert {(d, d, "") for d in ladder} <= bindings
    assert (RETURN_EXCHANGE, qname, qname) in bindings
    assert (UNROUTABLE, PARKING, "") in bindings
    assert queues[f"{qname}.dlq"]["arguments"] == {"x-queue-type": "quorum"}


async def _quorum_queues_of(handler_queue: str) -> int:
    return sum(q["type"] == "quorum" for q in (await _queues_named(handler_queue)).values())


async def test_a_handler_costs_two_quorum_queues_and_four_with_priorities_on_3x(
    make_app: Callable[..., App], qname: str
) -> None:
    """Issue 25: the queues a handler adds to the broker (each ~3 file handles), counted by
    the broker itself. 3.x has no quorum priorities: lanes, only for a handler that asks."""
    app = make_app()
    plain, limited, ranked = qname, f"{qname}-lim", f"{qname}-pri"
    _register(app, plain)
    _register(app, limited, limit=Limit(key=lambda t: t["text"], concurrency=1))
    _register(app, ranked, priorities=True)

    await app.declare()

    assert await _quorum_queues_of(plain) == 2
    assert await _quorum_queues_of(limited) == 2
    assert await _quorum_queues_of(ranked) == 4
    # A second app with more handlers adds their own queues and no delay queue.
    before = set(await asyncio.to_thread(_list_queues))
    more = make_app(name="more")
    for i in range(5):
        _register(more, f"{qname}-more{i}")
    await more.declare()
    # (Other suites may declare queues of their own meanwhile: only ours are counted.)
    added = {n for n in set(await asyncio.to_thread(_list_queues)) - before if qname in n}
    assert added == {n for i in range(5) for n in (f"{qname}-more{i}", f"{qname}-more{i}.dlq")}


async def test_capped_delays_share_one_retry_queue(
    make_app: Callable[..., App], qname: str
) -> None:
    app = make_app()
    _register(
        app,
        qname,
        retry=RetryPolicy(max_retries=5, delay_s=0.1, multiplier=2, max_delay_s=0.2),
        max_length=50,
    )

    names = await app.declare()

    queues = await _queues_named(qname)
    assert sorted(queues) == sorted([qname, f"{qname}.dlq"])
    assert sorted(n for n in names.shared if n.startswith("weclaw_mq.delay.")) == sorted(
        _ladder(100, 200)
    )
    assert queues[qname]["arguments"]["x-max-length"] == 50


async def test_declare_covers_every_handler_of_the_app(
    make_app: Callable[..., App], qname: str
) -> None:
    app = make_app()
    other = f"{qname}-b"
    policy = RetryPolicy(max_retries=1, delay_s=0.05)
    _register(app, qname, retry=policy)
    _register(app, other, retry=policy, priorities=True)

    names = await app.declare()

    assert set(names) == {
        qname,
        f"{qname}.dlq",
        other,
        f"{other}.dlq",
        f"{other}.lane.high",
        f"{other}.lane.urgent",
    }
    assert set(names.shared) == {PARKING, *_ladder(50)}
    assert {*names, *names.shared} <= set(await asyncio.to_thread(_list_queues))


async def test_a_teardown_that_deletes_what_declare_returned_leaves_the_vhosts_ladder(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    """Issue 38, item 17: the ladder serves every app of the vhost; one app's teardown that
    deleted "what declare returned" deleted it under all the others."""
    app = make_app()
    _register(app, qname, retry=RetryPolicy(max_retries=1, delay_s=0.05))

    declared = await app.declare()
    # Checked before deleting anything: the ladder here is the shared broker's, in use.
    assert not [name for name in declared if is_shared_name(name)]
    for name in declared:  # what a user's teardown does
        await amqp.queue_delete(name)

    everything = await asyncio.to_thread(_list_queues)
    assert declared.shared and set(declared.shared) <= set(everything)
    assert not set(declared) & set(everything)
    assert declared.own == tuple(declared)


async def test_declaring_twice_is_harmless_and_keeps_queued_messages(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    policy = RetryPolicy(max_retries=1, delay_s=0.05)
    app = make_app()
    _register(app, qname, retry=policy)
    first = await app.declare()
    task_id = await app.publish(qname, {"text": "still here"})

    assert await app.declare() == first
    # a second process (another App with the same handler) declares the same topology
    twin = make_app(name="twin")
    _register(twin, qname, retry=policy)
    assert await twin.declare() == first

    assert await queue_depth(amqp, qname) == 1
    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == task_id


async def _conflict(
    make_app: Callable[..., App], queue: str, *, old: dict[str, Any], new: dict[str, Any]
) -> tuple[App, TopologyConflictError]:
    """Declare ``queue`` with the ``old`` handler options, then have another App declare it
    with the ``new`` ones; returns the first App and the conflict the second one raised."""
    policy = RetryPolicy(max_retries=1, delay_s=0.05)
    first = make_app(name="old")
    _register(first, queue, retry=policy, **old)
    await first.declare()

    second = make_app(name="new")
    _register(second, queue, retry=policy, **new)
    with pytest.raises(TopologyConflictError) as info:
        await second.declare()
    return first, info.value


async def test_redeclaring_with_another_delivery_limit_raises_a_conflict_that_says_what_to_do(
    make_app: Callable[..., App], qname: str
) -> None:
    _, err = await _conflict(make_app, qname, old={"delivery_limit": 5}, new={"delivery_limit": 6})

    assert err.queue == qname
    assert err.argument == "x-delivery-limit"
    text = str(err)
    assert repr(qname) in text
    assert "'x-delivery-limit'" in text
    # it must tell the operator the two ways out
    assert "keep the old value" in text
    assert f"rabbitmqctl delete_queue {qname}" in text
    # and the existing queue is untouched
    queues = await _queues_named(qname)
    assert queues[qname]["arguments"]["x-delivery-limit"] == 5


async def test_adding_a_max_length_to_an_existing_queue_is_a_conflict_naming_that_argument(
    make_app: Callable[..., App], qname: str
) -> None:
    _, err = await _conflict(make_app, qname, old={}, new={"max_length": 10})

    assert err.queue == qname
    assert err.argument == "x-max-length"


async def test_a_conflict_does_not_stop_the_app_from_declaring_again(
    make_app: Callable[..., App], qname: str
) -> None:
    # the conflict closes the declaring channel; the next declare must use a fresh one
    old, _ = await _conflict(make_app, qname, old={"delivery_limit": 5}, new={"delivery_limit": 6})

    assert qname in await old.declare()


PARKED_MS = 4000  # a delay older versions declared (STEP_DELAYS_MS, DEFER_LADDER_MS)


def _old_delay_arguments(delay_ms: int, lane: str | None = None) -> dict[str, Any]:
    """A delay queue as versions before the shared ladder declared it: dead-lettering through
    the default exchange, by the message's routing key (per handler) or to ``lane``
    (per lane, older still)."""
    args: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
        "x-message-ttl": delay_ms,
    }
    if lane is not None:
        args["x-dead-letter-routing-key"] = lane
    return args


async def test_an_upgrade_from_per_handler_delay_queues_and_lanes_loses_nothing(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
) -> None:
    """Issue 25, item 3. The previous version's topology, rebuilt by name and arguments (a
    handler with lanes and its own delay queues), holds tasks: parked in Q.retry.lanes.1s for
    Q and for its HIGH lane, in an even older per-lane delay queue, waiting in the HIGH lane.
    This version's worker (no priorities: no lanes) runs every one of them: the old delay
    queues hand theirs back by name, ``weclaw-mq migrate`` moves the lane's to Q and deletes
    each old queue once empty (never a non-empty one), and stats lists them while they exist."""
    app = make_app()
    ran: list[str] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=1, delay_s=0.2))
    async def handle(task: dict[str, str]) -> None:
        ran.append(task["text"])

    high = lane_queue_name(qname, "high")
    # Parked for 4 s: the first migrate must find both still holding their task (at 200 ms
    # one had expired under load and been deleted as empty before the test looked).
    per_handler = delay_queue_name(qname, PARKED_MS)
    per_lane = retry_queue_name(high, PARKED_MS)
    old = [high, lane_queue_name(qname, "urgent"), per_handler, per_lane]
    try:
        await app.declare()  # Q and Q.dlq are declared as the old version did
        for lane in old[:2]:
            await amqp.declare_queue(
                lane, durable=True, arguments=work_queue_arguments(app.handlers[qname].queue_spec())
            )
        await amqp.declare_queue(
            per_handler, durable=True, arguments=_old_delay_arguments(PARKED_MS)
        )
        exchange = await amqp.declare_exchange(per_handler, aio_pika.ExchangeType.FANOUT)
        await (await amqp.get_queue(per_handler, ensure=False)).bind(exchange, routing_key="")
        await amqp.declare_queue(
            per_lane, durable=True, arguments=_old_delay_arguments(PARKED_MS, lane=high)
        )
        # As the old worker parked and routed them.
        await exchange.publish(app.prepare(qname, {"text": "parked-q"}), routing_key=qname)
        await exchange.publish(app.prepare(qname, {"text": "parked-high"}), routing_key=high)
        await amqp.default_exchange.publish(
            app.prepare(qname, {"text": "per-lane"}), routing_key=per_lane
        )
        await amqp.default_exchange.publish(
            app.prepare(qname, {"text": "in-high"}), routing_key=high
        )

        got = await queue_stats.stats(app, qname, retry_delays_ms=(PARKED_MS,))
        listed = {c.name: c.role for c in got.old}
        assert listed == {per_handler: "old", per_lane: "old", old[0]: "old", old[1]: "old"}

        summary = await migrate(app)  # while the old delay queues still hold tasks
        assert per_handler in {k.name for k in summary.kept}
        assert per_handler not in summary.deleted and high not in summary.deleted

        await start_worker(app)
        await wait_until(lambda: "parked-q" in ran, 15, "the old delay queue's task for Q")
        await wait_until(
            lambda: _depth_is(amqp, per_handler, 0), 15, "the old delay queue to empty"
        )
        await wait_until(lambda: _depth_is(amqp, per_lane, 0), 15, "the per-lane one too")

        summary = await migrate(app)
        assert {per_handler, per_lane, *old[:2]} <= set(summary.deleted)
        assert summary.moved == {high: 3}  # in-high, parked-high, per-lane
        await wait_until(lambda: len(ran) == 4, 15, "every old task to run")
        assert sorted(ran) == ["in-high", "parked-high", "parked-q", "per-lane"]
        assert (await queue_stats.stats(app, qname, retry_delays_ms=(PARKED_MS,))).old == ()
    finally:
        for name in old:
            await amqp.queue_delete(name)
        await amqp.exchange_delete(per_handler)


async def _depth_is(amqp: AbstractChannel, queue: str, n: int) -> bool:
    return await queue_depth(amqp, queue) == n

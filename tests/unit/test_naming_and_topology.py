"""Queue names and queue arguments: pure functions, checked without a broker."""

from __future__ import annotations

from typing import Any, cast

import pytest

from weclaw_mq import App, ConfigurationError, Limit
from weclaw_mq.admin.migrate import _delete_if_empty
from weclaw_mq.contract.naming import (
    RETURN_EXCHANGE,
    UNROUTABLE,
    delay_label,
    delay_queue_name,
    dlq_name,
    is_shared_name,
    ladder_queue_name,
    parking_queue_name,
    retry_queue_name,
    validate_queue_name,
)
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.policy.limits import DEFER_LADDER_MS
from weclaw_mq.wire.topology import (
    QueueSpec,
    delay_exchanges,
    delay_queue_arguments,
    dlq_arguments,
    ladder_declarations,
    queue_declarations,
    work_queue_arguments,
)


def test_dlq_name_appends_dot_dlq() -> None:
    assert dlq_name("summarise") == "summarise.dlq"


@pytest.mark.parametrize(
    ("delay_ms", "label"),
    [(5_000, "5s"), (60_000, "60s"), (250, "250ms"), (1_500, "1500ms"), (1, "1ms")],
)
def test_delay_label_reads_as_seconds_when_whole_and_milliseconds_otherwise(
    delay_ms: int, label: str
) -> None:
    assert delay_label(delay_ms) == label


def test_delay_queue_names_carry_the_readable_delay() -> None:
    assert ladder_queue_name(5_000) == "weclaw_mq.delay.5s"
    assert ladder_queue_name(250) == "weclaw_mq.delay.250ms"
    # The per-handler names of the previous version (found by 'weclaw-mq stats' / migrate).
    assert delay_queue_name("summarise", 5_000) == "summarise.retry.lanes.5s"
    assert delay_queue_name("summarise", 250) == "summarise.retry.lanes.250ms"
    # The per-lane names of older versions (still found by 'weclaw-mq stats').
    assert retry_queue_name("summarise", 5_000) == "summarise.retry.5s"


def test_shared_delay_queue_names_meet_no_per_lane_name_of_an_older_version() -> None:
    # Declaring the new arguments under an old name would be refused (inequivalent arg).
    lanes = ["work", "work.lane.high", "work.lane.urgent"]
    delays = (1, 250, 1_000, 5_000, 1_024_000)
    old = {retry_queue_name(lane, d) for lane in lanes for d in delays}
    assert not old & {delay_queue_name("work", d) for d in delays}


@pytest.mark.parametrize(
    "name", ["summarise", "a", "ai.summarise", "ai:summarise-v2", "Q_1", "7up"]
)
def test_ordinary_queue_names_are_accepted_unchanged(name: str) -> None:
    assert validate_queue_name(name) == name


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("", "1 to 200 bytes"),
        ("x" * 201, "1 to 200 bytes"),
        ("amq.work", "reserved"),
        ("weclaw_mq.delay.5s", "shared queues"),
        ("has space", "letters, digits"),
        ("-leading-dash", "start with a letter or digit"),
        (".hidden", "start with a letter or digit"),
        ("slash/name", "letters, digits"),
        ("unicodé", "letters, digits"),
        ("summarise.dlq", "derived"),
        ("summarise.retry.5s", "derived"),
    ],
)
def test_queue_names_that_cannot_work_are_refused(name: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        validate_queue_name(name)


def test_longest_accepted_name_still_fits_amqp_after_suffixes() -> None:
    name = "q" * 200
    validate_queue_name(name)
    # AMQP short strings stop at 255 bytes; every derived name must stay under that.
    assert len(delay_queue_name(name, 123_456_789).encode()) <= 255
    assert len(dlq_name(name).encode()) <= 255


def _spec(**overrides: object) -> QueueSpec:
    values: dict[str, object] = {
        "name": "work",
        "retry_delays_ms": (100, 200),
        "delivery_limit": 7,
    }
    values.update(overrides)
    return QueueSpec(**values)  # type: ignore[arg-type]


def test_work_queue_is_quorum_and_dead_letters_to_its_dlq_at_least_once() -> None:
    args = work_queue_arguments(_spec())
    assert args == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "work.dlq",
        "x-dead-letter-strategy": "at-least-once",
        # at-least-once dead-lettering is only honoured with reject-publish overflow
        "x-overflow": "reject-publish",
        "x-delivery-limit": 7,
    }


def test_work_queue_has_a_max_length_only_when_asked() -> None:
    assert "x-max-length" not in work_queue_arguments(_spec())
    assert work_queue_arguments(_spec(max_length=500))["x-max-length"] == 500


def test_delay_queue_expires_after_its_delay_back_by_the_messages_own_routing_key() -> None:
    args = delay_queue_arguments(250)
    assert args["x-message-ttl"] == 250
    # Through the return exchange (its alternate exchange parks a task whose queue is gone).
    assert args["x-dead-letter-exchange"] == RETURN_EXCHANGE
    # No routing key of its own: a message goes back to the lane it was published with.
    assert "x-dead-letter-routing-key" not in args
    assert args["x-dead-letter-strategy"] == "at-least-once"
    assert args["x-overflow"] == "reject-publish"
    assert args["x-queue-type"] == "quorum"
    # a crash-loop limit belongs to the work queue only
    assert "x-delivery-limit" not in args


def test_dlq_holds_messages_forever() -> None:
    args = dlq_arguments()
    assert args == {"x-queue-type": "quorum"}
    for never in ("x-message-ttl", "x-max-length", "x-dead-letter-exchange", "x-expires"):
        assert never not in args


def test_a_handler_declares_its_dlq_and_queue_the_delays_are_the_vhosts() -> None:
    spec = _spec(retry_delays_ms=(100, 200, 5_000), priorities=True)
    # 4.3 has native priorities: no lanes.
    decls = queue_declarations(spec, ServerVersion(4, 3, 0))
    assert [name for name, _ in decls] == ["work.dlq", "work"]
    by_name = dict(decls)
    assert by_name["work.dlq"] == dlq_arguments(ServerVersion(4, 3, 0))
    assert by_name["work"] == work_queue_arguments(spec)
    shared = ladder_declarations([spec, _spec(name="other", retry_delays_ms=(5_000, 7))])
    # The parking queue, then one delay queue per delay of ANY handler, shortest first.
    assert [n for n, _ in shared] == [
        "weclaw_mq.unroutable.dlq",
        "weclaw_mq.delay.7ms",
        "weclaw_mq.delay.100ms",
        "weclaw_mq.delay.200ms",
        "weclaw_mq.delay.5s",
    ]
    assert dict(shared)["weclaw_mq.delay.5s"] == delay_queue_arguments(5_000)
    assert dict(shared)["weclaw_mq.unroutable.dlq"] == dlq_arguments()
    # Each delay queue has its fanout exchange of the same name.
    assert delay_exchanges(spec) == [ladder_queue_name(d) for d in (100, 200, 5_000)]


def test_declarations_without_retries_are_just_the_dlq_and_the_work_queue() -> None:
    assert [n for n, _ in queue_declarations(_spec(retry_delays_ms=()), ServerVersion(4, 3))] == [
        "work.dlq",
        "work",
    ]


def test_on_a_lane_plan_each_lane_is_declared_like_q_only_with_priorities() -> None:
    spec = _spec(retry_delays_ms=(100,), priorities=True)
    decls = dict(queue_declarations(spec, ServerVersion(3, 10, 8)))
    assert list(decls) == ["work.dlq", "work", "work.lane.high", "work.lane.urgent"]
    # Q is unchanged (no upgrade conflict); every lane dead-letters to the one Q.dlq.
    assert decls["work"] == work_queue_arguments(spec)
    assert decls["work.lane.urgent"] == decls["work"]
    # Without priorities (the default) no lanes, on every version.
    plain = _spec(retry_delays_ms=(100,))
    for version in (ServerVersion(3, 10, 8), ServerVersion(4, 0, 0), None):
        assert [n for n, _ in queue_declarations(plain, version)] == ["work.dlq", "work"]


def test_a_classic_handler_queue_has_native_priorities_and_no_quorum_only_arguments() -> None:
    spec = _spec(retry_delays_ms=(100,), queue_type="classic")
    decls = dict(queue_declarations(spec, ServerVersion(3, 10, 8)))
    assert list(decls) == ["work.dlq", "work"]
    assert decls["work"]["x-queue-type"] == "classic"
    assert decls["work"]["x-max-priority"] == 2
    assert "x-delivery-limit" not in decls["work"]
    assert "x-dead-letter-strategy" not in decls["work"]
    assert decls["work"]["x-dead-letter-routing-key"] == "work.dlq"


def test_declaration_arguments_are_fresh_dicts_each_call() -> None:
    # a caller mutating one declaration must not change the next one
    first = work_queue_arguments(_spec())
    first["x-delivery-limit"] = 999
    assert work_queue_arguments(_spec())["x-delivery-limit"] == 7


# Each quorum queue holds ~3 of RabbitMQ's file handles (measured on 3.10.8; 927 handles at
# the default ulimit -n 1024): the queues per handler are what a broker can host. Before the
# vhost shared one delay ladder, a handler declared 13 (18 with limit=); before the lanes
# shared their delay queues, 31 (46).
QUORUM_QUEUES_PER_HANDLER = {
    ServerVersion(3, 10, 8): 4,
    ServerVersion(3, 13, 7): 4,
    ServerVersion(4, 0, 5): 4,
    ServerVersion(4, 2, 0): 4,
    ServerVersion(4, 3, 0): 2,
}


def _quorum_queue_count(app: App, queue: str, version: ServerVersion) -> int:
    decls = queue_declarations(app.handlers[queue].queue_spec(), version)
    return sum(args.get("x-queue-type") == "quorum" for _, args in decls)


def test_a_handler_declares_a_bounded_number_of_quorum_queues_on_a_lane_plan() -> None:
    app = App("count")

    @app.handler("plain")
    async def plain(task: dict[str, int]) -> None: ...

    @app.handler("limited", limit=Limit(key=lambda t: t["user"], concurrency=2))
    async def limited(task: dict[str, int]) -> None: ...

    @app.handler("ranked", priorities=True, limit=Limit(key=lambda t: t["user"], concurrency=2))
    async def ranked(task: dict[str, int]) -> None: ...

    for version, most in QUORUM_QUEUES_PER_HANDLER.items():
        # Q and its DLQ; lanes (3.x: no quorum priorities) only for the one with priorities.
        assert _quorum_queue_count(app, "plain", version) == 2
        assert _quorum_queue_count(app, "limited", version) == 2
        assert _quorum_queue_count(app, "ranked", version) == most
    # The delay ladder is the vhost's: a fixed set whatever the number of handlers.
    specs = [s.queue_spec() for s in app.handlers.values()]
    shared = ladder_declarations(specs)
    assert len(shared) == 1 + len(
        {*app.handlers["plain"].queue_spec().retry_delays_ms, *DEFER_LADDER_MS}
    )


@pytest.mark.parametrize(
    "name", [ladder_queue_name(1_000), parking_queue_name(), RETURN_EXCHANGE, UNROUTABLE]
)
async def test_migrate_never_deletes_a_queue_of_the_vhosts_shared_ladder(name: str) -> None:
    # Refused before any broker call (there is no connection here): other apps use them.
    assert is_shared_name(name)
    assert await _delete_if_empty(cast(Any, None), name) is False


@pytest.mark.parametrize(
    "name", ["work", "work.dlq", delay_queue_name("work", 1_000), "work.lane.high", "weclaw_mqx"]
)
def test_a_handlers_own_queues_are_not_shared_names(name: str) -> None:
    assert not is_shared_name(name)

"""The version-dependent part of the DLQ: a pure function of the broker's announced version."""

from __future__ import annotations

import pytest
from pamqp.commands import Basic

from weclaw_mq.admin.dlq_message import kept_properties, read_dead_letter, requeued_properties
from weclaw_mq.contract import headers as h
from weclaw_mq.policy.broker_version import ServerVersion, dlq_plan, parse_server_version
from weclaw_mq.wire.topology import QueueSpec, dlq_arguments, queue_declarations


@pytest.mark.parametrize(
    ("announced", "expected"),
    [
        ("3.10.8", ServerVersion(3, 10, 8)),
        (b"3.13.7", ServerVersion(3, 13, 7)),
        ("4.0.5", ServerVersion(4, 0, 5)),
        ("4.2.0-rc.1", ServerVersion(4, 2, 0)),
        ("4.3", ServerVersion(4, 3, 0)),
        ("", None),
        ("unknown", None),
        (None, None),
        (42, None),
    ],
)
def test_server_version_is_read_from_what_the_broker_announces(
    announced: object, expected: ServerVersion | None
) -> None:
    assert parse_server_version(announced) == expected


@pytest.mark.parametrize("announced", ["3.10.8", "3.13.7"])
def test_before_4_0_the_dlq_gets_no_delivery_limit_argument_because_minus_one_is_not_off_there(
    announced: str,
) -> None:
    plan = dlq_plan(parse_server_version(announced))

    assert plan.extra_arguments == {}
    assert plan.default_delivery_limit is None
    assert plan.policy_hint("q.dlq") is None
    assert plan.inspection == "rotate"


@pytest.mark.parametrize("announced", ["4.0.5", "4.2.1", "4.3.0"])
def test_from_4_0_a_new_dlq_turns_the_default_limit_of_20_off(announced: str) -> None:
    plan = dlq_plan(parse_server_version(announced))

    assert plan.extra_arguments == {"x-delivery-limit": -1}
    assert plan.default_delivery_limit == 20
    hint = plan.policy_hint("ai.replies.dlq")
    assert hint is not None and "'^ai\\.replies\\.dlq$'" in hint and '"delivery-limit": -1' in hint
    assert plan.inspection == "rotate"


def test_an_unknown_version_gets_the_plan_that_never_sets_minus_one() -> None:
    assert dlq_plan(None).extra_arguments == {}


def test_dlq_declaration_follows_the_plan_and_the_other_queues_do_not_depend_on_the_version() -> (
    None
):
    spec = QueueSpec(name="q", retry_delays_ms=(500,), delivery_limit=10)
    old = dict(queue_declarations(spec, ServerVersion(3, 10, 8)))
    new = dict(queue_declarations(spec, ServerVersion(4, 2, 0)))

    assert old["q.dlq"] == {"x-queue-type": "quorum"} == dlq_arguments()
    assert new["q.dlq"] == {"x-queue-type": "quorum", "x-delivery-limit": -1}
    assert {k: v for k, v in old.items() if k != "q.dlq"} == {
        k: v for k, v in new.items() if k != "q.dlq"
    }


def test_a_kept_copy_has_every_property_as_read_without_the_brokers_delivery_count() -> None:
    read = Basic.Properties(
        content_type="application/json",
        headers={h.X_DELIVERY_COUNT: 3, h.TRACE_ID: "t", "n": 1},
        delivery_mode=2,
        priority=4,
        correlation_id="c",
        reply_to="r",
        expiration="60000",
        message_id="m",
        message_type="ty",
        user_id="guest",
        app_id="a",
    )

    kept = kept_properties(read)

    assert kept.headers == {h.TRACE_ID: "t", "n": 1}
    for name in read.attributes():
        if name != "headers":
            assert getattr(kept, name) == getattr(read, name), name
    assert read.headers is not None and h.X_DELIVERY_COUNT in read.headers  # not mutated


def test_a_requeued_copy_is_persistent_without_expiry_or_user_and_restarts_at_attempt_1() -> None:
    read = Basic.Properties(
        headers={h.ATTEMPT: 3, h.RETURNS: 11, h.DEAD_LETTER_REASON: "delivery_limit"},
        delivery_mode=1,
        expiration="1000",
        user_id="someone",
        message_id="m",
    )

    copy = requeued_properties(read, at_ms=0)

    assert copy.headers == {
        h.ATTEMPT: 1,
        h.REQUEUED: 1,
        h.REQUEUED_AT: "1970-01-01T00:00:00+00:00",  # the re-drive's time, at_ms
    }
    assert (copy.delivery_mode, copy.expiration, copy.user_id) == (2, None, None)
    assert (copy.message_id, copy.content_type) == ("m", "application/json")


def test_a_requeued_expired_task_gets_a_fresh_lifetime_of_its_first_length() -> None:
    read = Basic.Properties(
        headers={h.ATTEMPT: 1, h.TTL_MS: 250, h.EXPIRES_AT: 1_000, h.DEAD_LETTER_REASON: "expired"},
        message_id="m",
    )

    copy = requeued_properties(read, at_ms=50_000)

    assert copy.headers is not None
    assert (copy.headers[h.EXPIRES_AT], copy.headers[h.TTL_MS]) == (50_250, 250)
    assert copy.expiration == "250"


@pytest.mark.parametrize(
    "odd",
    [
        {h.X_DEATH: 7},
        {h.X_DEATH: "expired"},
        {h.X_DEATH: {"reason": "rejected"}},
        {h.X_DEATH: [1, "two", None]},
        {h.DEAD_LETTER_REASON: 5, h.ATTEMPT: "3", h.ERROR_TYPE: b"\xff\xfe"},
        {h.FIRST_FAILURE_AT: 12, h.LAST_FAILURE_AT: {"t": 1}, h.TRACE_ID: [1]},
        {h.ERROR_TRACEBACK: 3.5, h.ORIGINAL_QUEUE: True},
    ],
)
def test_a_header_of_an_unexpected_type_reads_as_absent_and_never_raises(
    odd: dict[str, object],
) -> None:
    dead = read_dead_letter("task", odd, b"{}")

    assert dead.task_id == "task"
    assert dead.headers == odd
    assert isinstance(dead.reason, str)

"""The DLQ filter selects exactly what its options say, and an export record gives back the
exact body and properties it was written from. Pure: no broker."""

from __future__ import annotations

import base64
import json
import struct
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pamqp.commands import Basic

from weclaw_mq.admin.dlq_filter import EVERYTHING, DlqFilter, parse_time
from weclaw_mq.admin.dlq_message import (
    DeadLetter,
    encoded_properties,
    export_record,
    read_dead_letter,
    record_body,
    record_properties,
)
from weclaw_mq.contract import headers as h
from weclaw_mq.errors import ConfigurationError

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def letter(
    task_id: str,
    reason: str = "retries_exhausted",
    error_type: str | None = "RuntimeError",
    failed_at: datetime | None = NOW,
) -> DeadLetter:
    headers: dict[str, Any] = {h.DEAD_LETTER_REASON: reason}
    if error_type is not None:
        headers[h.ERROR_TYPE] = error_type
    if failed_at is not None:
        headers[h.LAST_FAILURE_AT] = failed_at.isoformat()
    return read_dead_letter(task_id, headers, b"{}")


# A mixed DLQ: reasons, error types (one written before stable names), times, one broker death.
LETTERS = [
    letter("a", "retries_exhausted", "RuntimeError", NOW - timedelta(hours=3)),
    letter("b", "rejected", "weclaw_mq.Reject", NOW - timedelta(hours=1)),
    letter("c", "retries_exhausted", "builtins.RuntimeError", NOW - timedelta(minutes=10)),
    letter("d", "invalid_payload", "weclaw_mq.InvalidPayload", NOW - timedelta(days=2)),
    letter("e", "expired", "weclaw_mq.TaskExpired", None),
    read_dead_letter(
        "f",
        {h.X_DEATH: [{"reason": "delivery_limit", "queue": "q", "time": NOW}]},
        b"{}",
    ),
]


def selected(where: DlqFilter) -> list[str]:
    return [d.task_id for d in LETTERS if where.matches(d)]


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (EVERYTHING, ["a", "b", "c", "d", "e", "f"]),
        (DlqFilter.of(task_ids=["b", "f", "zz"]), ["b", "f"]),
        # Old and new spellings of one error match one filter, given either way.
        (DlqFilter.of(error_types=["RuntimeError"]), ["a", "c"]),
        (DlqFilter.of(error_types=["builtins.RuntimeError"]), ["a", "c"]),
        (DlqFilter.of(error_types=["weclaw_mq.Reject", "weclaw_mq.TaskExpired"]), ["b", "e"]),
        (DlqFilter.of(reasons=["delivery_limit"]), ["f"]),
        (DlqFilter.of(reasons=["rejected", "invalid_payload"]), ["b", "d"]),
        # since is inclusive, until exclusive; no failure time matches no time filter.
        (DlqFilter.of(since=NOW - timedelta(hours=1)), ["b", "c", "f"]),
        (DlqFilter.of(until=NOW - timedelta(hours=1)), ["a", "d"]),
        (
            DlqFilter.of(since=NOW - timedelta(hours=4), until=NOW - timedelta(minutes=10)),
            ["a", "b"],
        ),
        # Filters combine with AND.
        (DlqFilter.of(reasons=["retries_exhausted"], since=NOW - timedelta(hours=1)), ["c"]),
        (DlqFilter.of(task_ids=["a", "b"], error_types=["weclaw_mq.Reject"]), ["b"]),
        (DlqFilter.of(reasons=["no-such-reason"]), []),
    ],
)
def test_a_filter_selects_exactly_the_dead_letters_its_options_name(
    where: DlqFilter, expected: list[str]
) -> None:
    assert selected(where) == expected


def test_a_broker_dead_letter_has_no_error_type_and_never_matches_an_error_type_filter() -> None:
    assert LETTERS[-1].error_type is None
    assert not DlqFilter.of(error_types=["RuntimeError"]).matches(LETTERS[-1])


def test_no_option_is_everything_and_any_option_is_not() -> None:
    assert DlqFilter.of().everything
    assert not DlqFilter.of(reasons=["rejected"]).everything
    assert not DlqFilter.of(since=NOW).everything


def test_since_after_until_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="--since"):
        DlqFilter.of(since=NOW, until=NOW - timedelta(seconds=1))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", NOW - timedelta(seconds=90)),
        ("15m", NOW - timedelta(minutes=15)),
        ("2h", NOW - timedelta(hours=2)),
        ("1.5h", NOW - timedelta(minutes=90)),
        ("3d", NOW - timedelta(days=3)),
        ("1w", NOW - timedelta(weeks=1)),
        ("2026-11-30T08:00:00+02:00", datetime(2026, 11, 30, 6, 0, tzinfo=UTC)),
        ("2026-11-30T08:00", datetime(2026, 11, 30, 8, 0, tzinfo=UTC)),  # no offset: UTC
        ("2026-11-30", datetime(2026, 11, 30, tzinfo=UTC)),
    ],
)
def test_a_time_is_iso_8601_or_a_duration_before_now(text: str, expected: datetime) -> None:
    assert parse_time(text, now=NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "2h ago", "-2h", "12x", ""])
def test_a_time_that_is_neither_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ConfigurationError, match="ISO-8601"):
        parse_time(text, now=NOW)


# -- export records ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "encoding", "exact_copy"),
    [
        (b'{"text":"doc-1","n":[1,2.5,null]}', "json", False),  # what our producer writes
        ('{"text":"caf\u00e9"}'.encode(), "json", False),
        (b'{"text": "spaced"}', "json", True),  # re-encoding would drop the spaces
        (b"1e3", "json", True),  # ... and spell the number 1000.0
        (b"plain words", "utf-8", False),
        (b"\x00\xff binary", "base64", False),
        (b"", "utf-8", False),
    ],
)
def test_an_exported_body_is_a_json_value_when_it_is_json_and_comes_back_byte_for_byte(
    body: bytes, encoding: str, exact_copy: bool
) -> None:
    record = json.loads(json.dumps(export_record(read_dead_letter("t", {}, body))))

    assert record["body_encoding"] == encoding
    if encoding == "json":
        assert record["body"] == json.loads(body)  # an object for jq, not a string
    assert ("body_bytes" in record) is exact_copy
    assert record_body(record) == body


def test_exported_properties_come_back_as_the_same_bytes_without_the_delivery_count() -> None:
    properties = Basic.Properties(
        message_id="t-1",
        content_type="application/json",
        delivery_mode=2,
        priority=3,
        timestamp=datetime(2026, 11, 30, 12, 0, tzinfo=UTC),
        headers={h.ATTEMPT: 2, "x-ratio": 0.1, h.X_DELIVERY_COUNT: 4},
    )
    record = export_record(
        read_dead_letter("t-1", properties.headers, b"{}"), encoded_properties(properties)
    )

    raw = record_properties(json.loads(json.dumps(record))).marshal()
    back = Basic.Properties()
    back.unmarshal(struct.unpack(">H", raw[:2])[0], raw[2:])

    assert back.message_id == "t-1" and back.priority == 3 and back.delivery_mode == 2
    assert back.timestamp == properties.timestamp
    assert back.headers == {h.ATTEMPT: 2, "x-ratio": 0.1}  # a 64-bit float stays 0.1


@pytest.mark.parametrize(
    "record",
    [
        {"body": {}, "body_encoding": "json"},  # no amqp_properties: an older export
        {"body": {}, "body_encoding": "json", "amqp_properties": "!!not base64!!"},
        {"body": {}, "body_encoding": "json", "amqp_properties": base64.b64encode(b"x").decode()},
    ],
)
def test_a_record_without_usable_properties_is_refused(record: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        record_properties(record)


def test_a_re_drive_is_read_from_its_headers() -> None:
    dead = read_dead_letter("t", {h.REQUEUED: 2, h.REQUEUED_AT: "2026-12-01T11:00:00+00:00"}, b"{}")

    assert dead.requeued == 2
    assert dead.last_requeued_at == datetime(2026, 12, 1, 11, 0, tzinfo=UTC)
    record = export_record(dead)
    assert record["requeued"] == 2 and record["last_requeued_at"] == "2026-12-01T11:00:00+00:00"
    never = read_dead_letter("t", {}, b"{}")
    assert never.requeued == 0 and never.last_requeued_at is None

"""``dlq import`` checks each record's property bytes as RabbitMQ parses them before it
publishes anything (``admin.dlq_properties``): whatever pamqp encodes passes (but a NaN or
infinite float, which RabbitMQ refuses with INTERNAL_ERROR), and no bytes break the check
with anything but a ``ValueError`` saying what is wrong."""

from __future__ import annotations

import math
import re
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp.commands import Basic

from tests.hostile import fuzz_settings, properties
from weclaw_mq.admin.dlq_properties import check_properties

GOOD = Basic.Properties(
    message_id="t-1", content_type="application/json", delivery_mode=2, headers={"a": 1}
).marshal()


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


@fuzz_settings(200)
@given(props=properties())
def test_every_property_set_pamqp_encodes_passes_unless_it_holds_a_nan_or_infinity(
    props: dict[str, Any],
) -> None:
    props = {("message_type" if k == "type" else k): v for k, v in props.items()}
    raw = Basic.Properties(**props).marshal()

    if _non_finite(props.get("headers")):
        with pytest.raises(ValueError, match="RabbitMQ does not parse"):
            check_properties(raw, decodable=True, user=None)
    else:
        check_properties(raw, decodable=True, user=None)


@fuzz_settings(300)
@given(data=st.binary(max_size=300))
def test_random_bytes_are_refused_with_a_value_error_or_pass(data: bytes) -> None:
    try:
        check_properties(data, decodable=False, user=None)
    except ValueError as e:
        assert str(e)


def _shortstr(text: bytes) -> bytes:
    return bytes([len(text)]) + text


MESSAGE_ID_FLAG = Basic.Properties.flags["message_id"]
HEADERS_FLAG = Basic.Properties.flags["headers"]


def _headers(table: bytes) -> bytes:
    return struct.pack(">H", HEADERS_FLAG) + struct.pack(">I", len(table)) + table


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        (b"\x80", "shorter than its 2 flag bytes"),
        (struct.pack(">H", MESSAGE_ID_FLAG | 1) + _shortstr(b"x"), "flag bits"),
        (struct.pack(">H", MESSAGE_ID_FLAG) + b"\x09abc", "ends inside message_id"),
        (GOOD + b"\x00", "1 byte(s) after its last property"),
        (_headers(_shortstr(b"k") + b"Z"), "field type b'Z'"),
        (_headers(_shortstr(b"k") + b"d" + struct.pack(">d", math.nan)), "does not parse"),
        (_headers(_shortstr(b"k") + b"f" + struct.pack(">f", math.inf)), "does not parse"),
        (struct.pack(">H", HEADERS_FLAG) + struct.pack(">I", 50) + b"\x00", "ends inside headers"),
        (
            struct.pack(">H", Basic.Properties.flags["expiration"]) + _shortstr(b"soon"),
            "is not a number of milliseconds",
        ),
        (
            struct.pack(">H", Basic.Properties.flags["user_id"]) + _shortstr(b"mallory"),
            "is not the importing user 'guest'",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_each_damage_is_named(raw: bytes, complaint: str) -> None:
    with pytest.raises(ValueError, match=re.escape(complaint)):
        check_properties(raw, decodable=False, user="guest")


def test_a_message_id_that_is_not_utf8_passes_only_for_an_undecodable_record() -> None:
    # What an export of an undecodable_properties dead letter holds: the broker took it.
    raw = struct.pack(">H", MESSAGE_ID_FLAG) + _shortstr(b"\xff\xfe")

    check_properties(raw, decodable=False, user=None)
    with pytest.raises(ValueError, match="does not decode"):
        check_properties(raw, decodable=True, user=None)


def test_the_importing_users_own_user_id_passes() -> None:
    raw = struct.pack(">H", Basic.Properties.flags["user_id"]) + _shortstr(b"guest")

    check_properties(raw, decodable=True, user="guest")

"""Stream event ids, session ids and the stored form of events: refused early, read back
exactly."""

from __future__ import annotations

from typing import Any

import pytest

from weclaw_mq import ConfigurationError, PayloadError, TaskState, TaskStatus
from weclaw_mq.contract.message import encode_payload
from weclaw_mq.contract.naming import inbox_key, validate_session_id
from weclaw_mq.streaming.events import (
    attempt_entry,
    check_event_id,
    chunk_entry,
    decode,
    encode_data,
    final_entry,
    id_key,
    next_id,
)


@pytest.mark.parametrize("good", ["user-42", "a@b.example", "conv:7_x.y", "x" * 200])
def test_a_session_id_of_the_allowed_characters_is_kept(good: str) -> None:
    assert validate_session_id(good) == good
    assert inbox_key(good) == f"weclaw_mq:inbox:{{{good}}}"


@pytest.mark.parametrize("bad", ["", "x" * 201, "a{b", "a}b", "a b", "ab\n", "é", 42, None])
def test_a_session_id_that_would_break_its_key_or_header_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="session id"):
        validate_session_id(bad)


@pytest.mark.parametrize("bad", ["", "0", "1-", "-1", "1-2-3", "1-0\n", "a-0", "$", ">"])
def test_an_event_id_that_is_not_a_stream_id_is_refused(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="event id"):
        check_event_id(bad)


def test_event_ids_order_by_number_and_next_id_is_just_after() -> None:
    assert id_key("9-5") < id_key("10-0") < id_key("10-1")
    assert next_id("10-1") == "10-2"
    assert check_event_id("1733011200000-0") == "1733011200000-0"


def test_every_kind_of_entry_reads_back_as_the_event_it_stored() -> None:
    assert decode("1-0", attempt_entry("t", 2).body).kind == "attempt"
    chunk = decode("1-1", chunk_entry("t", 2, encode_data({"w": "é"})).body)
    assert (chunk.id, chunk.kind, chunk.task_id, chunk.attempt, chunk.data) == (
        "1-1",
        "chunk",
        "t",
        2,
        {"w": "é"},
    )
    state = TaskState(
        task_id="t", queue="q", status=TaskStatus.DEAD_LETTERED, attempt=3, reason="rejected"
    )
    final = decode("1-2", final_entry(state).body)
    assert (final.queue, final.status, final.reason, final.attempt) == (
        "q",
        "dead_lettered",
        "rejected",
        3,
    )


def test_an_expired_record_written_by_lua_with_no_tasks_reads_as_an_empty_list() -> None:
    # Lua's cjson cannot tell an empty list from an empty object: it writes {}.
    body = b'{"kind":"expired","task_id":"","data":{"tasks":{},"entries":3}}'
    assert decode("5-0", body).data == {"tasks": [], "entries": 3}


def test_a_value_that_is_not_json_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"ctx\.emit takes str or JSON"):
        encode_data(object())


@pytest.mark.parametrize("chunk", [float("nan"), {"p": [1.0, float("inf")]}, -float("inf")])
def test_nan_and_infinities_are_refused_like_a_task_body_not_written_as_null(chunk: Any) -> None:
    with pytest.raises(TypeError, match="NaN and infinities have no JSON form"):
        encode_data(chunk)
    with pytest.raises(PayloadError, match="NaN and infinities have no JSON form"):
        encode_payload(chunk)


def test_text_that_spells_nan_or_infinity_is_plain_json_text() -> None:
    assert encode_data({"word": "NaN", "more": "Infinity"}) == b'{"word":"NaN","more":"Infinity"}'

"""The pure parts of least privilege and of the checks on values we carry on."""

from __future__ import annotations

import logging
import re

import pytest

from weclaw_mq.admin.permissions import NOTHING, any_of, vhost_of
from weclaw_mq.contract import header_values
from weclaw_mq.contract import headers as h


@pytest.mark.parametrize("name", ["ai-tasks", "a.b+c", "x(y)|z", "q.retry.5s", "ünï"])
def test_a_queue_regex_matches_exactly_its_names(name: str) -> None:
    pattern = any_of([name, "other"])
    assert re.fullmatch(pattern, name) and re.fullmatch(pattern, "other")
    for near in (name + "x", "x" + name, name.replace(".", "X"), ""):
        if near not in (name, "other"):
            assert not re.fullmatch(pattern, near), near


def test_no_names_grant_nothing() -> None:
    assert any_of([]) == NOTHING and not re.fullmatch(NOTHING, "amq.default")


@pytest.mark.parametrize(
    ("url", "vhost"),
    [
        ("amqp://u:p@h:5672/", "/"),
        ("amqp://u:p@h:5672", "/"),
        ("amqp://u:p@h/%2F", "/"),
        ("amqp://u:p@h/apps", "apps"),
    ],
)
def test_the_vhost_of_a_url(url: str, vhost: str) -> None:
    assert vhost_of(url) == vhost


def test_an_unsafe_task_id_gets_the_same_stand_in_every_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    first = header_values.task_id("abc\nFORGED ERROR line")
    assert first == header_values.task_id("abc\nFORGED ERROR line")
    assert first.startswith("unsafe-") and first.isprintable()
    assert header_values.task_id("plain-id") == "plain-id"
    assert "\\n" in caplog.text and "FORGED ERROR line\n" not in caplog.text


def test_bad_values_of_ours_are_dropped_and_a_bad_trace_id_replaced() -> None:
    headers = {
        h.ATTEMPT: "3",
        h.RETURNS: -1,
        h.EXPIRES_AT: 2**62,
        h.TTL_MS: True,
        h.TRACE_ID: "t" * 10_000,
        h.TRACEPARENT: "00-xyz",
        "x-theirs": "\n kept as it is",
    }
    out = header_values.checked(headers)
    assert set(out) == {h.TRACE_ID, "x-theirs"}
    assert len(out[h.TRACE_ID]) == 32 and out["x-theirs"] == "\n kept as it is"
    good = {h.ATTEMPT: 2, h.TRACE_ID: "abc-123", h.EXPIRES_AT: 1_800_000_000_000}
    assert header_values.checked(good) is good

"""The console's access rules, audit lines, escaping and DLQ filter fields, without a server:
``console.access`` (token, CSRF, same origin, loopback), ``console.sessions`` (sign-ins,
throttle), ``console.audit``,
the autoescaped templates (``console.rendering``) and ``console.dead_letters.filter_of``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from weclaw_mq.admin.dlq_filter import DlqFilter
from weclaw_mq.console import rendering
from weclaw_mq.console.access import (
    ANONYMOUS,
    Access,
    fingerprint,
    is_loopback,
    mutation_refusal,
    same_origin,
)
from weclaw_mq.console.audit import IDS_LISTED_MAX, audit_line
from weclaw_mq.console.dead_letters import EXACT_MAX, Preview, filter_of
from weclaw_mq.console.detail import check_trace_url, trace_link
from weclaw_mq.console.events import sse_frame
from weclaw_mq.console.sessions import FORGET_S, FREE_FAILURES, MAX_WAIT_S, Sessions, Throttle
from weclaw_mq.console.task_views import query_of
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.state import TaskStatus
from weclaw_mq.state.task_index import make_cursor
from weclaw_mq.streaming.events import StreamEvent

TOKEN = "a-console-token-of-some-length"
HOST = "127.0.0.1:8765"


def refusal(access: Access, **overrides: object) -> str | None:
    request: dict[str, object] = {
        "identity": ANONYMOUS,
        "csrf": access.csrf_value(ANONYMOUS),
        "origin": f"http://{HOST}",
        "referer": None,
        "host": HOST,
        "bearer": False,
        **overrides,
    }
    return mutation_refusal(access, **request)  # type: ignore[arg-type]


def test_the_token_is_checked_and_its_fingerprint_names_the_caller() -> None:
    access = Access(token=TOKEN)
    assert access.identity(TOKEN) == fingerprint(TOKEN)
    assert access.identity(TOKEN + "x") is None
    assert access.identity("") is None
    assert access.identity(None) is None
    assert len(fingerprint(TOKEN)) == 8 and fingerprint(TOKEN) not in TOKEN


def test_without_a_token_every_caller_is_anonymous() -> None:
    access = Access()
    assert access.identity(None) == ANONYMOUS


class FakeClock:
    """A clock the test moves: expiry and waits are checked without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_sign_in_gets_its_own_session_id_that_is_not_the_token_and_expires() -> None:
    clock = FakeClock()
    sessions = Sessions(ttl_s=3600, clock=clock)
    first, second = sessions.open("abcd1234"), sessions.open("abcd1234")
    assert first != second and len(first) >= 40
    assert TOKEN not in first and fingerprint(TOKEN) not in first
    assert sessions.identity_of(first) == "abcd1234"
    assert sessions.identity_of(first[:-1] + ("A" if first[-1] != "A" else "B")) is None
    assert sessions.identity_of(None) is None and sessions.identity_of("") is None
    clock.now += 3599
    assert sessions.identity_of(first) == "abcd1234"
    clock.now += 1
    assert sessions.identity_of(first) is None and sessions.identity_of(second) is None
    assert Sessions(ttl_s=3600).identity_of(first) is None  # another console process


def test_signing_out_revokes_that_session_only() -> None:
    sessions = Sessions(ttl_s=3600)
    mine, other = sessions.open("abcd1234"), sessions.open("abcd1234")
    assert sessions.revoke(mine)
    assert sessions.identity_of(mine) is None
    assert sessions.identity_of(other) == "abcd1234"
    assert not sessions.revoke(mine) and not sessions.revoke(None)


def test_a_session_ttl_must_be_positive() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError, match="session_ttl_s"):
            Access(token=TOKEN, session_ttl_s=bad)


def test_wrong_tokens_are_free_a_few_times_then_each_wait_doubles() -> None:
    clock = FakeClock()
    throttle = Throttle(clock=clock)
    for _ in range(FREE_FAILURES):
        assert throttle.wait_s("10.0.0.9") == 0
        throttle.failed("10.0.0.9")
    assert throttle.wait_s("10.0.0.9") == 1.0
    assert throttle.wait_s("10.0.0.8") == 0  # per client
    clock.now += 1
    assert throttle.wait_s("10.0.0.9") == 0
    throttle.failed("10.0.0.9")
    assert throttle.wait_s("10.0.0.9") == 2.0
    for _ in range(30):
        throttle.failed("10.0.0.9")
    assert throttle.wait_s("10.0.0.9") == MAX_WAIT_S
    throttle.succeeded("10.0.0.9")
    assert throttle.wait_s("10.0.0.9") == 0


def test_a_try_made_while_throttled_is_not_looked_at_and_counts_as_a_failure() -> None:
    clock = FakeClock()
    throttle = Throttle(clock=clock)
    for _ in range(FREE_FAILURES):
        assert throttle.admit("10.0.0.9") == 0
        throttle.failed("10.0.0.9")
    clock.now += 0.5
    assert throttle.admit("10.0.0.9") == 0.5  # refused: half of the first second to go
    assert throttle.wait_s("10.0.0.9") == 2.0  # the refused try counted, from now


def test_a_clients_failures_are_forgotten_an_hour_after_the_last() -> None:
    clock = FakeClock()
    throttle = Throttle(clock=clock)
    for _ in range(FREE_FAILURES + 3):
        throttle.failed("10.0.0.9")
    clock.now += FORGET_S
    assert throttle.wait_s("10.0.0.9") == 0
    throttle.failed("10.0.0.9")  # counts from one again
    assert throttle.wait_s("10.0.0.9") == 0


def test_a_mutation_with_the_csrf_value_from_the_console_itself_goes_on() -> None:
    assert refusal(Access()) is None


def test_a_mutation_without_or_with_a_wrong_csrf_value_is_refused() -> None:
    access = Access()
    assert "CSRF" in (refusal(access, csrf=None) or "")
    assert "CSRF" in (refusal(access, csrf="0" * 64) or "")
    other = Access()  # the value of another console process
    assert "CSRF" in (refusal(access, csrf=other.csrf_value(ANONYMOUS)) or "")


def test_the_csrf_value_is_bound_to_the_caller() -> None:
    access = Access(token=TOKEN)
    mine = access.csrf_value(fingerprint(TOKEN))
    assert refusal(access, identity=fingerprint(TOKEN), csrf=mine) is None
    assert refusal(access, identity=fingerprint("another"), csrf=mine) is not None


def test_a_mutation_from_another_origin_is_refused() -> None:
    access = Access()
    assert "Origin" in (refusal(access, origin="https://evil.example") or "")
    assert "Origin" in (refusal(access, origin="null") or "")
    assert refusal(access, origin=None, referer=f"http://{HOST}/dead-letters") is None
    assert refusal(access, origin=None, referer="http://evil.example/x") is not None


def test_a_mutation_with_neither_origin_nor_referer_needs_a_bearer_token() -> None:
    access = Access(token=TOKEN)
    me = fingerprint(TOKEN)
    csrf = access.csrf_value(me)
    assert refusal(access, identity=me, csrf=csrf, origin=None, bearer=False) is not None
    assert refusal(access, identity=me, csrf=csrf, origin=None, bearer=True) is None


def test_read_only_refuses_every_mutation_whatever_it_carries() -> None:
    assert "read-only" in (refusal(Access(read_only=True)) or "")


def test_same_origin_compares_host_and_port() -> None:
    assert same_origin(f"http://{HOST}", None, HOST) is True
    assert same_origin("http://127.0.0.1:9999", None, HOST) is False
    assert same_origin(None, None, HOST) is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("127.0.0.2", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("console.example", False),
    ],
)
def test_only_loopback_addresses_count_as_this_machine(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_without_a_token_only_a_loopback_host_header_is_served() -> None:
    access = Access()
    assert access.host_allowed("127.0.0.1:8765")
    assert access.host_allowed("localhost:8765")
    assert access.host_allowed("[::1]:8765")
    assert not access.host_allowed("evil.example:8765")
    assert not access.host_allowed(None)
    assert Access(token=TOKEN).host_allowed("console.internal:443")


def test_an_audit_line_names_who_and_what_on_one_line() -> None:
    line = audit_line("10.0.0.7", "token:abcd1234", "dlq requeue", {"queue": 'a "q"\nb'})
    assert "\n" not in line
    assert line.startswith("console audit client=10.0.0.7 who=token:abcd1234 action=dlq requeue")
    assert 'queue="a \\"q\\"\\nb"' in line


def test_an_audit_line_lists_at_most_so_many_ids_and_counts_them_all() -> None:
    ids = [f"task-{i:04d}" for i in range(IDS_LISTED_MAX + 7)]
    line = audit_line("127.0.0.1", "anonymous", "dlq purge", {"task_ids": ids})
    assert f"task_ids_count={IDS_LISTED_MAX + 7}" in line
    assert "task-0000" in line and ids[-1] not in line


def test_the_templates_escape_a_payload_result_and_error() -> None:
    evil = "<script>alert(1)</script>"
    html = rendering._env.get_template("task_status.html").render(
        task_id=evil,
        problem=evil,
        state={
            "status": "succeeded",
            "attempt": 1,
            "updated_at": "2026-12-03T12:00:00+00:00",
            "expires_at": None,
            "error": evil,
            "reason": evil,
            "result": {"text": evil},
        },
        timeline=[
            {
                "at": "2026-12-03T12:00:00",
                "queue": evil,
                "status": "running",
                "attempt": 1,
                "error": evil,
                "reason": None,
            }
        ],
        timeline_problem=None,
    )
    assert "<script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_the_dead_letter_filter_fields_make_the_clis_filter() -> None:
    now = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    where = filter_of(
        {
            "error_type": "RateLimitError, builtins.ValueError",
            "reason": "",
            "since": "1h",
            "task_id": ["a", "b"],
        },
        now=now,
    )
    assert where == DlqFilter.of(
        task_ids=["a", "b"],
        error_types=["RateLimitError", "ValueError"],
        since=now - timedelta(hours=1),
    )
    assert filter_of({}).everything


def test_a_bad_time_in_the_dead_letter_filter_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="is not a time"):
        filter_of({"since": "yesterday-ish"})
    with pytest.raises(ConfigurationError, match="must be before"):
        filter_of({"since": "1h", "until": "2h"})


def test_a_confirmed_preview_selects_exactly_the_task_ids_it_listed() -> None:
    where = DlqFilter.of(error_types=["RateLimitError"])
    small = Preview("p", "requeue", "q", where, ("a", "b"), kept=3, made_at=0.0)
    run_where, limit = small.run_filter()
    assert run_where.task_ids == {"a", "b"} and run_where.error_types == where.error_types
    assert limit is None
    big_ids = tuple(f"t{i}" for i in range(EXACT_MAX + 1))
    big = Preview("p", "requeue", "q", where, big_ids, kept=0, made_at=0.0)
    assert big.run_filter() == (where, EXACT_MAX + 1)
    unnamed = Preview("p", "requeue", "q", where, ("a", ""), kept=0, made_at=0.0)
    assert not unnamed.exact


def test_the_tasks_page_fields_make_a_task_query() -> None:
    now = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    cursor = make_cursor(1_764_763_200_000, 0)
    query = query_of(
        {
            "queue": "q",
            "status": "dead_lettered",
            "error": " RateLimit ",
            "since": "1h",
            "task_id_prefix": "",
            "cursor": cursor,
            "limit": "20",
        },
        now=now,
    )
    assert query.queue == "q" and query.status is TaskStatus.DEAD_LETTERED
    assert query.error == "RateLimit" and query.since == now - timedelta(hours=1)
    assert query.task_id_prefix is None and query.cursor == cursor and query.limit == 20
    with pytest.raises(ConfigurationError, match="status 'lost' is not one of"):
        query_of({"status": "lost"})
    with pytest.raises(ConfigurationError, match="is not a number"):
        query_of({"limit": "many"})
    with pytest.raises(ConfigurationError, match="cursor"):
        query_of({"cursor": "not-a-cursor"})


def test_a_stream_event_is_one_sse_frame_named_by_its_kind() -> None:
    event = StreamEvent(id="17-0", kind="chunk", task_id="t", attempt=1, data="a\nb <i>")
    frame = sse_frame(event)
    assert frame.startswith("id: 17-0\nevent: chunk\ndata: {")
    assert frame.endswith("\n\n") and frame.count("\n") == 4  # the data stays on one line


def test_a_trace_url_needs_the_trace_id_field_and_links_it_quoted() -> None:
    template = "https://traces.example/t/{trace_id}"
    assert check_trace_url(template) == template
    assert trace_link(template, "ab/c d") == "https://traces.example/t/ab%2Fc%20d"
    assert trace_link(None, "abc") is None and trace_link(template, None) is None
    for bad in ("https://traces.example/", "javascript:alert(1)//{trace_id}"):
        with pytest.raises(ConfigurationError, match="must be an http"):
            check_trace_url(bad)


def test_the_commands_default_session_length_is_the_consoles() -> None:
    from weclaw_mq.cli import console_command
    from weclaw_mq.console import access

    assert console_command.DEFAULT_SESSION_TTL_S == access.DEFAULT_SESSION_TTL_S
    assert Access().session_ttl_s == access.DEFAULT_SESSION_TTL_S

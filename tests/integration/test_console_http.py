"""The console's door, over HTTP against the served console (real broker and Redis): a
mutating request without the token, the CSRF value or the console's own origin is refused
and changes nothing; a right one is served and written to the audit log without the token;
read-only refuses every change; a foreign Host is refused when no token guards the console."""

from __future__ import annotations

import logging
import re

import pytest

from tests.integration.console_live import (  # noqa: F401
    LiveConsole,
    console_access,
    console_trace_url,
    live_console,
)
from weclaw_mq import TaskStatus
from weclaw_mq.console import Access
from weclaw_mq.console.access import SESSION_COOKIE, fingerprint
from weclaw_mq.console.sessions import FREE_FAILURES, MAX_WAIT_S

TOKEN = "s3cret-console-token-for-tests"
GUARDED = [Access(token=TOKEN)]


def csrf_of(html: str) -> str:
    found = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', html)
    assert found, html[:500]
    return found.group(1)


@pytest.mark.parametrize("console_access", GUARDED)
async def test_without_the_token_every_page_and_action_is_refused(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    client = live_console.client
    page = await client.get("/tasks")
    assert page.status_code == 303 and page.headers["location"].startswith("/login?next=")
    assert (await client.get("/api/overview")).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token-at-all"}
    assert (await client.get("/api/overview", headers=wrong)).status_code == 401
    task_id = await live_console.publish({"mode": "ok"})
    cancel = await client.post(f"/api/tasks/{task_id}/cancel", json={}, headers=wrong)
    assert cancel.status_code == 401
    state = await live_console.console_app.status(task_id)
    assert state is not None and state.status is TaskStatus.QUEUED


@pytest.mark.parametrize("console_access", GUARDED)
async def test_a_mutation_needs_the_csrf_value_and_is_audited_without_the_token(
    live_console: LiveConsole,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = live_console.client
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    task_id = await live_console.publish({"mode": "ok"})
    caplog.set_level(logging.INFO, logger="weclaw_mq.console.audit")

    no_csrf = await client.post(f"/api/tasks/{task_id}/cancel", json={}, headers=bearer)
    assert no_csrf.status_code == 403, no_csrf.text
    assert "CSRF" in no_csrf.json()["error"]
    state = await live_console.console_app.status(task_id)
    assert state is not None and state.status is TaskStatus.QUEUED

    csrf = csrf_of((await client.get("/", headers=bearer)).text)
    told = (await client.get("/api/session", headers=bearer)).json()
    assert told == {"who": f"token:{fingerprint(TOKEN)}", "csrf": csrf, "read_only": False}
    foreign = {**bearer, "X-CSRF-Token": csrf, "Origin": "https://evil.example"}
    refused = await client.post(f"/api/tasks/{task_id}/cancel", json={}, headers=foreign)
    assert refused.status_code == 403, refused.text

    done = await client.post(
        f"/api/tasks/{task_id}/cancel", json={}, headers={**bearer, "X-CSRF-Token": csrf}
    )
    assert done.status_code == 200, done.text
    assert done.json()["outcome"] == "cancelled"
    state = await live_console.console_app.status(task_id)
    assert state is not None and state.status is TaskStatus.CANCELLED

    lines = [r.getMessage() for r in caplog.records if r.name == "weclaw_mq.console.audit"]
    assert len([line for line in lines if 'outcome="refused"' in line]) == 2, lines
    (ok,) = [line for line in lines if "action=cancel" in line]
    assert f"who=token:{fingerprint(TOKEN)}" in ok and task_id in ok, ok
    assert all(TOKEN not in line for line in lines), lines


@pytest.mark.parametrize("console_access", GUARDED)
async def test_the_sign_in_form_sets_a_strict_http_only_cookie_that_is_not_the_token(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    client = live_console.client
    origin = {"Origin": live_console.base_url}
    bad = await client.post("/login", data={"token": "wrong", "next": "/tasks"}, headers=origin)
    assert bad.status_code == 401
    signed = await client.post("/login", data={"token": TOKEN, "next": "/tasks"}, headers=origin)
    assert signed.status_code == 303 and signed.headers["location"] == "/tasks"
    cookie = signed.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie, cookie
    assert TOKEN not in cookie
    assert (await client.get("/api/overview")).status_code == 200  # the cookie is sent now
    # Another site's page posting wrong tokens here is refused and locks nobody out.
    foreign = {"Origin": "https://evil.example"}
    for _ in range(FREE_FAILURES + 3):
        bad = await client.post("/login", data={"token": "wrong"}, headers=foreign)
        assert bad.status_code == 401
    again = await client.post("/login", data={"token": TOKEN}, headers=origin)
    assert again.status_code == 303


@pytest.mark.parametrize("console_access", GUARDED)
async def test_each_sign_in_has_its_own_expiring_session_and_signing_out_revokes_it(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    client = live_console.client
    origin = {"Origin": live_console.base_url}
    cookies = []
    for _ in range(2):
        signed = await client.post("/login", data={"token": TOKEN}, headers=origin)
        assert signed.status_code == 303, signed.text
        assert f"Max-Age={12 * 3600}" in signed.headers["set-cookie"]
        cookies.append(signed.cookies[SESSION_COOKIE])
    client.cookies.clear()
    mine, other = cookies
    assert mine != other

    def as_(session: str) -> dict[str, str]:
        return {"Cookie": f"{SESSION_COOKIE}={session}"}

    assert (await client.get("/api/overview", headers=as_(mine))).status_code == 200
    csrf = csrf_of((await client.get("/", headers=as_(mine))).text)
    out = await client.post("/api/logout", headers={**as_(mine), **origin, "X-CSRF-Token": csrf})
    assert out.status_code == 200, out.text
    assert (await client.get("/api/overview", headers=as_(mine))).status_code == 401
    assert (await client.get("/api/overview", headers=as_(other))).status_code == 200


@pytest.mark.parametrize("console_access", GUARDED)
async def test_wrong_tokens_are_throttled_and_a_throttled_token_is_not_even_looked_at(
    live_console: LiveConsole,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = live_console.client
    origin = {"Origin": live_console.base_url}
    caplog.set_level(logging.INFO, logger="weclaw_mq.console.audit")
    answers = [
        (await client.post("/login", data={"token": f"wrong-{n}"}, headers=origin)).status_code
        for n in range(12)
    ]
    assert answers[:FREE_FAILURES] == [401] * FREE_FAILURES
    assert set(answers[FREE_FAILURES:]) <= {401, 429}, answers
    # Twelve failures in a row: the next try must wait 2**7 s after the last, right or wrong.
    right = await client.post("/login", data={"token": TOKEN}, headers=origin)
    assert right.status_code == 429, right.text
    assert 0 < int(right.headers["retry-after"]) <= MAX_WAIT_S
    assert "too many wrong tokens" in right.text
    assert SESSION_COOKIE not in right.headers.get("set-cookie", "")
    bearer = await client.get("/api/overview", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 429 and "retry-after" in bearer.headers
    lines = [r.getMessage() for r in caplog.records if r.name == "weclaw_mq.console.audit"]
    assert any('outcome="throttled"' in line for line in lines), lines


@pytest.mark.parametrize("console_access", [Access(read_only=True)])
async def test_read_only_shows_no_action_and_refuses_every_change(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    client = live_console.client
    task_id = await live_console.publish({"mode": "ok"})
    page = await client.get(f"/tasks/{task_id}?queue={live_console.queue}")
    assert page.status_code == 200
    assert 'id="cancel"' not in page.text and "read-only" in page.text
    headers = {"X-CSRF-Token": csrf_of(page.text), "Origin": live_console.base_url}
    refused = await client.post(f"/api/tasks/{task_id}/cancel", json={}, headers=headers)
    assert refused.status_code == 403 and "read-only" in refused.json()["error"]
    state = await live_console.console_app.status(task_id)
    assert state is not None and state.status is TaskStatus.QUEUED


async def test_without_a_token_only_a_loopback_host_is_served(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    # A page of another site whose name was rebound to 127.0.0.1 names its own host.
    rebound = await live_console.client.get("/api/overview", headers={"Host": "evil.example"})
    assert rebound.status_code == 403
    assert (await live_console.client.get("/api/overview")).status_code == 200


async def test_a_payload_holding_markup_is_shown_as_text(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    evil = "<script>window.pwned = 1</script><img src=x onerror=alert(1)>"
    task_id = await live_console.publish(
        {"mode": "fail", "error": "UpstreamBroke", "message": evil}
    )
    await live_console.start()
    final = await live_console.console_app.result(task_id, timeout_s=20)
    assert final.status is TaskStatus.DEAD_LETTERED
    page = await live_console.client.get(f"/tasks/{task_id}?queue={live_console.queue}")
    assert page.status_code == 200
    assert "<script>window.pwned" not in page.text and "<img src=x" not in page.text
    assert "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]


@pytest.mark.parametrize(
    "console_trace_url", ["https://traces.example/trace/{trace_id}?from=console"]
)
async def test_a_dead_letters_trace_id_links_to_the_trace_url(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    task_id = await live_console.publish({"mode": "fail", "error": "UpstreamBroke"})
    await live_console.start()
    await live_console.console_app.result(task_id, timeout_s=20)
    page = await live_console.client.get(f"/tasks/{task_id}?queue={live_console.queue}")
    found = re.search(r'<code id="trace-id">([0-9a-f]+)</code>', page.text)
    assert found, page.text
    link = f'href="https://traces.example/trace/{found.group(1)}?from=console"'
    assert link in page.text


async def test_a_cancel_without_a_json_object_is_a_clear_400_and_cancels_nothing(
    live_console: LiveConsole,  # noqa: F811
) -> None:
    client = live_console.client
    task_id = await live_console.publish({"mode": "ok"})
    headers = {
        "X-CSRF-Token": csrf_of((await client.get("/")).text),
        "Origin": live_console.base_url,
    }
    for body, why in [(b"", "not JSON"), (b"{oops", "not JSON"), (b"[1]", "not a JSON object")]:
        answer = await client.post(f"/api/tasks/{task_id}/cancel", content=body, headers=headers)
        assert answer.status_code == 400, answer.text
        assert why in answer.json()["error"]
    state = await live_console.console_app.status(task_id)
    assert state is not None and state.status is TaskStatus.QUEUED

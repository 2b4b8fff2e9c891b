"""``weclaw-mq console MODULE:APP`` as the installed script: it refuses, in one line and with
exit 2, to serve beyond this machine without a token or over plain HTTP (unless told a TLS
proxy stands in front); served with a token, it answers a request carrying the token and
refuses one without it; nowhere does it print the token."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx

from tests.conftest import settings_for, wait_until
from tests.integration.processes import (
    FIXTURE_APP,
    finish_cli,
    one_error_line,
    run_cli,
    settings_env,
    start_cli,
)

TOKEN = "cli-console-token-0123456789"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_serving_beyond_this_machine_without_a_token_is_refused_in_one_line() -> None:
    result = await run_cli("console", FIXTURE_APP, "--host", "0.0.0.0")
    assert result.code == 2
    assert "give an access token (--token or WECLAW_MQ_CONSOLE_TOKEN)" in one_error_line(result)


async def test_a_short_token_is_refused_in_one_line() -> None:
    result = await run_cli("console", FIXTURE_APP, "--host", "0.0.0.0", "--token", "abc")
    assert result.code == 2
    assert "at least 16 characters" in one_error_line(result)
    assert "abc" not in result.stdout


async def test_serving_beyond_this_machine_over_plain_http_is_refused_in_one_line() -> None:
    result = await run_cli("console", FIXTURE_APP, "--host", "0.0.0.0", "--token", TOKEN)
    assert result.code == 2
    line = one_error_line(result)
    assert "plain HTTP" in line and "--behind-tls-proxy" in line, line
    assert TOKEN not in result.stdout + result.stderr


async def test_behind_a_tls_proxy_a_bad_session_length_is_the_only_complaint() -> None:
    result = await run_cli(
        "console",
        FIXTURE_APP,
        *("--host", "0.0.0.0", "--token", TOKEN, "--behind-tls-proxy"),
        *("--session-hours", "0"),
    )
    assert result.code == 2
    line = one_error_line(result)
    assert "--session-hours" in line and "plain HTTP" not in line, line


async def test_the_served_console_answers_its_token_only(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **settings_env(settings_for(broker_url, redis_url)),
        "TEST_QUEUE": qname,
        "TEST_RECORD_DIR": str(tmp_path),
        "WECLAW_MQ_CONSOLE_TOKEN": TOKEN,
    }
    args = ("console", FIXTURE_APP, "--port", str(port), "--read-only")
    proc = await start_cli(*args, env=env)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            async def serving() -> bool:
                if proc.returncode is not None:
                    raise AssertionError((await finish_cli(proc, args)).stderr)
                try:
                    await client.get("/login")
                except httpx.TransportError:
                    return False
                return True

            await wait_until(serving, 20, "the console to serve")
            refused = await client.get("/api/overview")
            assert refused.status_code == 401
            answered = await client.get(
                "/api/overview", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert answered.status_code == 200, answered.text
            document = answered.json()
            assert [q["queue"] for q in document["queues"]] == [qname]
            assert "guest:guest" not in answered.text  # the broker URL is shown redacted
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        result = await finish_cli(proc, args, timeout_s=20)
    assert TOKEN not in result.stdout + result.stderr
    assert "read-only" in result.stderr  # its start line says how it serves

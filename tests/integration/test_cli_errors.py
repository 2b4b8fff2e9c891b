"""Every CLI failure ends as one line on stderr and a documented exit code, never a traceback.

Each mistake runs the installed ``weclaw-mq`` script as a real process. "Down" services are
URLs to a port nothing listens on: the shared broker and Redis are never touched.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel

from tests.conftest import settings_for
from tests.integration.processes import FIXTURE_APP, one_error_line, run_cli, settings_env
from weclaw_mq import App
from weclaw_mq.cli.failures import ExitCode, one_line

SECRET = "s3cret-pass"


def closed_port() -> int:
    """A local port nothing listens on (bound, then released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class Job(BaseModel):
    text: str


def assert_one_line(result_stderr: str) -> None:
    assert SECRET not in result_stderr
    assert result_stderr.startswith("weclaw-mq: error: "), result_stderr


@pytest.mark.parametrize(
    ("args", "env", "code", "complaint"),
    [
        (
            ["status", "some-task"],
            {
                "WECLAW_MQ_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{closed_port()}/0",
                "WECLAW_MQ_REDIS_TIMEOUT_S": "2",
            },
            ExitCode.STATE_UNAVAILABLE,
            "Redis",
        ),
        (
            ["status", "some-task", "--wait", "1"],
            {
                "WECLAW_MQ_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{closed_port()}/0",
                "WECLAW_MQ_REDIS_TIMEOUT_S": "2",
            },
            ExitCode.STATE_UNAVAILABLE,
            "Redis",
        ),
        (
            ["dlq", "list", "some-queue"],
            {"WECLAW_MQ_AMQP_URL": f"amqp://guest:{SECRET}@127.0.0.1:{closed_port()}/"},
            ExitCode.BROKER_UNAVAILABLE,
            "cannot connect to RabbitMQ",
        ),
        (
            ["dlq", "list", "some-queue"],
            {"WECLAW_MQ_AMQP_URL": f"amqp://guest:{SECRET}@[::1"},
            ExitCode.CONFIG,
            "WECLAW_MQ_AMQP_URL",
        ),
        (
            ["publish", "some-queue", "--data", "{}"],
            {"WECLAW_MQ_AMQP_URL": "not-a-url"},
            ExitCode.CONFIG,
            "WECLAW_MQ_AMQP_URL",
        ),
        (
            ["status", "some-task"],
            {"WECLAW_MQ_REDIS_URL": f"http://user:{SECRET}@example.invalid/"},
            ExitCode.CONFIG,
            "WECLAW_MQ_REDIS_URL",
        ),
        (
            ["health"],
            {"WECLAW_MQ_AMQP_URL": f"amqp://guest:{SECRET}@127.0.0.1:99999/"},
            ExitCode.CONFIG,
            "WECLAW_MQ_AMQP_URL",
        ),
        (
            ["status", "some-task"],
            {"WECLAW_MQ_CONCURRENCY": "many"},
            ExitCode.CONFIG,
            "WECLAW_MQ_CONCURRENCY",
        ),
        (
            ["declare", FIXTURE_APP],
            {"WECLAW_MQ_GUARD_ON_REDIS_DOWN": "panic", "TEST_QUEUE": "q", "TEST_RECORD_DIR": "."},
            ExitCode.CONFIG,
            "WECLAW_MQ_GUARD_ON_REDIS_DOWN",
        ),
        (
            ["declare", FIXTURE_APP, "--log-level", "LOUD"],
            {},
            ExitCode.USAGE,
            "--log-level",
        ),
        (
            ["worker", FIXTURE_APP],
            {"WECLAW_MQ_LOG_LEVEL": "chatty"},
            ExitCode.USAGE,
            "--log-level",
        ),
    ],
    ids=[
        "status-redis-down",
        "status-wait-redis-down",
        "dlq-broker-down",
        "amqp-url-unparseable",
        "amqp-url-no-scheme",
        "redis-url-wrong-scheme",
        "amqp-port-out-of-range",
        "setting-not-an-int",
        "setting-not-a-choice",
        "log-level-option",
        "log-level-env",
    ],
)
async def test_each_mistake_ends_as_one_error_line_and_its_exit_code(
    args: list[str], env: dict[str, str], code: ExitCode, complaint: str
) -> None:
    result = await run_cli(*args, env=env)

    line = one_error_line(result)
    assert result.code == code, (result.code, line)
    assert complaint in line, line
    assert_one_line(result.stderr)


async def test_export_to_an_unwritable_path_fails_in_one_line_and_leaves_the_dlq_alone(
    make_app: Callable[..., App], qname: str, tmp_path: Path
) -> None:
    app = make_app()

    @app.handler(qname)
    async def work(task: Job) -> None:
        return None

    await app.declare()
    env = settings_env(settings_for(app.settings.amqp_url_plain(), app.settings.redis_url_plain()))
    missing_dir = tmp_path / "no-such-dir" / "dead.jsonl"

    result = await run_cli("dlq", "export", qname, str(missing_dir), env=env)

    line = one_error_line(result)
    assert result.code == ExitCode.FAILED, (result.code, line)
    assert str(missing_dir) in line, line
    assert_one_line(result.stderr)


def test_one_line_joins_lines_and_redacts_every_url_password() -> None:
    text = f"first\n  amqp://guest:{SECRET}@h:5672/ and redis://:{SECRET}@r:6379/0\nlast"

    assert one_line(text) == "first amqp://guest:***@h:5672/ and redis://:***@r:6379/0 last"

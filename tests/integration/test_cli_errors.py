"""Every CLI failure ends as one line on stderr and a documented exit code, never a traceback.

Each mistake runs the installed ``weclaw-mq`` script as a real process. "Down" services are
URLs to a port nothing listens on (or a private server that never answers): the shared broker
and Redis are never touched. The exit-code table of docs/operations/workers-and-cli.md lists
these mistakes.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
import yarl
from pydantic import BaseModel

from tests.conftest import settings_for
from tests.integration.dead_endpoints import closed_port, silent_server
from tests.integration.processes import (
    FIXTURE_APP,
    REPO_ROOT,
    CliResult,
    cli_executable,
    finish_cli,
    one_error_line,
    run_cli,
    settings_env,
    start_cli,
)
from weclaw_mq import App
from weclaw_mq.cli import cli
from weclaw_mq.cli.exit_codes import ExitCode, one_line

SECRET = "s3cret-pass"
# An app whose module builds its App (and so reads the settings) when imported.
DEMO_APP = "consumers.demo:app"
BROKER_DOWN = {"WECLAW_MQ_AMQP_URL": f"amqp://guest:{SECRET}@127.0.0.1:{closed_port()}/"}
NOT_SQLITE = str(Path(__file__))  # a file that exists and is no SQLite database
REDIS_DOWN = {
    "WECLAW_MQ_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{closed_port()}/0",
    "WECLAW_MQ_REDIS_TIMEOUT_S": "2",
}


class Job(BaseModel):
    text: str


@dataclass(frozen=True)
class Mistake:
    args: list[str]
    env: dict[str, str]
    code: ExitCode
    complaint: str  # said in the error line
    id: str
    # A bug in the user's module: the error line is followed by its frames (file, line, code).
    user_frames: bool = False


def assert_one_line(result_stderr: str) -> None:
    assert SECRET not in result_stderr
    assert result_stderr.startswith("weclaw-mq: error: "), result_stderr


MISTAKES: list[Mistake] = [
    # 1: the command ran and the answer is no
    Mistake(
        ["outbox", "status", "--path", "/nonexistent-dir/outbox.db"],
        {},
        ExitCode.FAILED,
        "/nonexistent-dir",
        id="outbox-path-in-missing-dir",
    ),
    Mistake(
        ["outbox", "status", "--path", NOT_SQLITE],
        {},
        ExitCode.FAILED,
        "not a readable SQLite database",
        id="outbox-path-not-sqlite",
    ),
    Mistake(["dlq", "purge", "some-queue"], {}, ExitCode.FAILED, "--yes", id="purge-without-yes"),
    # 2: usage
    Mistake(["no-such-command"], {}, ExitCode.USAGE, "no-such-command", id="unknown-command"),
    Mistake(["status", "--colour"], {}, ExitCode.USAGE, "--colour", id="unknown-option"),
    Mistake(
        ["declare", FIXTURE_APP, "--log-level", "LOUD"],
        {},
        ExitCode.USAGE,
        "--log-level",
        id="log-level-option",
    ),
    Mistake(
        ["worker", FIXTURE_APP],
        {"WECLAW_MQ_LOG_LEVEL": "chatty"},
        ExitCode.USAGE,
        "--log-level",
        id="log-level-env",
    ),
    Mistake(
        ["outbox", "relay", "--once", "--log-level", "LOUD"],
        {},
        ExitCode.USAGE,
        "--log-level",
        id="outbox-relay-log-level",
    ),
    Mistake(
        ["worker", FIXTURE_APP, "--concurrency", "0"],
        {},
        ExitCode.USAGE,
        "--concurrency",
        id="concurrency-zero",
    ),
    Mistake(
        ["permissions", DEMO_APP, "--role", "boss"], {}, ExitCode.USAGE, "--role", id="bad-role"
    ),
    # --reload is for development: one worker process, nothing started.
    Mistake(
        ["worker", FIXTURE_APP, "--reload", "--processes", "2"],
        {},
        ExitCode.USAGE,
        "--reload is for development and runs one worker process: not with --processes 2",
        id="reload-with-processes",
    ),
    Mistake(
        ["worker", FIXTURE_APP, "--reload-dir", "."],
        {},
        ExitCode.USAGE,
        "--reload-dir watches folders for --reload: add --reload",
        id="reload-dir-without-reload",
    ),
    Mistake(
        ["worker", FIXTURE_APP, "--reload", "--reload-dir", "/nonexistent-dir"],
        {},
        ExitCode.USAGE,
        "--reload-dir",
        id="reload-dir-missing",
    ),
    # 3 (set among the usage ones only to keep the workers' runs together): a metrics address
    # this host does not have (TEST-NET-1) cannot be served; the worker says so and stops.
    Mistake(
        ["worker", DEMO_APP, "--metrics-port", "0"],
        {"WECLAW_MQ_METRICS_ADDR": "192.0.2.1"},
        ExitCode.CONFIG,
        "cannot serve metrics on 192.0.2.1:0",
        id="metrics-address-unavailable",
    ),
    Mistake(
        ["publish", "some-queue", "--data", "not json"],
        {},
        ExitCode.USAGE,
        "--data",
        id="data-not-json",
    ),
    Mistake(
        ["publish", "some-queue", "--data", "@/nonexistent-dir/task.json"],
        {},
        ExitCode.USAGE,
        "/nonexistent-dir/task.json",
        id="data-file-missing",
    ),
    Mistake(
        ["publish", "some-queue", "--data", "{}", "--task-id", "has spaces"],
        {},
        ExitCode.USAGE,
        "--task-id",
        id="task-id-invalid",
    ),
    Mistake(
        ["publish", "some-queue", "--data", "1" + "0" * 5000],
        BROKER_DOWN,
        ExitCode.USAGE,
        "a number of 5001 digits",
        id="data-number-past-the-digit-limit",
    ),
    Mistake(
        ["publish", "some-queue", "--data", "NaN"],
        BROKER_DOWN,
        ExitCode.USAGE,
        "NaN is not a JSON value",
        id="data-nan",
    ),
    Mistake(
        ["dlq", "list", "some-queue", "--since", "99999999d"],
        BROKER_DOWN,
        ExitCode.USAGE,
        "--since",
        id="since-before-year-1",
    ),
    Mistake(["cancel", ""], REDIS_DOWN, ExitCode.USAGE, "task id is empty", id="cancel-empty-id"),
    Mistake(
        ["cancel", "a\nb"], REDIS_DOWN, ExitCode.USAGE, "control or line", id="cancel-id-newline"
    ),
    # As cancel: a task id no task can have, not an empty answer from the cost ledger.
    Mistake(
        ["costs", DEMO_APP, "--task", ""],
        REDIS_DOWN,
        ExitCode.USAGE,
        "task id is empty",
        id="costs-empty-task-id",
    ),
    Mistake(
        ["costs", DEMO_APP, "--task", "a\nb"],
        REDIS_DOWN,
        ExitCode.USAGE,
        "control or line",
        id="costs-task-id-newline",
    ),
    Mistake(
        ["cancel", "some-task", "--queue", ""],
        REDIS_DOWN,
        ExitCode.USAGE,
        "queue name '' must be 1 to",
        id="cancel-queue-empty",
    ),
    Mistake(
        ["cancel", "some-task", "--queue", "no such/queue"],
        REDIS_DOWN,
        ExitCode.USAGE,
        "may hold only letters",
        id="cancel-queue-invalid",
    ),
    # 3: configuration
    Mistake(["worker", "nomodule"], {}, ExitCode.CONFIG, "MODULE:APP", id="app-no-colon"),
    Mistake(
        ["worker", "no_such_module_for_weclaw_tests:app"],
        {},
        ExitCode.CONFIG,
        "no_such_module_for_weclaw_tests",
        id="app-module-missing",
    ),
    Mistake(
        ["declare", "os:path"], {}, ExitCode.CONFIG, "not a weclaw_mq.App", id="app-not-an-app"
    ),
    Mistake(
        ["worker", "consumers.demo:no_such_app"],
        {},
        ExitCode.CONFIG,
        "no attribute 'no_such_app'",
        id="app-attribute-missing",
    ),
    Mistake(
        ["worker", FIXTURE_APP],  # its module builds the App on access, and needs TEST_QUEUE
        {},
        ExitCode.CONFIG,
        "TEST_QUEUE",
        id="app-fails-to-build",
        user_frames=True,
    ),
    Mistake(
        ["publish", "some-queue", "--data", "{}", "--app", ""],
        {},
        ExitCode.CONFIG,
        "MODULE:APP",
        id="publish-app-empty",
    ),
    Mistake(
        ["publish", "some-queue", "--data", "{}", "--app", DEMO_APP],
        {},
        ExitCode.CONFIG,
        "no handler for 'some-queue'",
        id="publish-app-without-the-queue",
    ),
    Mistake(
        ["outbox", "status"], {}, ExitCode.CONFIG, "WECLAW_MQ_OUTBOX_PATH", id="outbox-no-path"
    ),
    Mistake(
        ["dlq", "list", "some-queue"],
        {"WECLAW_MQ_AMQP_URL": f"amqp://guest:{SECRET}@[::1"},
        ExitCode.CONFIG,
        "WECLAW_MQ_AMQP_URL",
        id="amqp-url-unparseable",
    ),
    Mistake(
        ["publish", "some-queue", "--data", "{}"],
        {"WECLAW_MQ_AMQP_URL": "not-a-url"},
        ExitCode.CONFIG,
        "WECLAW_MQ_AMQP_URL",
        id="amqp-url-no-scheme",
    ),
    Mistake(
        ["status", "some-task"],
        {"WECLAW_MQ_REDIS_URL": f"http://user:{SECRET}@example.invalid/"},
        ExitCode.CONFIG,
        "WECLAW_MQ_REDIS_URL",
        id="redis-url-wrong-scheme",
    ),
    Mistake(
        ["status", "some-task"],
        {"WECLAW_MQ_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{closed_port()}/abc"},
        ExitCode.CONFIG,
        "has database 'abc', which is not a number",
        id="redis-url-database-not-a-number",
    ),
    Mistake(
        ["health"],
        {"WECLAW_MQ_AMQP_URL": f"amqp://guest:{SECRET}@127.0.0.1:99999/"},
        ExitCode.CONFIG,
        "WECLAW_MQ_AMQP_URL",
        id="amqp-port-out-of-range",
    ),
    Mistake(
        ["declare", FIXTURE_APP],
        {"WECLAW_MQ_GUARD_ON_REDIS_DOWN": "panic", "TEST_QUEUE": "q", "TEST_RECORD_DIR": "."},
        ExitCode.CONFIG,
        "WECLAW_MQ_GUARD_ON_REDIS_DOWN",
        id="setting-not-a-choice",
    ),
    # 4: RabbitMQ unavailable
    Mistake(
        ["publish", "some-queue", "--data", "{}"],
        BROKER_DOWN,
        ExitCode.BROKER_UNAVAILABLE,
        "cannot connect to RabbitMQ",
        id="publish-broker-down",
    ),
    Mistake(
        ["dlq", "list", "some-queue"],
        BROKER_DOWN,
        ExitCode.BROKER_UNAVAILABLE,
        "cannot connect to RabbitMQ",
        id="dlq-broker-down",
    ),
    # 5: Redis unavailable
    Mistake(
        ["status", "some-task"],
        REDIS_DOWN,
        ExitCode.STATE_UNAVAILABLE,
        "Redis",
        id="status-redis-down",
    ),
    Mistake(
        ["status", "some-task", "--wait", "1"],
        REDIS_DOWN,
        ExitCode.STATE_UNAVAILABLE,
        "Redis",
        id="status-wait-redis-down",
    ),
    Mistake(
        ["cancel", "some-task"],
        REDIS_DOWN,
        ExitCode.STATE_UNAVAILABLE,
        "Redis",
        id="cancel-redis-down",
    ),
    Mistake(
        ["inspect", DEMO_APP],
        REDIS_DOWN,
        ExitCode.STATE_UNAVAILABLE,
        "Redis",
        id="inspect-redis-down",
    ),
]


# The first test to need ``ran`` runs all its ~70 CLI processes in its setup (about 1 s of CPU
# each): 50-60 s on an idle 2-core machine, and near or past the suite's 120 s timeout when
# other tests load it (two loaded full runs ended with this setup's errors and an INTERNALERROR).
RAN_TIMEOUT_S = 360


@pytest.mark.timeout(RAN_TIMEOUT_S)
@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.id for m in MISTAKES])
def test_each_mistake_ends_as_one_error_line_and_its_exit_code(
    mistake: Mistake, ran: dict[str, CliResult]
) -> None:
    result = ran[mistake.id]

    if mistake.user_frames:
        # docs/operations/workers-and-cli.md: the user's frames follow, each "File ..." line
        # with its code indented below it; none of the library's own.
        line, *frames = result.stderr.strip().splitlines()
        assert frames and frames[0].startswith('  File "'), result.stderr
        assert all(f.startswith(('  File "', "    ")) for f in frames), result.stderr
        assert not any("/weclaw_mq/" in f for f in frames), result.stderr
    else:
        line = one_error_line(result)
    assert result.code == mistake.code, (result.code, line)
    assert mistake.complaint in line, line
    assert_one_line(result.stderr)


# One run of every command, valid but for the settings it reads. A new command needs a line
# here (test_every_command_has_a_run_with_a_bad_setting says so).
EVERY_COMMAND = {
    "worker": ["worker", DEMO_APP],
    "declare": ["declare", DEMO_APP],
    "migrate": ["migrate", DEMO_APP],
    "permissions": ["permissions", DEMO_APP],
    "asyncapi": ["asyncapi", DEMO_APP],
    "inspect": ["inspect", DEMO_APP],
    "console": ["console", DEMO_APP],
    "costs": ["costs", DEMO_APP],
    "scheduler": ["scheduler", DEMO_APP],
    "schedules list": ["schedules", "list", DEMO_APP],
    "schedules pause": ["schedules", "pause", DEMO_APP, "nightly"],
    "schedules resume": ["schedules", "resume", DEMO_APP, "nightly"],
    "publish": ["publish", "some-queue", "--data", "{}"],
    "status": ["status", "some-task"],
    "cancel": ["cancel", "some-task"],
    "health": ["health"],
    "stats": ["stats", "some-queue"],
    "dlq list": ["dlq", "list", "some-queue"],
    "dlq show": ["dlq", "show", "some-queue", "some-task"],
    "dlq requeue": ["dlq", "requeue", "some-queue"],
    "dlq export": ["dlq", "export", "some-queue", "/nonexistent-dir/dead.jsonl"],
    "dlq purge": ["dlq", "purge", "some-queue", "--yes"],
    "dlq import": ["dlq", "import", "some-queue", "/dev/null"],
    "outbox status": ["outbox", "status", "--path", "/nonexistent-dir/outbox.db"],
    "outbox relay": ["outbox", "relay", "--path", "/nonexistent-dir/outbox.db", "--once"],
    "outbox migrate": ["outbox", "migrate", "--postgres", "postgresql://nobody@127.0.0.1:1/x"],
}


BAD_SETTING = "bad-setting: "
# At most this many CLI processes at once: each spends ~0.4 s of CPU importing, on 2 cores.
PARALLEL = 4


@pytest.fixture(scope="module")
def ran() -> dict[str, CliResult]:
    """Every run of this module's tables, as real processes, a few at a time (one by one
    they would take a minute); each test then reads its own result."""
    runs = {m.id: (m.args, m.env) for m in MISTAKES}
    bad = {"WECLAW_MQ_CONCURRENCY": "many"}
    runs |= {BAD_SETTING + name: (args, bad) for name, args in EVERY_COMMAND.items()}

    async def run_all() -> dict[str, CliResult]:
        slots = asyncio.Semaphore(PARALLEL)

        async def one(args: list[str], env: dict[str, str]) -> CliResult:
            async with slots:
                return await run_cli(*args, env=env, timeout_s=60)

        results = await asyncio.gather(*(one(args, env) for args, env in runs.values()))
        return dict(zip(runs, results, strict=True))

    return asyncio.run(run_all())


def leaf_commands(command: object, prefix: str = "") -> list[str]:
    subcommands = getattr(command, "commands", None)
    if not subcommands:
        return [prefix.strip()]
    return [
        name
        for key, sub in sorted(subcommands.items())
        for name in leaf_commands(sub, f"{prefix} {key}")
    ]


def test_every_command_has_a_run_with_a_bad_setting() -> None:
    commands = leaf_commands(typer.main.get_command(cli))

    missing = sorted(set(commands) - set(EVERY_COMMAND))
    assert not missing, f"add a run of {missing} to EVERY_COMMAND"


@pytest.mark.timeout(RAN_TIMEOUT_S)
@pytest.mark.parametrize("command", sorted(EVERY_COMMAND))
def test_a_bad_setting_ends_every_command_with_exit_3_naming_the_variable(
    command: str, ran: dict[str, CliResult]
) -> None:
    result = ran[BAD_SETTING + command]

    line = one_error_line(result)
    assert result.code == ExitCode.CONFIG, (result.code, line)
    assert "WECLAW_MQ_CONCURRENCY" in line, line


async def test_ctrl_c_ends_a_waiting_command_with_one_line_and_exit_130() -> None:
    accepted = asyncio.Event()
    async with silent_server(accepted) as port:
        env = {
            "WECLAW_MQ_REDIS_URL": f"redis://127.0.0.1:{port}/0",
            "WECLAW_MQ_REDIS_TIMEOUT_S": "60",
        }
        args = ["status", "some-task", "--wait", "60"]
        proc = await start_cli(*args, env=env)
        # Connected to our server: the command is past its imports, waiting on "Redis".
        await asyncio.wait_for(accepted.wait(), 20)
        proc.send_signal(signal.SIGINT)
        result = await finish_cli(proc, args)

    line = one_error_line(result)
    assert result.code == ExitCode.INTERRUPTED, (result.code, line)
    assert line == "weclaw-mq: error: interrupted"


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


# Room for the interpreter and its imports, far below what reading without a bound takes.
MEMORY_BOUND_BYTES = 1024**3


def _memory_bound() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BOUND_BYTES, MEMORY_BOUND_BYTES))


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_publish_reads_an_endless_data_source_up_to_the_size_limit_only(source: str) -> None:
    args = ["publish", "some-queue", "--data", "@/dev/urandom" if source == "file" else "-"]
    with open("/dev/urandom", "rb") as endless:
        done = subprocess.run(
            [cli_executable(), *args],
            cwd=REPO_ROOT,
            env={**os.environ, **BROKER_DOWN, "WECLAW_MQ_MAX_MESSAGE_BYTES": "4096"},
            stdin=endless if source == "stdin" else subprocess.DEVNULL,
            capture_output=True,
            preexec_fn=_memory_bound,
            timeout=60,
        )
    result = CliResult(done.returncode, done.stdout.decode(), done.stderr.decode())

    line = one_error_line(result)
    assert result.code == ExitCode.USAGE, (result.code, line)
    assert "holds more than 4096 bytes, the message size limit" in line, line


async def test_a_handshake_that_never_finishes_says_what_to_check() -> None:
    async with silent_server() as port:
        url = f"amqp://guest:{SECRET}@127.0.0.1:{port}/"
        result = await run_cli(
            "dlq",
            "list",
            "some-queue",
            env={"WECLAW_MQ_AMQP_URL": url, "WECLAW_MQ_HEARTBEAT_S": "2"},
        )

    line = one_error_line(result)
    assert result.code == ExitCode.BROKER_UNAVAILABLE, (result.code, line)
    assert "the AMQP handshake did not finish within 8 s" in line, line
    assert "rabbitmqctl status" in line and not line.endswith("TimeoutError:"), line
    assert_one_line(result.stderr)


async def test_an_unknown_vhost_is_named_with_what_to_check(broker_url: str) -> None:
    vhost = f"nope-{uuid.uuid4().hex[:8]}"
    url = str(yarl.URL(broker_url).with_path(f"/{vhost}"))

    result = await run_cli("dlq", "list", "some-queue", env={"WECLAW_MQ_AMQP_URL": url})

    line = one_error_line(result)
    assert result.code == ExitCode.BROKER_UNAVAILABLE, (result.code, line)
    assert f"the broker refused vhost '{vhost}'" in line, line
    assert "rabbitmqctl list_vhosts" in line and "object at 0x" not in line, line


async def test_a_cluster_url_on_a_plain_redis_is_a_configuration_error(redis_url: str) -> None:
    # CLUSTER SLOTS, refused by a Redis without cluster mode, is all the shared Redis is asked.
    where = yarl.URL(redis_url)
    url = f"redis+cluster://{where.host}:{where.port or 6379}"

    result = await run_cli("status", "some-task", env={"WECLAW_MQ_REDIS_URL": url})

    line = one_error_line(result)
    assert result.code == ExitCode.CONFIG, (result.code, line)
    assert "is a Redis without cluster mode: use a redis:// URL" in line, line

"""The ``weclaw-mq`` command, run as the installed script against the real broker and Redis."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import typer
from aio_pika.abc import AbstractChannel

from tests.conftest import delete_queues, forget_task_keys, get_message, queue_depth, settings_for
from tests.integration.dead_endpoints import closed_port
from tests.integration.fixture_apps.worker_app import build_app
from tests.integration.processes import (
    FIXTURE_APP,
    one_error_line,
    queue_names,
    run_cli,
    settings_env,
    take_one,
)
from weclaw_mq import App, TaskState, TaskStatus
from weclaw_mq.cli import cli, main
from weclaw_mq.cli.exit_codes import ExitCode
from weclaw_mq.contract.naming import latest_key, state_key

SECRET = "s3cret-pass"


@dataclass
class FixtureQueue:
    """The fixture app's handler queue, as the CLI sees it through environment variables."""

    name: str
    env: dict[str, str]

    def with_settings(self, **overrides: str) -> dict[str, str]:
        return {**self.env, **{f"WECLAW_MQ_{k.upper()}": v for k, v in overrides.items()}}


@pytest.fixture
async def fixture_queue(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> AsyncIterator[FixtureQueue]:
    settings = settings_for(broker_url, redis_url)
    env = {
        **settings_env(settings),
        "TEST_QUEUE": qname,
        "TEST_RECORD_DIR": str(tmp_path),
    }
    yield FixtureQueue(qname, env)
    app = build_app(qname, settings=settings, record_dir=tmp_path)
    await delete_queues(broker_url, queue_names(app))
    await forget_task_keys(redis_url, [qname])


async def test_publish_prints_the_task_id_of_a_message_now_in_the_queue(
    fixture_queue: FixtureQueue, broker_url: str
) -> None:
    declared = await run_cli("declare", FIXTURE_APP, env=fixture_queue.env)
    assert declared.code == 0, declared.stderr
    assert fixture_queue.name in declared.stdout.split()

    result = await run_cli(
        "publish", fixture_queue.name, "--data", '{"text":"hi"}', env=fixture_queue.env
    )

    assert result.code == 0, result.stderr
    task_id = result.stdout.strip()
    assert str(uuid.UUID(task_id)) == task_id
    message = await take_one(broker_url, fixture_queue.name)
    assert message is not None, "the published task is not in the queue"
    assert message.message_id == task_id
    assert json.loads(message.body) == {"text": "hi"}


async def test_declare_says_how_many_queues_and_what_the_broker_carries(
    fixture_queue: FixtureQueue,
) -> None:
    """Issue 25, item 4: after the names, on stderr, how many queues (the handler's own and
    the vhost's shared ones) and, the broker being on this machine, its file-handle and memory
    use against their limits; then migrate finds nothing of an older version to delete."""
    declared = await run_cli("declare", FIXTURE_APP, env=fixture_queue.env)

    assert declared.code == 0, declared.stderr
    names = declared.stdout.split()
    shared = [n for n in names if n.startswith("weclaw_mq.")]
    # The fixture's handler takes priorities: Q, its two lanes and its DLQ on 3.x.
    assert len(names) - len(shared) == 4 and "weclaw_mq.unroutable.dlq" in shared
    lines = [line for line in declared.stderr.splitlines() if line.strip()]
    assert (
        f"declared {len(names)} queues: 4 for 1 handler(s), {len(shared)} shared by the vhost "
        "(the delay ladder, the parking queue)"
    ) in lines
    load = next(line for line in lines if line.startswith("broker file handles:"))
    used, limit = (int(n) for n in re.findall(r"(\d+) of (\d+) in use", load)[0])
    assert 0 < used < limit

    migrated = await run_cli("migrate", FIXTURE_APP, env=fixture_queue.env)
    assert migrated.code == 0, migrated.stderr
    assert migrated.stdout.strip() == "nothing to migrate: no queue of an older version found"


async def test_health_prints_ok_lines_when_broker_and_redis_answer(
    broker_url: str, redis_url: str
) -> None:
    result = await run_cli("health", env=settings_env(settings_for(broker_url, redis_url)))

    assert result.code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["broker", "redis"]
    assert all(": ok" in line for line in lines), lines
    assert result.stderr == ""


async def test_health_names_the_failing_broker_without_showing_its_password(
    redis_url: str,
) -> None:
    env = {
        "WECLAW_MQ_AMQP_URL": f"amqp://guest:{SECRET}@127.0.0.1:1/",
        "WECLAW_MQ_REDIS_URL": redis_url,
    }

    result = await run_cli("health", env=env)

    line = one_error_line(result)
    assert line.startswith("broker:"), line
    assert "redis: ok" in result.stdout
    assert SECRET not in result.stdout + result.stderr


async def test_declare_against_a_queue_with_other_arguments_names_queue_and_argument(
    fixture_queue: FixtureQueue,
) -> None:
    first = await run_cli(
        "declare", FIXTURE_APP, env=fixture_queue.with_settings(delivery_limit="2")
    )
    assert first.code == 0, first.stderr

    result = await run_cli(
        "declare", FIXTURE_APP, env=fixture_queue.with_settings(delivery_limit="3")
    )

    line = one_error_line(result)
    assert repr(fixture_queue.name) in line, line
    assert "x-delivery-limit" in line, line


def every_command(command: object, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of ``command`` and of each command and group under it."""
    subcommands = getattr(command, "commands", {})
    return [path] + [
        found
        for name, sub in sorted(subcommands.items())
        for found in every_command(sub, (*path, name))
    ]


# Every command the CLI has, so a new command gets its --help checked too.
COMMANDS = every_command(typer.main.get_command(cli))
# What typer shows when a parameter has no placeholder of its own: TEXT, INTEGER ... in older
# typer; the Python type in recent typer (``{app_path}``, and ``<str>``, ``<int range>``...
# beside an option; beside an argument's name it shows its type, which reads well enough).
ODD_PLACEHOLDERS = re.compile(
    r"\[default: None\]|\b(TEXT|INTEGER|FLOAT|BOOLEAN|PATH)\b|\{[a-z_]+\}"
)
TYPE_PLACEHOLDER = re.compile(r"<(str|bool|int|float|list|path)\b")


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "root" for c in COMMANDS])
def test_help_of_every_command_reads_well(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process through main(), the installed script's entry point: 18 processes would
    # cost ~10 s for nothing the process adds.
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])

    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    assert "Usage:" in out
    assert err == ""
    odd = ODD_PLACEHOLDERS.search(out)
    assert odd is None, f"{odd.group(0)!r} in:\n{out}"
    odd = TYPE_PLACEHOLDER.search(out)
    assert odd is None, f"{odd.group(0)!r} in:\n{out}"


def test_version_prints_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])

    assert exited.value.code == 0
    assert capsys.readouterr().out == f"weclaw-mq {version('weclaw_mq')}\n"


async def test_show_completion_prints_a_bash_script_and_writes_no_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # typer's documented switch for tests: take the shell from the argument, not the parent.
    env = {"HOME": str(home), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}

    result = await run_cli("--show-completion", "bash", env=env)

    assert result.code == 0, result.stderr
    assert "complete " in result.stdout and "_WECLAW_MQ_COMPLETE=complete_bash" in result.stdout
    assert list(home.iterdir()) == []  # no ~/.bashrc, no completion file


async def test_completion_of_a_partial_command_offers_the_command() -> None:
    env = {"_WECLAW_MQ_COMPLETE": "complete_bash", "COMP_WORDS": "weclaw-mq dl", "COMP_CWORD": "1"}

    result = await run_cli(env=env)

    assert result.code == 0, result.stderr
    assert result.stdout.split() == ["dlq"]


@pytest.fixture
async def declared_queue(fixture_queue: FixtureQueue, tmp_path: Path) -> FixtureQueue:
    """``fixture_queue``, declared (in-process: the same topology ``weclaw-mq declare`` makes)."""
    settings = settings_for(
        fixture_queue.env["WECLAW_MQ_AMQP_URL"], fixture_queue.env["WECLAW_MQ_REDIS_URL"]
    )
    async with build_app(fixture_queue.name, settings=settings, record_dir=tmp_path) as app:
        await app.declare()
    return fixture_queue


async def test_publish_reads_the_task_from_a_file_or_from_stdin(
    declared_queue: FixtureQueue, amqp: AbstractChannel, tmp_path: Path
) -> None:
    task_file = tmp_path / "task.json"
    task_file.write_text('{"text": "from a file"}')
    q = declared_queue.name

    from_file = await run_cli(
        "publish", q, "--data", f"@{task_file}", "--task-id", "file-1", env=declared_queue.env
    )
    from_stdin = await run_cli(
        "publish", q, "--data", "-", env=declared_queue.env, stdin=b'{"text": "from stdin"}'
    )

    assert from_file.code == 0, from_file.stderr
    assert from_file.stdout.strip() == "file-1"
    assert from_stdin.code == 0, from_stdin.stderr
    first, second = await get_message(amqp, q), await get_message(amqp, q)
    assert first is not None and second is not None
    assert (first.message_id, json.loads(first.body)) == ("file-1", {"text": "from a file"})
    assert second.message_id == from_stdin.stdout.strip()
    assert json.loads(second.body) == {"text": "from stdin"}


async def test_publish_with_app_refuses_a_task_the_handler_model_rejects_and_sends_nothing(
    declared_queue: FixtureQueue, amqp: AbstractChannel
) -> None:
    q = declared_queue.name

    result = await run_cli(
        "publish", q, "--data", '{"txet": "typo"}', "--app", FIXTURE_APP, env=declared_queue.env
    )

    line = one_error_line(result)
    assert result.code == ExitCode.USAGE, (result.code, line)
    assert "--data" in line and "text" in line, line
    assert await queue_depth(amqp, q) == 0


async def test_health_json_is_one_document_with_each_part(broker_url: str, redis_url: str) -> None:
    result = await run_cli(
        "health", "--json", env=settings_env(settings_for(broker_url, redis_url))
    )

    assert result.code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] is True
    assert [(p["part"], p["ok"]) for p in document["parts"]] == [("broker", True), ("redis", True)]
    assert result.stderr == ""


async def test_health_json_says_which_part_failed_and_exits_1(broker_url: str) -> None:
    env = {
        "WECLAW_MQ_AMQP_URL": broker_url,
        "WECLAW_MQ_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{closed_port()}/0",
    }

    result = await run_cli("health", "--json", env=env)

    assert result.code == 1, result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] is False
    parts = {p["part"]: p for p in document["parts"]}
    assert parts["broker"]["ok"] is True
    assert parts["redis"]["ok"] is False and "cannot reach Redis" in parts["redis"]["detail"]
    assert SECRET not in result.stdout


async def test_status_reads_the_record_of_the_queue_asked_for_or_the_latest(
    broker_url: str, redis_url: str, qname: str
) -> None:
    settings = settings_for(broker_url, redis_url)
    task_id = f"{qname}-shared-id"
    async with App("test-cli-status", settings=settings) as app:
        store = app.results
        assert store is not None
        await store.record(
            TaskState(task_id=task_id, queue=f"{qname}-a", status=TaskStatus.SUCCEEDED)
        )
        await store.record(
            TaskState(task_id=task_id, queue=f"{qname}-b", status=TaskStatus.RUNNING)
        )
    env = settings_env(settings)

    latest = await run_cli("status", task_id, env=env)
    first = await run_cli("status", task_id, "--queue", f"{qname}-a", env=env)
    unknown = await run_cli("status", task_id, "--queue", f"{qname}-c", env=env)

    assert latest.code == 0, latest.stderr
    assert json.loads(latest.stdout)["queue"] == f"{qname}-b"
    assert first.code == 0, first.stderr
    assert json.loads(first.stdout)["status"] == "succeeded"
    assert unknown.code == 1
    assert "no status recorded" in one_error_line(unknown)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.delete(
            state_key(f"{qname}-a", task_id), state_key(f"{qname}-b", task_id), latest_key(task_id)
        )
    finally:
        await client.aclose()

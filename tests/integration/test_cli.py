"""The ``weclaw-mq`` command, run as the installed script against the real broker and Redis."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import typer

from tests.conftest import delete_queues, forget_task_keys, settings_for
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
from weclaw_mq.cli import cli
from weclaw_mq.naming import latest_key, state_key

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


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["publish", "some-queue", "--data", "not json"], "--data"),
        (["worker", "nomodule"], "MODULE:APP"),
        (["worker", "no_such_module_for_weclaw_tests:app"], "no_such_module_for_weclaw_tests"),
        (["worker", FIXTURE_APP, "--concurrency", "0"], "--concurrency"),
    ],
    ids=["data-not-json", "app-without-colon", "app-module-missing", "concurrency-zero"],
)
async def test_bad_argument_exits_nonzero_with_one_line_saying_what_is_wrong(
    args: list[str], complaint: str
) -> None:
    result = await run_cli(*args)

    line = one_error_line(result)
    assert complaint in line, line


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


# Every command the CLI has, so a new command gets its --help checked too.
COMMANDS = sorted(typer.main.get_command(cli).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)], ids=["root", *COMMANDS])
async def test_help_of_every_command_exits_zero(command: list[str]) -> None:
    result = await run_cli(*command, "--help")

    assert result.code == 0, result.stderr
    assert "Usage:" in result.stdout
    assert result.stderr == ""


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

"""``weclaw-mq worker --log-format json``: a real worker process handles a task that logs and
one that fails; every line it writes is one JSON object with the task's identifiers, an
exception is a field of its line, and no password reaches the output. ``weclaw-mq outbox
relay`` takes the same option (``WECLAW_MQ_LOG_FORMAT``) and writes JSON lines too."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from aio_pika.abc import AbstractChannel

from tests.conftest import close_apps, delete_queues, queue_depth, settings_for
from tests.integration.fixture_apps.logging_app import LOGGED_PASSWORD, LOGGER, build_app
from tests.integration.processes import (
    one_error_line,
    run_cli,
    settings_env,
    spawn_cli_worker,
)
from weclaw_mq import TaskStatus
from weclaw_mq.contract.message import build_message
from weclaw_mq.outbox.store import OutboxFile

APP_PATH = "tests.integration.fixture_apps.logging_app:app"
REQUIRED = ("time", "level", "logger", "message")


def _records(text: str) -> list[dict[str, Any]]:
    """Every line as a JSON object; fails naming the first line that is not one."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise AssertionError(f"line {number} is not JSON ({e}): {line!r}") from None
        assert isinstance(record, dict), f"line {number} is not a JSON object: {line!r}"
        missing = [key for key in REQUIRED if key not in record]
        assert not missing, f"line {number} lacks {missing}: {line!r}"
        records.append(record)
    return records


def _one(records: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one record with {match}, got {found}"
    return found[0]


def _starting_with(records: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [r for r in records if str(r["message"]).startswith(prefix)]


async def test_a_json_worker_writes_one_object_per_line_with_the_task_identifiers(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> None:
    settings = settings_for(broker_url, redis_url)
    app = build_app(qname, settings=settings)
    log_path = tmp_path / "worker.log"
    worker = None
    try:
        await app.declare()
        worker = spawn_cli_worker(
            APP_PATH,
            settings=settings,
            app_env={"TEST_QUEUE": qname},
            log_path=log_path,
            extra_args=("--log-format", "json"),
        )
        await worker.wait_for_log('"message": "consuming ', 20, "the worker to consume")
        ok_id = await app.publish(qname, {"text": "ok"}, trace_id="trace-of-ok")
        fail_id = await app.publish(qname, {"text": "fail"}, trace_id="trace-of-fail")
        ok = await app.result(ok_id, timeout_s=20)
        failed = await app.result(fail_id, timeout_s=20)
        assert ok is not None and ok.status is TaskStatus.SUCCEEDED, ok
        assert failed is not None and failed.status is TaskStatus.DEAD_LETTERED, failed
        worker.signal(signal.SIGTERM)
        assert await worker.wait_exit() == 0, worker.describe()
    finally:
        if worker is not None:
            worker.kill()
        await close_apps([app], broker_url, redis_url)

    text = log_path.read_text()  # the worker's stderr (and its stdout, which stays empty)
    records = _records(text)
    assert LOGGED_PASSWORD not in text
    # Outside a task: no task fields at all (not placeholders).
    consuming = _starting_with(records, "consuming ")
    assert len(consuming) == 1
    assert consuming[0]["logger"] == "weclaw_mq.worker"
    assert not {"task_id", "trace_id", "queue", "attempt"} & consuming[0].keys()

    handled = _one(records, logger=LOGGER, task_id=ok_id)
    assert handled["level"] == "INFO"
    assert (
        handled["message"] == "handling ok (cache at redis://model:***@llm-cache.internal:6379/0)"
    )
    assert (handled["trace_id"], handled["queue"], handled["attempt"]) == ("trace-of-ok", qname, 1)
    assert handled["time"].endswith("+00:00")

    # A Python warning is a record of the same handler, not a bare line on stderr.
    warned = _one(records, logger="py.warnings", task_id=ok_id)
    assert warned["level"] == "WARNING"
    assert "UserWarning: ok: this model is deprecated" in warned["message"]

    # The failing task: each attempt's lines carry its attempt number.
    for attempt in (1, 2):
        caught = _one(records, logger=LOGGER, task_id=fail_id, attempt=attempt, level="ERROR")
        assert caught["message"] == "caught while handling fail"
        assert (caught["trace_id"], caught["queue"]) == ("trace-of-fail", qname)
        assert caught["exc_type"] == "ValueError"
        assert "the second line" in caught["exc_message"]
        assert caught["exc_traceback"].startswith("Traceback (most recent call last):")
        assert "ValueError: the cache at redis://model:***@" in caught["exc_traceback"]
    (retried,) = _starting_with(records, "retried: ")
    assert (retried["level"], retried["task_id"], retried["attempt"]) == ("WARNING", fail_id, 1)
    (dead,) = _starting_with(records, "dead_lettered: ")
    assert (dead["level"], dead["task_id"], dead["attempt"]) == ("ERROR", fail_id, 2)
    assert dead["trace_id"] == "trace-of-fail"


async def test_an_unknown_log_format_is_one_usage_line_from_the_option_or_the_setting() -> None:
    flag = await run_cli("worker", APP_PATH, "--log-format", "xml")
    assert flag.code == 2
    assert "'xml' is not one of text, json" in one_error_line(flag)
    setting = await run_cli("worker", APP_PATH, env={"WECLAW_MQ_LOG_FORMAT": "yaml"})
    assert setting.code == 2
    assert "WECLAW_MQ_LOG_FORMAT" in one_error_line(setting)
    relay = await run_cli("outbox", "relay", "--once", "--log-format", "xml")
    assert relay.code == 2
    assert "'xml' is not one of text, json" in one_error_line(relay)


async def test_a_json_outbox_relay_writes_one_object_per_line(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path, amqp: AbstractChannel
) -> None:
    path = tmp_path / "outbox.db"
    rows = OutboxFile(path, max_rows=100, max_bytes=10**6)
    # One row for a queue that exists (relayed), one for a queue nobody declared: the relay
    # keeps it and logs why (a WARNING with the queue's name).
    missing = f"{qname}-missing"
    rows.add(
        [
            (qname, build_message(b'{"n": 1}', task_id=f"{qname}-sent", headers={})),
            (missing, build_message(b'{"n": 2}', task_id=f"{qname}-kept", headers={})),
        ]
    )
    rows.close()
    await amqp.declare_queue(qname, durable=True)
    # The setting, not the flag (the worker's test takes the flag): both reach one option.
    env = {
        **settings_env(settings_for(broker_url, redis_url, results_enabled=False)),
        "WECLAW_MQ_LOG_FORMAT": "json",
        "WECLAW_MQ_LOG_LEVEL": "DEBUG",
    }
    try:
        done = await run_cli("outbox", "relay", "--once", "--path", str(path), env=env)
        assert done.code == 0, done.stderr
        assert done.stdout.strip() == "relayed 1 task(s)"
        assert await queue_depth(amqp, qname) == 1
    finally:
        await delete_queues(broker_url, [qname])

    records = _records(done.stderr)
    # DEBUG: other libraries' records (asyncio's) come out as JSON objects as well.
    assert len(records) >= 2 and {r["logger"] for r in records} - {"asyncio"}, records
    (refused,) = [r for r in records if missing in str(r["message"])]
    assert refused["level"] == "WARNING" and refused["logger"].startswith("weclaw_mq"), refused
    assert "guest:guest" not in done.stderr

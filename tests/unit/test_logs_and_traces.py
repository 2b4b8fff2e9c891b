"""The log formats and the OpenTelemetry switch, without a broker."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability import tracing
from weclaw_mq.observability.otel import spans_for
from weclaw_mq.observability.tracing import TraceContext, TraceLogFilter, formatter
from weclaw_mq.settings import Settings


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(TraceLogFilter())
    handler.setFormatter(formatter("json"))
    logger = logging.getLogger(f"test.json.{id(out)}")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield logger, out
    logger.removeHandler(handler)


def test_a_json_record_is_one_line_with_the_task_fields_and_the_exception_as_fields(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = json_log
    logger.info("outside any task")
    token = tracing.enter(TraceContext(trace_id="tr-1", task_id="t-1", queue="q", attempt=3))
    try:
        try:
            raise ValueError("amqp://weclaw:hunter2@rabbit:5672/ said\nno")
        except ValueError:
            logger.exception("failed with %s", "amqps://u:hunter2@h/vhost")
    finally:
        tracing.leave(token)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the traceback's newlines stay inside its record's one line
    outside, failed = (json.loads(line) for line in lines)
    assert set(outside) == {"time", "level", "logger", "message"}
    assert failed["message"] == "failed with amqps://u:***@h/vhost"
    assert (failed["task_id"], failed["trace_id"], failed["queue"], failed["attempt"]) == (
        "t-1",
        "tr-1",
        "q",
        3,
    )
    assert failed["exc_type"] == "ValueError"
    assert failed["exc_message"] == "amqp://weclaw:***@rabbit:5672/ said\nno"
    assert failed["exc_traceback"].startswith("Traceback (most recent call last):")
    assert "hunter2" not in out.getvalue()


def test_the_text_format_redacts_passwords_too() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "at %s", ("redis://:pw@h/0",), None)
    TraceLogFilter().filter(record)
    assert formatter("text").format(record).endswith("at redis://:***@h/0")


# A supervisor whose one forked child logs a line, then fails as a bad setting would (exit 3).
FORKED_CHILD_LOGS = """
import logging, sys
from weclaw_mq.cli.supervisor import Supervisor, SupervisorError, forking
from weclaw_mq.observability.tracing import configure_logging

configure_logging("INFO", "json")

def child(index: int) -> int:
    logging.getLogger("weclaw_mq.worker").info("child %d here", index)
    print("weclaw-mq: error: a bad setting", file=sys.stderr)
    return 3

try:
    Supervisor(forking(child), 1).run()
except SupervisorError as e:
    print(e.exit_code, e, file=sys.stderr)
"""


def test_the_supervisor_hands_its_log_format_to_every_child() -> None:
    # Forked after the supervisor configured its logging: the child logs as it was told to.
    done = subprocess.run(
        [sys.executable, "-c", FORKED_CHILD_LOGS], capture_output=True, text=True, timeout=60
    )
    lines = done.stderr.splitlines()
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    assert any(e["message"] == "child 0 here" for e in logged), done.stderr
    assert lines[-1] == "3 worker process 0 failed (exit 3): a bad setting", done.stderr


def test_otel_on_without_opentelemetry_installed_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules makes the import fail, as on a machine without the extra.
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'weclaw_mq\[otel\]'"):
        spans_for(Settings(otel="on", _env_file=None))  # type: ignore[call-arg]
    # auto and off never try.
    assert spans_for(Settings(otel="auto", _env_file=None)) is None  # type: ignore[call-arg]
    assert spans_for(Settings(otel="off", _env_file=None)) is None  # type: ignore[call-arg]

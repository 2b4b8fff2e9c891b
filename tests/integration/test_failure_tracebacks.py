"""A failed attempt's log line carries the handler's traceback, from the handler's own frames
down (the worker's left out), at the level ``retry_log_level`` names; ``failure_tracebacks``
turns the tracebacks off. A real worker on the real broker, a handler from a file of its own
so the frames can be told apart."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import load_module
from weclaw_mq import App, RetryPolicy, TaskStatus

HANDLER = """def parse(text):
    return int(text)  # the bug


async def summarise(task: dict) -> None:
    parse(task["text"])
"""
BUG_LINE = 2


def load_handler(folder: Path) -> Any:
    path = folder / "flaky_summaries.py"
    path.write_text(HANDLER)
    return load_module(path, "flaky_summaries")


def failure_records(caplog: pytest.LogCaptureFixture, outcome: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "weclaw_mq.worker" and r.getMessage().startswith(f"{outcome}:")
    ]


async def failure_lines(
    app: App,
    start_worker: Callable[..., Any],
    queue: str,
    folder: Path,
    caplog: pytest.LogCaptureFixture,
) -> tuple[Any, logging.LogRecord, logging.LogRecord]:
    """Run one task that fails twice to the DLQ; the handler's module and the retried and
    dead-lettered lines the worker wrote."""
    module = load_handler(folder)
    caplog.set_level(logging.DEBUG, logger="weclaw_mq.worker")
    app.handler(queue, retry=RetryPolicy(max_retries=1, delay_s=0.2))(module.summarise)
    await start_worker(app)
    async with app:
        task_id = await app.publish(queue, {"text": "not a number"})
        final = await app.result(task_id, timeout_s=30)
    assert final.status is TaskStatus.DEAD_LETTERED
    [retried] = failure_records(caplog, "retried")
    [dead] = failure_records(caplog, "dead_lettered")
    return module, retried, dead


async def test_a_retried_and_a_dead_lettered_attempt_log_the_handlers_traceback(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app("tracebacks")

    module, retried, dead = await failure_lines(app, start_worker, qname, tmp_path, caplog)

    assert retried.levelno == logging.WARNING and dead.levelno == logging.ERROR
    for record in (retried, dead):
        text = record.exc_text
        assert text is not None
        assert f'File "{module.__file__}", line {BUG_LINE}, in parse' in text, text
        assert "ValueError: invalid literal for int()" in text
        # The worker's own frames are left out: the traceback starts in the handler.
        assert "weclaw_mq" not in text.split("\n", 2)[1], text


async def test_the_retry_line_takes_its_level_and_drops_the_traceback_when_told(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app("quiet", retry_log_level="INFO", failure_tracebacks=False)

    _, retried, dead = await failure_lines(app, start_worker, qname, tmp_path, caplog)

    assert retried.levelno == logging.INFO
    assert retried.exc_text is None and dead.exc_text is None
    assert "ValueError" in retried.getMessage()  # the line still names the error

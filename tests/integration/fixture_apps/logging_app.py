"""A worker app whose handler writes log lines of its own, for the log-format tests.

Run as ``weclaw-mq worker tests.integration.fixture_apps.logging_app:app`` with cwd at the
repository root and ``TEST_QUEUE`` set. The handler logs ``handling <text>`` on the
``fixture.logging`` logger, and issues a ``UserWarning`` (Python's warnings machinery, not
``logging``). For the text ``fail`` it also logs a caught exception (with
``log.exception``), then raises: its one retry fails too, and the task is dead-lettered.
Both the log line and the errors quote a URL with the password ``LOGGED_PASSWORD``, which
must never reach the output.
"""

from __future__ import annotations

import logging
import warnings

from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from weclaw_mq import App, RetryPolicy, Settings

LOGGER = "fixture.logging"
LOGGED_PASSWORD = "s3cret-in-a-log-line"
SECRET_URL = f"redis://model:{LOGGED_PASSWORD}@llm-cache.internal:6379/0"
# One fast retry: both attempts fail, each with its attempt number in its lines.
RETRY = RetryPolicy(max_retries=1, delay_s=0.05, multiplier=1)

log = logging.getLogger(LOGGER)


class Job(BaseModel):
    text: str


def build_app(queue: str, *, settings: Settings) -> App:
    app = App("logging-fixture", settings=settings)

    @app.handler(queue, retry=RETRY)
    async def work(task: Job) -> str:
        log.info("handling %s (cache at %s)", task.text, SECRET_URL)
        warnings.warn(f"{task.text}: this model is deprecated", UserWarning, stacklevel=1)
        if task.text == "fail":
            try:
                raise ValueError(f"the cache at {SECRET_URL} refused\nthe second line")
            except ValueError:
                log.exception("caught while handling %s", task.text)
            raise RuntimeError(f"the model is down (cache {SECRET_URL})")
        return task.text

    return app


def _app_from_env() -> App:
    (queue,) = required_env(__name__, "TEST_QUEUE")
    return build_app(queue, settings=Settings())


__getattr__ = lazy_app(__name__, _app_from_env)

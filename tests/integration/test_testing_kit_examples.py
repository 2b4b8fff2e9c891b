"""The page "Testing your handlers" (docs/how-to/testing.md) runs as a user would run it: its
two code blocks that name their file (``# summaries.py``, ``# test_summaries.py``) are written
into an empty folder and pytest is started there, in its own process, finding the plugin
through the installed entry point (nothing of this repository's conftest applies). The
plugin's service fixtures are run the same way: against the shared RabbitMQ and Redis named
in WECLAW_MQ_AMQP_URL / WECLAW_MQ_REDIS_URL, and against a URL where nothing answers, which
must fail with one line saying how to get a broker. Without a URL set and without a Docker
engine (this machine has none), the local default services are the ones found."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import AMQP_URL, REDIS_URL
from tests.integration.dead_endpoints import closed_port
from weclaw_mq.testing import pytest_plugin, services

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "testing.md"
# A code block whose first line names its file: "# summaries.py".
_NAMED_BLOCK = re.compile(r"```python\n# (\w+\.py)\n(.*?)```", re.DOTALL)

# This venv's plugins that the runs do not need and that are slow to load.
QUIET_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:xdist")

SERVICES_TEST = """
import aio_pika
import pytest
import redis.asyncio as aioredis


@pytest.mark.asyncio
async def test_the_services_answer(weclaw_rabbitmq_url, weclaw_redis_url):
    conn = await aio_pika.connect(weclaw_rabbitmq_url)
    await conn.close()
    client = aioredis.Redis.from_url(weclaw_redis_url)
    assert await client.ping()
    await client.aclose()
"""


def page_files() -> dict[str, str]:
    """The page's code blocks that name their file, by name (the whole page is read)."""
    return dict(_NAMED_BLOCK.findall(PAGE.read_text(encoding="utf-8")))


def run_pytest(folder: Path, **env: str | None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WECLAW_MQ_")}
    environ.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *QUIET_PLUGINS],
        cwd=folder,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_testing_pages_example_passes_as_a_users_test_run(tmp_path: Path) -> None:
    files = page_files()
    assert sorted(files) == ["summaries.py", "test_summaries.py"]
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    (tmp_path / "test_services.py").write_text(SERVICES_TEST)

    # The shared services, named as a user's CI would name them.
    run = run_pytest(tmp_path, WECLAW_MQ_AMQP_URL=AMQP_URL, WECLAW_MQ_REDIS_URL=REDIS_URL)

    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\b4 passed\b", run.stdout), run.stdout


def test_the_service_fixtures_fail_with_how_to_get_a_broker(tmp_path: Path) -> None:
    (tmp_path / "test_services.py").write_text(SERVICES_TEST)
    nowhere = f"amqp://guest:secret-word@127.0.0.1:{closed_port()}/"

    # A short wait: the closed port never opens, and the default 30 s is this test's cost.
    run = run_pytest(
        tmp_path,
        WECLAW_MQ_AMQP_URL=nowhere,
        WECLAW_MQ_REDIS_URL=REDIS_URL,
        WECLAW_MQ_SERVICE_WAIT_S="1",
    )

    assert run.returncode == 1, run.stdout + run.stderr
    # The failure is its one line (pytest repeats it in its summary), nothing chained to it.
    lines = [ln for ln in run.stdout.splitlines() if "no RabbitMQ answers" in ln]
    assert lines and "at WECLAW_MQ_AMQP_URL" in lines[0] and "start one:" in lines[0]
    assert "another exception occurred" not in run.stdout
    assert "Traceback" not in run.stdout and "secret-word" not in run.stdout


def test_without_a_url_set_or_a_docker_engine_the_local_default_services_are_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for env in (services.AMQP_ENV, services.REDIS_ENV):
        monkeypatch.delenv(env, raising=False)
    assert not services.docker_engine()  # this machine has none: the local path is the one
    with services.rabbitmq() as amqp, services.redis() as redis:
        assert (amqp, redis) == (services.LOCAL_AMQP_URL, services.LOCAL_REDIS_URL)


def test_every_fixture_of_the_plugin_is_named_weclaw_so_none_shadows_a_projects_own() -> None:
    fixtures = [
        name
        for name, value in vars(pytest_plugin).items()
        if hasattr(value, "_fixture_function_marker")
    ]
    assert sorted(fixtures) == ["weclaw_rabbitmq_url", "weclaw_redis_url", "weclaw_test_broker"]

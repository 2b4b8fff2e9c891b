"""docker-compose.yml as written (no Docker engine needed): its RabbitMQ is the version these
tests run against, every port is published on 127.0.0.1 only, and its Redis requires a
password that its healthcheck and the documented WECLAW_MQ_REDIS_URL use. The healthcheck's
own shell command runs here, against a private redis-server with a password.

``make compose-check`` (docker-compose config) checks the file's schema beside this."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import aio_pika
import yaml

from tests.private_servers import PrivateRedis, PrivateServers
from weclaw_mq.policy.broker_version import parse_server_version
from weclaw_mq.testing.services import RABBITMQ_IMAGE
from weclaw_mq.wire.connection import server_version

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
# The setting-up page states the pin and the compose Redis URL.
SETUP_PAGE = REPO / "docs" / "operations" / "local-services.md"
# ${NAME:-default} or ${NAME-default}, as compose interpolates them.
VARIABLE = re.compile(r"\$\{(\w+)(:?-)([^}]*)\}")


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def default_of(text: str) -> tuple[str, str]:
    """(variable, default) of the one ``${VAR-default}`` that ``text`` is."""
    found = VARIABLE.fullmatch(text)
    assert found is not None, f"{text!r} is not a ${{VAR-default}} reference"
    return found.group(1), found.group(3)


def redis_password_default() -> tuple[str, str]:
    command = compose()["services"]["redis"]["command"]
    return default_of(command[command.index("--requirepass") + 1])


async def test_rabbitmq_is_pinned_to_the_version_these_tests_run_against(broker_url: str) -> None:
    services = compose()["services"]
    images = {name: s["image"] for name, s in services.items() if name.startswith("rabbitmq")}
    conn = await aio_pika.connect(broker_url)
    try:
        running = server_version(conn)
    finally:
        await conn.close()

    assert len(set(images.values())) == 1, f"one RabbitMQ image for every node: {images}"
    variable, image = default_of(next(iter(images.values())))
    assert variable == "WECLAW_RABBITMQ_IMAGE"
    repository, _, tag = image.partition(":")
    version = tag.removesuffix("-management")
    assert repository == "rabbitmq" and re.fullmatch(r"\d+\.\d+\.\d+", version), (
        f"{image}: pin an exact release, not a moving tag"
    )
    assert f"RabbitMQ is pinned to {version}" in SETUP_PAGE.read_text()
    # The test kit's containers start the same release (weclaw_mq.testing.services).
    assert f"rabbitmq:{version}" == RABBITMQ_IMAGE
    assert running == parse_server_version(version), (
        f"docker-compose.yml pins RabbitMQ {version}, but these tests run against {running}: "
        "run them on the pinned version, or pin the one they ran on"
    )


def test_every_port_is_published_on_localhost_only() -> None:
    published = [
        (name, port)
        for name, service in compose()["services"].items()
        for port in service.get("ports", [])
    ]

    assert len(published) >= 8
    for name, port in published:
        assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)


def test_redis_requires_a_password_by_default_and_the_documented_url_carries_it() -> None:
    redis = compose()["services"]["redis"]
    variable, password = redis_password_default()
    url = f"redis://:{password}@localhost:6379/0"
    setup_page = SETUP_PAGE.read_text()

    assert variable == "WECLAW_REDIS_PASSWORD" and password
    assert redis["environment"][variable] == f"${{{variable}-{password}}}"
    assert f'WECLAW_MQ_REDIS_URL="{url}"' in COMPOSE.read_text()
    assert url in setup_page, f"{SETUP_PAGE.name} shows WECLAW_MQ_REDIS_URL for the compose Redis"


def run_healthcheck(redis: PrivateRedis, password: str, folder: Path) -> int:
    """The redis healthcheck's shell command, as the container runs it (compose turns '$$'
    into '$'), with redis-cli pointed at ``redis``'s socket instead of the container's port."""
    test = compose()["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    real = shutil.which("redis-cli")
    assert real is not None, "needs redis-cli: apt-get install redis-server (Debian)"
    shim = folder / "redis-cli"
    shim.write_text(f'#!/bin/sh\nexec "{real}" -s "{redis.socket}" "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {
        "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}",
        redis_password_default()[0]: password,
    }
    result = subprocess.run(
        ["sh", "-c", test[1].replace("$$", "$")], env=env, capture_output=True, timeout=10
    )
    return result.returncode


def test_the_redis_healthcheck_is_healthy_only_with_the_password(
    private_servers: PrivateServers, tmp_path: Path
) -> None:
    _, password = redis_password_default()
    guarded = PrivateRedis(private_servers, private_servers.folder("redis-pw"), password=password)
    open_ = PrivateRedis(private_servers, private_servers.folder("redis-nopw"))
    guarded.start()
    open_.start()
    try:
        with_password = run_healthcheck(guarded, password, tmp_path)
        wrong_password = run_healthcheck(guarded, "not-the-password", tmp_path)
        without_password = run_healthcheck(guarded, "", tmp_path)
        # WECLAW_REDIS_PASSWORD set but empty (dev-services for a URL without one).
        no_password_server = run_healthcheck(open_, "", tmp_path)
    finally:
        guarded.stop()
        open_.stop()

    assert with_password == 0
    assert wrong_password != 0 and without_password != 0
    assert no_password_server == 0

"""``ops/dev-services.sh``, run as a script against real servers.

Pointed at free ports where nothing answers, ``up`` starts a private RabbitMQ node and a private
redis-server there (the packages' path: installed already on a development machine, by apt-get
as root otherwise) and ``down`` stops exactly those; pointed at the shared servers, it starts
nothing and stops nothing. Every test uses its own free ports and state folder, so two copies
of the suite can run at once, and stops what it started on every exit path: ``down`` first,
then SIGKILL for any recorded pid that is still the same process.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import pytest
import redis

from tests.conftest import AMQP_URL, REDIS_URL
from tests.private_servers import pings

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "ops" / "dev-services.sh"
# Bounded, generous for 2 shared cores: a private node boots in 5-20 s.
UP_TIMEOUT_S = 180
DOWN_TIMEOUT_S = 90
REDIS_SECRET = "dev-s3cret-pw"


def _packages_or_apt() -> bool:
    installed = os.access("/usr/lib/rabbitmq/bin/rabbitmq-server", os.X_OK) and bool(
        shutil.which("redis-server")
    )
    return installed or (os.geteuid() == 0 and shutil.which("apt-get") is not None)


pytestmark = pytest.mark.skipif(
    not _packages_or_apt(),
    reason="needs rabbitmq-server and redis-server (Debian packages), or root with apt-get",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def script_env(state: Path, amqp_url: str, redis_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "WECLAW_DEV_SERVICES_DIR": str(state),
        "WECLAW_MQ_AMQP_URL": amqp_url,
        "WECLAW_MQ_REDIS_URL": redis_url,
    }


def run_script(
    command: str, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), command],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def start_time(pid: int) -> str | None:
    """Start time of a live process; None once it has exited (a zombie has, too: in a
    container its parent may be an init that reaps late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def recorded_tags(state: Path) -> set[tuple[int, str]]:
    """Every (pid, start time) the script recorded in ``state``."""
    tags: set[tuple[int, str]] = set()
    for record in state.glob("*/record"):
        for line in record.read_text().splitlines():
            key, _, value = line.partition("=")
            if key in ("pid", "wrapper") and ":" in value:
                pid, st = value.split(":", 1)
                tags.add((int(pid), st))
    return tags


def alive(tag: tuple[int, str]) -> bool:
    return start_time(tag[0]) == tag[1]


def kill_leftovers(tags: set[tuple[int, str]]) -> None:
    """Last resort after ``down``: SIGKILL recorded pids that are still the same process."""
    for tag in tags:
        if alive(tag):
            os.kill(tag[0], signal.SIGKILL)


def redis_answers(url: str) -> bool:
    return pings(redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3))


def answers_within(check: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    """``check`` true now or within ``timeout_s``: the shared servers are restarted now and
    then by other users of this machine, which is not what these tests are about."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


async def amqp_answers(url: str) -> bool:
    try:
        conn = await aio_pika.connect(url, timeout=5)
    except Exception:
        return False
    try:
        channel = await conn.channel()
        await channel.close()
    finally:
        await conn.close()
    return True


@dataclass
class Started:
    env: dict[str, str]
    state: Path
    amqp_url: str
    redis_url: str
    up: subprocess.CompletedProcess[str]
    tags: set[tuple[int, str]]


@pytest.fixture(scope="module")
def private_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """One ``up`` for the module (a RabbitMQ node takes 5-20 s to boot), on free ports."""
    state = tmp_path_factory.mktemp("dev-services")
    amqp_url = f"amqp://guest:guest@localhost:{free_port()}/"
    redis_url = f"redis://:{REDIS_SECRET}@localhost:{free_port()}/0"
    env = script_env(state, amqp_url, redis_url)
    assert not redis_answers(redis_url)
    tags: set[tuple[int, str]] = set()
    try:
        up = run_script("up", env, UP_TIMEOUT_S)
        tags = recorded_tags(state)
        yield Started(env, state, amqp_url, redis_url, up, tags)
    finally:
        tags |= recorded_tags(state)
        try:
            run_script("down", env, DOWN_TIMEOUT_S)
        finally:
            kill_leftovers(tags)


async def test_up_starts_private_servers_where_nothing_answers(
    private_services: Started,
) -> None:
    started = private_services
    text = output(started.up)
    assert started.up.returncode == 0, text
    assert "starting a private RabbitMQ node weclaw-dev-" in text
    assert "starting redis-server" in text
    # Redacted: neither password reaches the output.
    assert REDIS_SECRET not in text
    assert "guest:guest" not in text
    assert len(started.tags) >= 2 and all(alive(t) for t in started.tags)

    assert await amqp_answers(started.amqp_url)
    client = redis.Redis.from_url(started.redis_url)
    try:
        client.set("dev-services-probe", "1", ex=60)
        assert client.get("dev-services-probe") == b"1"
    finally:
        client.close()
    # The private Redis takes the URL's password, so it is really the one we started.
    no_password = started.redis_url.replace(f":{REDIS_SECRET}@", "")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(no_password).get("dev-services-probe")


def test_up_again_uses_what_answers(private_services: Started) -> None:
    again = run_script("up", private_services.env, UP_TIMEOUT_S)
    text = output(again)
    assert again.returncode == 0, text
    assert text.count(", using it") == 2, text
    assert "starting" not in text
    assert recorded_tags(private_services.state) == private_services.tags


def test_status_reports_what_answers_and_what_up_started(private_services: Started) -> None:
    status = run_script("status", private_services.env, 60)
    text = output(status)
    assert status.returncode == 0, text
    assert text.count(": answers") == 2, text
    assert text.count("started by 'up': ") == 2, text
    assert "(running)" in text
    assert REDIS_SECRET not in text


# Runs last in this module: it takes down the module's servers.
async def test_down_stops_exactly_what_up_started(private_services: Started) -> None:
    started = private_services
    assert await amqp_answers(AMQP_URL)
    assert answers_within(lambda: redis_answers(REDIS_URL))

    down = run_script("down", started.env, DOWN_TIMEOUT_S)
    text = output(down)
    assert down.returncode == 0, text
    assert not any(alive(t) for t in started.tags), text
    assert not list(started.state.glob("*/record"))
    assert not await amqp_answers(started.amqp_url)
    assert not redis_answers(started.redis_url)
    # The shared servers were never touched.
    assert await amqp_answers(AMQP_URL)
    assert answers_within(lambda: redis_answers(REDIS_URL))

    again = run_script("down", started.env, DOWN_TIMEOUT_S)
    assert again.returncode == 0 and "nothing to stop" in output(again)


async def test_up_with_the_shared_servers_answering_starts_nothing(
    tmp_path: Path, broker_url: str, redis_url: str
) -> None:
    state = tmp_path / "state"
    env = script_env(state, broker_url, redis_url)
    try:
        up = run_script("up", env, UP_TIMEOUT_S)
        text = output(up)
        assert up.returncode == 0, text
        assert "RabbitMQ answers at" in text and "Redis answers at" in text
        assert text.count(", using it") == 2, text
        assert "starting" not in text
        assert not list(state.glob("*/record"))
    except BaseException:
        # Whatever it did start (it should not have) is stopped before the failure reports.
        tags = recorded_tags(state)
        run_script("down", env, DOWN_TIMEOUT_S)
        kill_leftovers(tags)
        raise

    down = run_script("down", env, DOWN_TIMEOUT_S)
    assert down.returncode == 0, output(down)
    assert "nothing to stop" in output(down)
    assert await amqp_answers(broker_url)
    assert answers_within(lambda: redis_answers(redis_url))


def test_down_with_nothing_started_is_a_noop(tmp_path: Path) -> None:
    state = tmp_path / "never-used"
    env = script_env(state, f"amqp://guest:guest@localhost:{free_port()}/", REDIS_URL)
    down = run_script("down", env, DOWN_TIMEOUT_S)
    assert down.returncode == 0, output(down)
    assert "nothing to stop" in output(down)
    assert not state.exists()
    assert answers_within(lambda: redis_answers(REDIS_URL))


def test_down_never_signals_a_reused_pid(tmp_path: Path) -> None:
    """A record whose pid now belongs to another process (other start time) is forgotten,
    and that process lives on."""
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        real = start_time(bystander.pid)
        assert real is not None
        record = tmp_path / "state" / "redis-6399"
        record.mkdir(parents=True)
        (record / "record").write_text(
            f"kind=private\nservice=redis\nport=6399\npid={bystander.pid}:{int(real) + 1}\n"
        )
        env = script_env(tmp_path / "state", AMQP_URL, REDIS_URL)
        down = run_script("down", env, DOWN_TIMEOUT_S)
        assert down.returncode == 0, output(down)
        assert "no longer running" in output(down)
        assert bystander.poll() is None
        assert not (record / "record").exists()
    finally:
        bystander.kill()
        bystander.wait(10)


def test_up_refuses_a_port_held_by_something_that_is_not_redis(
    tmp_path: Path, broker_url: str
) -> None:
    """A listener that never answers the protocol is not taken for Redis, nor replaced."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = script_env(tmp_path / "state", broker_url, f"redis://127.0.0.1:{port}/0")
        up = run_script("up", env, UP_TIMEOUT_S)
    text = output(up)
    assert up.returncode != 0, text
    assert f"port {port} is taken by a process that does not answer as Redis" in text
    assert "MISSING Redis" in text
    assert not list((tmp_path / "state").glob("*/record"))


def test_up_replaces_a_server_of_its_own_that_died(tmp_path: Path, broker_url: str) -> None:
    """A recorded redis-server killed with SIGKILL (a zombie until reaped) is not taken for a
    live one: the next ``up`` starts a new one and ``down`` stops that."""
    state = tmp_path / "state"
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    env = script_env(state, broker_url, redis_url)
    tags: set[tuple[int, str]] = set()
    try:
        first = run_script("up", env, UP_TIMEOUT_S)
        tags = recorded_tags(state)
        assert first.returncode == 0 and len(tags) == 1, output(first)
        (dead,) = tags
        os.kill(dead[0], signal.SIGKILL)

        second = run_script("up", env, UP_TIMEOUT_S)
        tags |= recorded_tags(state)
        text = output(second)
        assert second.returncode == 0, text
        assert "no longer running" in text and "starting redis-server" in text
        assert redis_answers(redis_url)
        (new,) = recorded_tags(state)
        assert new != dead and alive(new)
    finally:
        tags |= recorded_tags(state)
        try:
            run_script("down", env, DOWN_TIMEOUT_S)
        finally:
            kill_leftovers(tags)
    assert not redis_answers(redis_url)

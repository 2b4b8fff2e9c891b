"""A real RabbitMQ and Redis for tests: the one named in the environment, a throwaway
container, or the local default, in that order.

1. ``WECLAW_MQ_AMQP_URL`` / ``WECLAW_MQ_REDIS_URL`` set: that service, which must answer
   (a URL someone set is never replaced by a container behind their back).
2. Else, where a Docker engine answers: a container started with testcontainers
   (``pip install 'weclaw-mq[testing]'``), stopped when the ``with`` block ends. The images
   are ``RABBITMQ_IMAGE`` and ``REDIS_IMAGE``.
3. Else the local default (``amqp://guest:guest@127.0.0.1:5672/``,
   ``redis://127.0.0.1:6379/0``), which must answer.

Whatever cannot be had is a ``ServiceMissing`` whose message says how to get it; the pytest
fixtures turn it into a failure with that message, never a skip. testcontainers is imported
only on path 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Awaitable, Callable, Iterator

from pydantic import SecretStr

AMQP_ENV = "WECLAW_MQ_AMQP_URL"
REDIS_ENV = "WECLAW_MQ_REDIS_URL"
LOCAL_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
# The release docker-compose.yml pins and the project's own tests run on (a test keeps the two
# equal); pass image= to rabbitmq_container for the one you run in production.
RABBITMQ_IMAGE = "rabbitmq:3.10.8"
REDIS_IMAGE = "redis:7"

HOW_TO_GET_RABBITMQ = (
    "start one: 'rabbitmq-server -detached' (Debian package rabbitmq-server), or "
    "'docker compose up -d rabbitmq' from the weclaw_mq repository, or point "
    f"{AMQP_ENV} at one; with a Docker engine, pip install 'weclaw-mq[testing]' starts one"
)
HOW_TO_GET_REDIS = (
    "start one: 'redis-server --daemonize yes --port 6379 --save \"\" --appendonly no', or "
    "'docker compose up -d redis' (with the password of docker-compose.yml in the URL), "
    f"or point {REDIS_ENV} at one; with a Docker engine, "
    "pip install 'weclaw-mq[testing]' starts one"
)
HOW_TO_GET_TESTCONTAINERS = (
    "a Docker engine is there but testcontainers is not installed: "
    "pip install 'weclaw-mq[testing]' (or set {env} to a running service)"
)


class ServiceMissing(Exception):
    """No service to test against; the message says how to get one."""


# Between attempts while waiting for a service: a bad moment (a broker restarting, a burst of
# load) is waited out instead of failing every test of the session.
RETRY_EVERY_S = 1.0
# How long the fixtures wait for a service that does not answer yet before failing;
# WECLAW_MQ_SERVICE_WAIT_S changes it (0 fails at the first refusal).
SERVICE_WAIT_S = 30.0
SERVICE_WAIT_ENV = "WECLAW_MQ_SERVICE_WAIT_S"


def service_wait_s() -> float:
    """``WECLAW_MQ_SERVICE_WAIT_S`` (seconds, 0 to 3600) or ``SERVICE_WAIT_S``; a value that
    is not one is a ``ServiceMissing`` naming it, not a wait of some other length."""
    raw = os.environ.get(SERVICE_WAIT_ENV, "").strip()
    if not raw:
        return SERVICE_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 3600.0:  # NaN fails this too
        raise ServiceMissing(
            f"{SERVICE_WAIT_ENV}={raw!r} is not a number of seconds from 0 to 3600"
        )
    return value


async def _retried(attempt: Callable[[], Awaitable[str | None]], wait_s: float) -> str | None:
    """None once ``attempt`` succeeds within ``wait_s``; else its last problem, with how long
    it was tried."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    tries = 0
    while True:
        tries += 1
        problem = await attempt()
        if problem is None:
            return None
        left = deadline - loop.time()
        if left <= 0:
            if wait_s <= 0:
                return problem
            return f"{problem} (tried {tries} times over {wait_s:g} s)"
        await asyncio.sleep(min(RETRY_EVERY_S, left))


async def _amqp_problem(url: str) -> str | None:
    from weclaw_mq.errors import BrokerUnavailableError
    from weclaw_mq.settings import Settings
    from weclaw_mq.wire.connection import BrokerEndpoints

    # The library's own connect, so the problem reads as the library would say it.
    endpoints = BrokerEndpoints(Settings(amqp_url=SecretStr(url)))
    try:
        conn = await endpoints.connect(name="weclaw_mq.testing: is a broker there?")
    except BrokerUnavailableError as e:
        return str(e)
    await conn.close()
    return None


async def _redis_problem(url: str) -> str | None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=5)
    try:
        await client.ping()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        await client.aclose()
    return None


def amqp_problem(url: str, *, wait_s: float = 0.0) -> str | None:
    """Why no RabbitMQ answers at ``url`` (None: it does), trying again for up to ``wait_s``.
    Not from inside an event loop."""
    return asyncio.run(_retried(lambda: _amqp_problem(url), wait_s))


def redis_problem(url: str, *, wait_s: float = 0.0) -> str | None:
    """Why no Redis answers at ``url`` (None: it does), trying again for up to ``wait_s``.
    Not from inside an event loop."""
    return asyncio.run(_retried(lambda: _redis_problem(url), wait_s))


def docker_engine() -> bool:
    """Whether a Docker engine is there to start containers (a client alone is not)."""
    if shutil.which("docker") is None:
        return False
    return os.path.exists("/var/run/docker.sock") or bool(os.environ.get("DOCKER_HOST"))


@contextlib.contextmanager
def rabbitmq_container(image: str = RABBITMQ_IMAGE) -> Iterator[str]:
    """The AMQP URL of a RabbitMQ container, stopped on exit."""
    try:
        from testcontainers.rabbitmq import RabbitMqContainer  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ServiceMissing(HOW_TO_GET_TESTCONTAINERS.format(env=AMQP_ENV)) from e
    with RabbitMqContainer(image) as container:
        host, port = container.get_container_host_ip(), container.get_exposed_port(5672)
        yield f"amqp://guest:guest@{host}:{port}/"


@contextlib.contextmanager
def redis_container(image: str = REDIS_IMAGE) -> Iterator[str]:
    """The URL of a Redis container, stopped on exit."""
    try:
        from testcontainers.redis import RedisContainer  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ServiceMissing(HOW_TO_GET_TESTCONTAINERS.format(env=REDIS_ENV)) from e
    with RedisContainer(image) as container:
        host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
        yield f"redis://{host}:{port}/0"


@contextlib.contextmanager
def rabbitmq() -> Iterator[str]:
    """A RabbitMQ to test against (see the module's order), as its AMQP URL."""
    with _service(
        "RabbitMQ", AMQP_ENV, LOCAL_AMQP_URL, amqp_problem, rabbitmq_container, HOW_TO_GET_RABBITMQ
    ) as url:
        yield url


@contextlib.contextmanager
def redis() -> Iterator[str]:
    """A Redis to test against (see the module's order), as its URL."""
    with _service(
        "Redis", REDIS_ENV, LOCAL_REDIS_URL, redis_problem, redis_container, HOW_TO_GET_REDIS
    ) as url:
        yield url


@contextlib.contextmanager
def _service(
    what: str,
    env: str,
    local_url: str,
    problem_at: Callable[..., str | None],
    container: Callable[[], contextlib.AbstractContextManager[str]],
    how_to: str,
) -> Iterator[str]:
    named = os.environ.get(env)
    if not named and docker_engine():
        with container() as url:
            yield url
        return
    url = named or local_url
    problem = problem_at(url, wait_s=service_wait_s())
    if problem is not None:
        where = f"at {env}" if named else f"at {local_url} (the default; {env} is not set)"
        # The problem text, never the URL: it may hold a password.
        raise ServiceMissing(f"no {what} answers {where} ({problem}); {how_to}")
    yield url

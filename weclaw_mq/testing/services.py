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
from collections.abc import Callable, Iterator

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


async def _amqp_problem(url: str) -> str | None:
    import aio_pika

    try:
        conn = await aio_pika.connect(url, timeout=5)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    await conn.close()
    return None


async def _redis_problem(url: str) -> str | None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        await client.ping()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        await client.aclose()
    return None


def amqp_problem(url: str) -> str | None:
    """Why no RabbitMQ answers at ``url`` (None: it does). Not from inside an event loop."""
    return asyncio.run(_amqp_problem(url))


def redis_problem(url: str) -> str | None:
    """Why no Redis answers at ``url`` (None: it does). Not from inside an event loop."""
    return asyncio.run(_redis_problem(url))


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
    problem_at: Callable[[str], str | None],
    container: Callable[[], contextlib.AbstractContextManager[str]],
    how_to: str,
) -> Iterator[str]:
    named = os.environ.get(env)
    if not named and docker_engine():
        with container() as url:
            yield url
        return
    url = named or local_url
    problem = problem_at(url)
    if problem is not None:
        where = f"at {env}" if named else f"at {local_url} (the default; {env} is not set)"
        # The problem text, never the URL: it may hold a password.
        raise ServiceMissing(f"no {what} answers {where} ({problem}); {how_to}")
    yield url

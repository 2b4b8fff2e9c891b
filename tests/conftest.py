"""Shared fixtures: the real broker and Redis, unique queue names, and cleanup.

The broker is shared by every test and by CI, so each test names its own queues and every
queue a test's apps declared is deleted at teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aio_pika
import pytest
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from tests.private_servers import PrivateRedis, PrivateRedisCluster, PrivateServers
from weclaw_mq import App, Settings, Worker
from weclaw_mq.contract.naming import (
    BODY_KEY_PREFIX,
    GUARD_KEY_PREFIX,
    RETRY_INFIX,
    STATE_KEY_PREFIX,
    STEPS_KEY_PREFIX,
    TASK_INDEX_KEY,
    TASK_INDEX_QUEUES_KEY,
    WATCH_KEY_PREFIX,
    cancel_key,
    fair_key,
    is_shared_name,
    latest_key,
    queue_key_pattern,
    stream_key,
    task_index_queue_key,
    task_index_status_key,
    timeline_key,
)
from weclaw_mq.state.task_index import SPARSE_STATUSES
from weclaw_mq.streaming import StreamEvent
from weclaw_mq.testing import services
from weclaw_mq.wire.topology import queue_declarations

AMQP_URL = os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0")

# Settings under which the keys a test leaves behind expire in minutes, not the 24 h defaults.
SHORT_TTLS: dict[str, Any] = {"result_ttl_s": 120, "done_ttl_s": 120}

HOW_TO_GET_A_BROKER = services.HOW_TO_GET_RABBITMQ
HOW_TO_GET_REDIS = services.HOW_TO_GET_REDIS


# The project's own order (weclaw_mq.testing.services has the users'): the shared local
# services first, a container only where they do not answer and a Docker engine runs.
#
# Function-scoped over a per-process memory of the answer: a session fixture would cache one
# failed connect and error every later test of the process. The first check waits out a bad
# moment (services.SERVICE_WAIT_S); after a failure each later test asks once more.
_answered: dict[str, str] = {}
_failed: set[str] = set()


def _service_url(
    what: str,
    url: str,
    problem_at: Callable[..., str | None],
    container: Callable[[], str],
    how_to: str,
) -> str:
    if url in _answered:
        return _answered[url]
    wait_s = 0.0 if url in _failed else services.service_wait_s()
    problem = problem_at(url, wait_s=wait_s)
    if problem is None:
        _failed.discard(url)
        _answered[url] = url
        return url
    if services.docker_engine():
        _answered[url] = container()
        return _answered[url]
    _failed.add(url)
    env = "WECLAW_MQ_AMQP_URL" if what == "RabbitMQ" else "WECLAW_MQ_REDIS_URL"
    pytest.fail(
        f"no {what} answers at {env}: {problem}; if none runs there, {how_to}", pytrace=False
    )


@pytest.fixture(scope="session")
def _containers() -> Iterator[contextlib.ExitStack]:
    """Containers started for the session where no local service answers (Docker only)."""
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def broker_url(request: pytest.FixtureRequest) -> str:
    return _service_url(
        "RabbitMQ",
        AMQP_URL,
        services.amqp_problem,
        lambda: request.getfixturevalue("_containers").enter_context(services.rabbitmq_container()),
        HOW_TO_GET_A_BROKER,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "on_private_redis: every redis_url of the test (so every make_app app) is its own "
        "private_redis, which it may stop and start",
    )


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    if request.node.get_closest_marker("on_private_redis") is not None:
        private: PrivateRedis = request.getfixturevalue("private_redis")
        return private.url
    return _service_url(
        "Redis",
        REDIS_URL,
        services.redis_problem,
        lambda: request.getfixturevalue("_containers").enter_context(services.redis_container()),
        HOW_TO_GET_REDIS,
    )


# -- private servers, for tests that stop or break one (see tests/private_servers.py) --------


@pytest.fixture(scope="session")
def private_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateServers]:
    """This run's folder for private servers, and the safety nets that stop them.

    While it is open, SIGTERM to pytest acts as Ctrl-C (fixtures are torn down) instead of
    ending the process on the spot, an ``atexit`` hook stops what is left, and a reaper
    process stops everything once pytest is gone, even after SIGKILL.
    """
    servers = PrivateServers(
        tmp_path_factory.getbasetemp(), tmp_path_factory.mktemp("servers"), uuid.uuid4().hex[:10]
    )
    servers.open()
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    try:
        yield servers
    finally:
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        servers.close()


def running_private_redis(servers: PrivateServers, *, appendonly: bool) -> Iterator[PrivateRedis]:
    """A private redis-server, running until the generator is closed (for fixtures)."""
    if shutil.which("redis-server") is None:
        pytest.fail(
            "needs redis-server for a private Redis: apt-get install redis-server (Debian)",
            pytrace=False,
        )
    redis = PrivateRedis(servers, servers.folder("redis"), appendonly=appendonly)
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()


def require_redis_binaries(*names: str) -> None:
    """FAIL (never skip) saying how to get them, when redis-server or redis-cli is missing."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.fail(
            f"needs {' and '.join(missing)} for private Redis servers: "
            "apt-get install redis-server (Debian; it brings redis-cli)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def redis_cluster(private_servers: PrivateServers) -> Iterator[PrivateRedisCluster]:
    """A 3-primary Redis Cluster of this session's own (free ports), stopped at its end."""
    require_redis_binaries("redis-server", "redis-cli")
    cluster = PrivateRedisCluster(private_servers, private_servers.folder("redis-cluster"))
    try:
        try:
            cluster.start()
        except RuntimeError as e:
            pytest.fail(f"the private Redis Cluster: {e}", pytrace=False)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def private_redis(private_servers: PrivateServers) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own (unix socket), running; stop and start it at will."""
    yield from running_private_redis(private_servers, appendonly=False)


@pytest.fixture
def qname(request: pytest.FixtureRequest) -> str:
    """A queue name no other test (or CI run) uses."""
    short = request.node.name.removeprefix("test_")[:40].replace("[", "-").rstrip("]")
    return f"t-{short}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's Redis; bounded, as a test may have stopped its private one."""
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        yield client
    finally:
        await client.aclose()


def settings_for(broker_url: str, redis_url: str, **overrides: Any) -> Settings:
    return Settings(**{"amqp_url": broker_url, "redis_url": redis_url, **overrides})


async def delete_queues(broker_url: str, names: list[str]) -> None:
    # One channel for all: deleting a queue that is not there is no error, and each handler
    # has a few dozen queues (lanes x delay queues), so a channel per queue added up.
    shared = [name for name in names if is_shared_name(name)]
    if shared:  # the vhost's ladder: deleting it loses every other test's waiting tasks
        raise ValueError(f"delete_queues: {shared} are the vhost's shared queues, not a test's")
    conn = await aio_pika.connect(broker_url)
    try:
        channel = await conn.channel()
        for name in names:
            await channel.queue_delete(name)
            if RETRY_INFIX in name:
                # A delay queue's fanout exchange has its name (topology.delay_exchanges);
                # deleting one that is not there is no error either.
                await channel.exchange_delete(name)
    finally:
        await conn.close()


@pytest.fixture
async def make_app(broker_url: str, redis_url: str) -> AsyncIterator[Callable[..., App]]:
    """Build Apps on the test broker; at teardown close them and delete every queue they own."""
    apps: list[App] = []

    def factory(name: str = "test", **overrides: Any) -> App:
        app = App(name, settings=settings_for(broker_url, redis_url, **overrides))
        apps.append(app)
        return app

    yield factory
    await close_apps(apps, broker_url, redis_url)


async def close_apps(apps: Iterable[App], broker_url: str, redis_url: str) -> None:
    """Close ``apps``, delete every queue they own and forget their tasks' Redis keys."""
    await forget_task_keys(redis_url, await close_and_delete_queues(apps, broker_url))


async def close_and_delete_queues(apps: Iterable[App], broker_url: str) -> set[str]:
    """Close ``apps`` and delete every queue they own; their handlers' queues. Alone for an
    app whose Redis is not the test's (nothing of it to forget there)."""
    names: list[str] = []
    queues: set[str] = set()
    for app in apps:
        await app.close()
        for spec in app.handlers.values():
            names.extend(n for n, _ in queue_declarations(spec.queue_spec()))
            queues.add(spec.queue)
    await delete_queues(broker_url, sorted(set(names)))
    return queues


async def forget_limit_keys(redis_url: str, queue: str) -> None:
    """Delete the keys of ``queue``'s limits (they expire by themselves after one lease or
    period; a test leaves none behind anyway)."""
    from weclaw_mq.contract.naming import LIMIT_KEY_PREFIX

    client = aioredis.from_url(redis_url)
    try:
        pattern = f"{LIMIT_KEY_PREFIX}:{len(queue.encode())}:{queue}:*"
        keys = [k async for k in client.scan_iter(pattern, count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def forget_task_keys(redis_url: str, queues: Iterable[str]) -> None:
    """Delete the Redis keys (guard, record, body fingerprint, steps, latest pointer, stream,
    cancel marker, timeline, task index entries) of every task in ``queues``, so a test leaves
    nothing behind; best effort when the test left its Redis stopped."""
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
    try:
        for queue in queues:
            keys: list[bytes] = []
            for prefix in (
                GUARD_KEY_PREFIX,
                STATE_KEY_PREFIX,
                BODY_KEY_PREFIX,
                STEPS_KEY_PREFIX,
                WATCH_KEY_PREFIX,
            ):
                keys += [
                    k async for k in client.scan_iter(queue_key_pattern(prefix, queue), count=1000)
                ]
            task_ids = {k.rsplit(b":{", 1)[1].removesuffix(b"}").decode() for k in keys}
            keys += [
                key(t).encode()
                for t in task_ids
                for key in (latest_key, cancel_key, stream_key, timeline_key)
            ]
            if keys:
                await client.delete(*keys)
            # The queue's index entries, from the index and the sparse statuses' too.
            indexed = task_index_queue_key(queue)
            members = await client.zrange(indexed, 0, -1)
            sets = [TASK_INDEX_KEY, *(task_index_status_key(s.value) for s in SPARSE_STATUSES)]
            for start in range(0, len(members), 1000):
                for key in sets:
                    await client.zrem(key, *members[start : start + 1000])
            await client.delete(indexed)
            await client.srem(TASK_INDEX_QUEUES_KEY, indexed)
            # The fair-share book (the lane counts, each tenant's lane).
            fair = [k async for k in client.scan_iter(f"{fair_key(queue)}*", count=1000)]
            if fair:
                await client.delete(*fair)
    except (aioredis.RedisError, OSError):
        pass  # its Redis is gone (a test that stopped its private one): nothing to clean
    finally:
        await client.aclose()


@pytest.fixture
async def start_worker() -> AsyncIterator[Callable[..., Any]]:
    """Start a Worker in this event loop and wait until it consumes; stopped at teardown."""
    running: list[tuple[Worker, asyncio.Task[None]]] = []

    async def start(app: App, **kwargs: Any) -> Worker:
        worker = Worker(app, **kwargs)
        task = asyncio.create_task(worker.run())
        running.append((worker, task))
        ready = asyncio.create_task(worker.ready.wait())
        done, _ = await asyncio.wait({ready, task}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            ready.cancel()
            task.result()  # raises what stopped it
        assert ready in done, "worker did not start consuming within 20 s"
        return worker

    yield start
    for worker, task in running:
        worker.stop()
        await asyncio.wait_for(task, 30)


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` (sync or async) until true, or fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


async def collect(events: AsyncIterator[StreamEvent], timeout_s: float = 30.0) -> list[StreamEvent]:
    """Every event of a task's stream until its final one (bounded by ``timeout_s``)."""
    out: list[StreamEvent] = []
    async with asyncio.timeout(timeout_s):
        async for event in events:
            out.append(event)
    return out


async def ignoring_cancels(release: asyncio.Event) -> None:
    """Wait for ``release``, swallowing every cancellation meanwhile: a handler or hook that
    ignores being told to stop (the worker abandons it after its grace)."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue


# -- reading the broker back with plain aio-pika, independent of weclaw_mq ---------------------


@pytest.fixture
async def amqp(broker_url: str) -> AsyncIterator[AbstractChannel]:
    """A plain aio-pika channel for publishing raw bodies and reading queues back: the test's
    own view of the broker, independent of the library under test."""
    conn = await aio_pika.connect(broker_url)
    try:
        yield await conn.channel()
    finally:
        await conn.close()


async def queue_depth(channel: AbstractChannel, queue: str) -> int:
    """Messages ready in ``queue`` (unacked ones belong to a consumer and are not counted)."""
    declared = await channel.declare_queue(queue, passive=True)
    count = declared.declaration_result.message_count
    assert count is not None
    return count


async def get_message(channel: AbstractChannel, queue: str) -> AbstractIncomingMessage | None:
    """Take the head of ``queue`` (acked on delivery); None when the queue is empty."""
    q = await channel.get_queue(queue, ensure=False)
    return await q.get(no_ack=True, fail=False)


async def next_message(
    channel: AbstractChannel, queue: str, *, no_ack: bool = True, timeout_s: float = 10.0
) -> AbstractIncomingMessage:
    """The next message of ``queue``, waiting up to ``timeout_s`` for it: a hop through a
    dead-letter queue or a nack's return is not instant. ``no_ack=False`` leaves it to settle."""
    got: list[AbstractIncomingMessage] = []
    q = await channel.get_queue(queue, ensure=False)

    async def arrived() -> bool:
        message = await q.get(no_ack=no_ack, fail=False)
        if message is not None:
            got.append(message)
        return bool(got)

    await wait_until(arrived, timeout_s, what=f"a message in {queue}")
    return got[0]


def outcome_count(app: App, queue: str, outcome: str) -> float:
    """Deliveries of ``queue`` that ``app``'s worker settled with ``outcome`` (its metrics)."""
    value = app.metrics.registry.get_sample_value(
        "weclaw_mq_messages_total", {"queue": queue, "outcome": str(outcome)}
    )
    return value or 0.0


def consuming_connection(app_name: str) -> str:
    """The name of the consuming connection of a Worker of ``app_name`` run in this process
    (its publishing one is this name + ``-publish``)."""
    return f"{app_name}-worker-{socket.gethostname()}-{os.getpid()}"


def close_connections(name: str, *, prefix: bool = False) -> int:
    """Have the shared broker close the connections its clients named ``name`` (or whose name
    starts with it); how many. Only ever a test's own connections: the names carry its queue."""
    from tests.broker_ctl import broker_ctl  # it imports this module

    listing = broker_ctl("-q", "list_connections", "pid", "client_properties")
    wanted = f'{{"connection_name","{name}' + ("" if prefix else '"}')
    pids = [line.split("\t", 1)[0] for line in listing.splitlines() if wanted in line]
    for pid in pids:
        broker_ctl("-q", "close_connection", pid, "closed by a weclaw_mq test")
    return len(pids)


def load_module(path: Path, name: str, *, register: bool = False) -> ModuleType:
    """Import the file ``path`` as module ``name`` (a fresh copy each call); ``register``
    leaves it in ``sys.modules``, as an import of ``MODULE:APP`` would."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

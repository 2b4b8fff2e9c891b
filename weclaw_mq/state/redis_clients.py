"""The one place a Redis client for task state is made: one Redis, a Redis Cluster or the
primary a Sentinel set names, as ``settings.redis_url`` says (forms in ``redis_urls.py``).

Every script the store runs touches the keys of one task only, and every key of a task T is
hash-tagged ``{T}`` (``naming.py``): on a cluster they share one slot, so each script still
runs whole on one node. Waiters subscribe to T's done channel, which carries the same tag: a
classic ``PUBLISH`` reaches subscribers on every node of a cluster, and redis-py subscribes on
the node that serves the channel's slot, the node whose script publishes.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Generator, Mapping
from typing import Any, TypeAlias

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, ClusterPubSub, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from weclaw_mq.config.tls import TlsOptions, client_context
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.settings import Settings

StateClient: TypeAlias = aioredis.Redis | RedisCluster
"""What the store talks to: ``RedisCluster`` routes each command to its slot's node."""

# Redis failing or not answering, as redis-py raises it (its errors, and socket errors that
# escape it): the store turns each into StateUnavailableError (``state.is_state_failure``
# answers the same without importing redis-py).
REDIS_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

# A closed connection is noticed at its next use after this many idle seconds.
_HEALTH_CHECK_S = 30


def open_client(settings: Settings) -> StateClient:
    """A client for the task state at ``settings.redis_url``, sized by its pool settings."""
    common: dict[str, Any] = {
        "socket_connect_timeout": settings.redis_timeout_s,
        "socket_timeout": settings.redis_timeout_s,
        "health_check_interval": _HEALTH_CHECK_S,
    }
    # CLIENT LIST tells this process's connections from others' (one name per process; the
    # data nodes' connections only, not the Sentinels').
    named = {**common, "client_name": client_name()}
    topology = settings.redis_topology()
    if topology is None:
        # Not redis-py's BlockingConnectionPool: its condition and timeout cost CPU on every
        # command (benchmarks/README.md, "Numbers behind the code"). A worker takes a bounded
        # number of its connections at any concurrency (worker.start_checks,
        # REDIS_CONNECTIONS_NEEDED). A pool passed in: its connections retry nothing, so the
        # store's auto-pipeline sends its hot commands on them itself (state.pipelining's lean
        # path; so for Sentinel's).
        options: dict[str, Any] = {**named, **parse_url(settings.redis_url_plain())}
        if options.get("connection_class") is SSLConnection:  # rediss://
            options["connection_class"] = _TlsConnection
            options["weclaw_ssl_context"] = client_context(settings.tls("redis"))
        pool = aioredis.ConnectionPool(max_connections=settings.redis_max_connections, **options)
        return aioredis.Redis(connection_pool=pool)
    auth: dict[str, Any] = {"username": topology.username, "password": topology.password}
    if topology.tls:
        auth.update(_ssl_arguments(settings.tls("redis")))
    if topology.kind == "cluster":
        return _Cluster(
            startup_nodes=[ClusterNode(host, port) for host, port in topology.nodes],
            # Per node: a worker's commands spread over the primaries.
            max_connections=settings.redis_max_connections,
            **auth,
            **named,
        )
    assert topology.service_name is not None  # parse_topology requires it for Sentinel
    # The Sentinels are asked only where the primary is; they get the timeouts, not the
    # primary's password (a protected Sentinel set is not supported yet).
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        topology.nodes,
        sentinel_kwargs={
            **common,
            **(_ssl_arguments(settings.tls("redis")) if topology.tls else {}),
        },
    )
    primary: _SentinelPrimary = sentinel.master_for(
        topology.service_name,
        redis_class=_SentinelPrimary,
        db=topology.db,
        max_connections=settings.redis_max_connections,
        **auth,
        **named,
    )
    primary.weclaw_sentinels = sentinel
    return primary


def client_name() -> str:
    """The name this process's Redis connections carry (``CLIENT SETNAME``)."""
    return f"weclaw_mq-{os.getpid()}"


class _TlsConnection(SSLConnection):
    """A rediss:// connection that speaks TLS with the SSLContext tls.py made from the
    settings (the one AMQP uses too), instead of one redis-py builds per connection."""

    def __init__(self, *, weclaw_ssl_context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._weclaw_ssl_context = weclaw_ssl_context

    def _connection_arguments(self) -> Mapping[str, Any]:
        return {**super()._connection_arguments(), "ssl": self._weclaw_ssl_context}


def _ssl_arguments(options: TlsOptions) -> dict[str, Any]:
    """The same TLS settings as redis-py's own arguments, for Cluster and Sentinel clients,
    which make their connections' class themselves (a cluster one cannot be replaced). Unlike
    client_context, redis-py trusts the system's CAs beside a named CA file."""
    if not options.verify_hostname:
        client_context(options)  # the warning, and the files checked, in the one place
    return {
        "ssl": True,
        "ssl_ca_certs": options.ca_file,
        "ssl_certfile": options.cert_file,
        "ssl_keyfile": options.key_file,
        "ssl_check_hostname": options.verify_hostname,
    }


def is_cluster(client: StateClient) -> bool:
    """Whether commands of different tasks may land on different nodes (so one command must
    not name the keys of two tasks)."""
    return isinstance(client, RedisCluster)


class _SentinelPrimary(aioredis.Redis):
    """The primary's client; closing it closes the clients of its Sentinels too."""

    weclaw_sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.weclaw_sentinels is not None:
            for client in self.weclaw_sentinels.sentinels:
                await client.aclose()


class _Cluster(RedisCluster):
    """``RedisCluster`` whose pipelines run a registered script by its text.

    redis-py's cluster pipeline refuses ``EVALSHA`` (and would not load a script a node lacks:
    a new node, a replica just promoted); the store's lease renewals and record batches are
    pipelined script calls. ``EVAL`` with the text runs anywhere: Redis caches the compiled
    script by its hash either way, the cost is the text's bytes on the wire. Calls outside
    pipelines keep ``EVALSHA`` (redis-py loads the script on every primary at the first
    NOSCRIPT and retries).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script_texts: dict[str, Any] = {}

    async def initialize(self, *args: Any, **kwargs: Any) -> _Cluster:
        # redis-py's one exception type outside RedisError says two things: the seeds are a
        # plain Redis (a setting to change), or none answered (an outage, retried as one).
        nodes = self.nodes_manager.startup_nodes.values()
        seeds = ", ".join(f"{n.host}:{n.port}" for n in nodes)
        try:
            await super().initialize(*args, **kwargs)
        except RedisClusterException as e:
            if "Cluster mode is not enabled" in str(e):
                raise ConfigurationError(
                    f"WECLAW_MQ_REDIS_URL names a Redis Cluster, but {seeds} is a Redis "
                    "without cluster mode: use a redis:// URL for it"
                ) from e
            raise RedisConnectionError(str(e)) from e
        return self

    # redis-py annotates the sync Script for every client; RedisCluster's is AsyncScript.
    def register_script(self, script: Any) -> AsyncScript:  # type: ignore[override]
        registered = super().register_script(script)
        self.script_texts[registered.sha] = registered.script
        return registered

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if transaction or shard_hint:
            return super().pipeline(transaction, shard_hint)
        return _ScriptTextPipeline(self)  # type: ignore[abstract]  # (not abstract at run time)

    def pubsub(
        self,
        node: ClusterNode | None = None,
        host: str | None = None,
        port: int | None = None,
        **kwargs: Any,
    ) -> ClusterPubSub:
        return _ClusterPubSub(self, node=node, host=host, port=port, **kwargs)


class _ClusterPubSub(ClusterPubSub):
    """redis-py's cluster pub/sub picks the channel's node from the client's slot map, which a
    client fills at its first command: a ``result()`` before any other command raised
    KeyError. It fills it first (a no-op once filled)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.cluster.initialize()
        return await super().execute_command(*args, **kwargs)


class _ScriptTextPipeline(ClusterPipeline):
    def __init__(self, client: _Cluster) -> None:
        super().__init__(client)
        self._script_texts = client.script_texts

    def evalsha(self, sha: Any, numkeys: Any, *keys_and_args: Any) -> Any:
        text = self._script_texts.get(sha)
        if text is None:  # not one of ours: redis-py's own refusal
            return super().evalsha(sha, numkeys, *keys_and_args)
        self.execute_command("EVAL", text, numkeys, *keys_and_args)
        return _Queued(self)


class _Queued:
    """What a pipeline's ``evalsha`` returns: the call is queued already, whether or not this
    is awaited. AsyncScript awaits it; awaiting the cluster pipeline itself would
    re-initialise it, dropping every command queued so far."""

    def __init__(self, pipe: ClusterPipeline) -> None:
        self._pipe = pipe

    def __await__(self) -> Generator[Any, None, ClusterPipeline]:
        yield from ()
        return self._pipe

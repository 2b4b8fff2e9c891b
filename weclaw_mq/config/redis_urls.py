"""Where the task state lives: one Redis, a Redis Cluster or a Sentinel-managed primary,
read from ``WECLAW_MQ_REDIS_URL``.

    redis://[user:password@]host[:port][/db]        one Redis (also rediss://, unix://)
    redis+cluster://[user:password@]host:port[,host:port...]
                                                    a Redis Cluster; the nodes are seeds, the
                                                    client learns the rest from them
    redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]
                                                    the primary that these Sentinels name
                                                    ``service_name``; the password is the
                                                    primary's (Sentinels are asked without one)

``rediss+cluster://`` and ``rediss+sentinel://`` speak TLS to every server. Only the standard
library here: settings.py validates URLs with this module, and a worker that keeps no state
must not import redis-py for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote, urlsplit

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORTS = {"cluster": 6379, "sentinel": 26379}


@dataclass(frozen=True)
class RedisTopology:
    """A Redis Cluster's seed nodes, or a Sentinel set and the service it names."""

    kind: Literal["cluster", "sentinel"]
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    # Never in a repr: a topology may be logged or shown in a failing test's output.
    password: str | None = field(default=None, repr=False)
    service_name: str | None = None
    db: int = 0
    tls: bool = False


def is_multi_node(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster or a Sentinel set (not one server)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES + SENTINEL_SCHEMES


def check_database(url: str, shown: str) -> None:
    """``ValueError`` unless a ``redis://`` or ``rediss://`` URL's path is empty or a database
    number: redis-py reads any other path (``/abc``, ``/1/2``) silently as database 0."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("redis", "rediss"):
        return  # unix:// names its database in ?db=, and its path is the socket's
    path = unquote(parts.path).strip("/")
    if path and not path.isdigit():
        raise ValueError(f"the URL {shown} has database {path!r}, which is not a number")


def parse_topology(url: str, shown: str) -> RedisTopology:
    """The topology ``url`` names; ``ValueError`` saying what is wrong, naming the URL as
    ``shown`` (its redacted form) and never its password."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        raise ValueError(f"the URL {shown} is not a redis+cluster:// or redis+sentinel:// URL")
    kind: Literal["cluster", "sentinel"] = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    if "?" in rest or "#" in rest:
        raise ValueError(f"the URL {shown}: {scheme}:// URLs take no ?options or #fragment")
    authority, _, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = tuple(_node(n, DEFAULT_PORTS[kind], shown) for n in hosts.split(","))
    parts = [p for p in path.split("/") if p]
    service_name, db = None, 0
    if kind == "cluster":
        # A cluster has database 0 only; "/0" is accepted for URLs copied from one server.
        if parts not in ([], ["0"]):
            raise ValueError(f"the URL {shown}: a Redis Cluster has no database but 0")
    else:
        if not parts or len(parts) > 2:
            raise ValueError(
                f"the URL {shown} must end with /service_name (the name the Sentinels "
                "monitor the primary under), optionally followed by /db"
            )
        service_name = unquote(parts[0])
        if len(parts) == 2:
            db = _number(parts[1], "database", shown)
    return RedisTopology(
        kind,
        nodes,
        username=username,
        password=password,
        service_name=service_name,
        db=db,
        tls=scheme.startswith("rediss"),
    )


def _node(text: str, default_port: int, shown: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [v6 address]:port
        host, _, after = text[1:].partition("]")
        port_text = after.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"the URL {shown} has an empty host in its list of nodes")
    port = _number(port_text, "port", shown) if port_text else default_port
    if not 0 < port < 65536:
        raise ValueError(f"the URL {shown} has port {port}, outside 1-65535")
    return host, port


def _number(text: str, what: str, shown: str) -> int:
    if not text.isdigit():
        raise ValueError(f"the URL {shown} has {what} {text!r}, which is not a number")
    return int(text)

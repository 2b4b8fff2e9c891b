"""The suite's own Redis clients keep WECLAW_MQ_REDIS_URL's database and password.

A client built from host and port alone talks to db 0 without the password: on a configured
``redis://:pw@host:port/7`` it fails, or writes into db 0 of a Redis other people use (issue 38,
item 15: the lean path's proxied client did). Clients of the configured Redis are made from the
URL (``from_url``, or a test proxy's ``url_for``); host and port only for servers a test made
itself or that do not exist, listed here.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.parsing import parse_source

TESTS = Path(__file__).resolve().parents[1]
CLIENT_CLASSES = {"Redis", "StrictRedis"}

# (file, calls): each a server of the test's own, never the configured one.
HOST_AND_PORT_ALLOWED = {
    "integration/test_pipelining.py": 2,  # a closed port, and a local server that never answers
    "integration/test_redis_cluster.py": 2,  # the nodes of the session's private cluster
    "drills/test_tls.py": 1,  # the drill's private TLS Redis
    "private_servers.py": 1,  # a private TCP Redis's own client
}


def _clients_from_host_and_port(path: Path) -> int:
    calls = 0
    for node in ast.walk(parse_source(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in CLIENT_CLASSES and any(k.arg == "host" for k in node.keywords):
            calls += 1
    return calls


def test_no_test_builds_a_client_of_the_configured_redis_from_host_and_port() -> None:
    found = Counter(
        {
            str(path.relative_to(TESTS)): n
            for path in TESTS.rglob("*.py")
            if (n := _clients_from_host_and_port(path))
        }
    )
    assert found == Counter(HOST_AND_PORT_ALLOWED), (
        "build a client of the configured Redis with from_url(redis_url) (through a proxy: "
        "from_url(proxy.url_for(redis_url))), so it keeps the URL's database and password"
    )

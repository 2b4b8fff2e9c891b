"""The drills' private servers are this run's alone, and never outlive it.

- A node of this run starts even when the fixed ports of ``ops/cluster/cluster.sh`` (5680,
  25680) are held by someone else: a node left by an interrupted run, another checkout's
  drills. Before, every drill then failed at setup.
- When pytest dies without any teardown (SIGKILL), the reaper stops the servers it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.drills.conftest import NodeSpace, RabbitNode, cluster_sh
from tests.private_servers import PrivateServers, running

REPO_ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _hold(port: int) -> Iterator[bool]:
    """Listen on 127.0.0.1:``port`` while inside; False if someone already does."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:
        sock.close()
        yield False
        return
    try:
        yield True
    finally:
        sock.close()


def test_a_node_of_this_run_starts_although_the_default_ports_are_taken(
    private_servers: PrivateServers,
) -> None:
    space = NodeSpace(private_servers.folder("isolation"), uuid.uuid4().hex[:8], private_servers)
    node = RabbitNode("s1", space)
    with _hold(5680), _hold(25680):
        try:
            cluster_sh(space, "single-start", timeout_s=180)
            pid = node.require_pid()
            assert node.port not in (5680, 25680)
            assert node.name == f"weclaw-s1-{space.cluster_id}@localhost"
            # Everything the node writes stays in the run's folder.
            assert (space.base / "s1" / "mnesia").is_dir()
            assert not (REPO_ROOT / "erl_crash.dump").exists()
        finally:
            node.terminate()
    assert not running(pid), f"{node.name} (pid {pid}) still runs after terminate()"


# A stand-in for a pytest process: opens the safety nets, starts a private Redis, says so,
# and waits to be killed.
_DOOMED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tests.private_servers import PrivateRedis, PrivateServers

    watch = Path(sys.argv[1])
    servers = PrivateServers(watch, watch / "servers", sys.argv[2])
    servers.open()
    redis = PrivateRedis(servers, servers.folder("redis"))
    redis.start()
    print(redis.pid, flush=True)
    time.sleep(600)
    """
)


def test_private_servers_are_stopped_when_pytest_is_killed(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("needs redis-server: apt-get install redis-server (Debian)", pytrace=False)
    redis_pid = None
    doomed = subprocess.Popen(
        [sys.executable, "-c", _DOOMED, str(tmp_path), uuid.uuid4().hex[:10]],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert doomed.stdout is not None
        redis_pid = int(doomed.stdout.readline())
        assert running(redis_pid)
        os.kill(doomed.pid, signal.SIGKILL)  # no teardown, no atexit: only the reaper is left
        doomed.wait(timeout=10)
        deadline = time.monotonic() + 30
        while running(redis_pid):
            assert time.monotonic() < deadline, "the private redis-server outlived its pytest"
            time.sleep(0.05)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=10)
        if redis_pid is not None and running(redis_pid):  # the test failed: clean up anyway
            os.kill(redis_pid, signal.SIGKILL)

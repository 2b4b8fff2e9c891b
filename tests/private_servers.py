"""Servers of one test run's own (RabbitMQ nodes, redis-server), and what stops them.

Tests that break a server (stop it, pause it, cut its connections) never touch the machine's
shared broker and Redis: they start private ones, in a folder of this run, on ports or sockets
picked at run time, with a marker in their environment (``WECLAW_TEST_RUN=<run id>``). Each
process writes (or has written for it) a ``*.pid`` file somewhere under that folder.

Stopping them does not depend on pytest ending well. The fixtures stop what they started;
an ``atexit`` hook stops whatever is left; and a reaper process, started in a session of its
own, waits for pytest to go (however it goes: Ctrl-C, SIGTERM, SIGKILL, a timeout's
``os._exit``) and then stops every process named by a pid file under the folder. A process is
only ever signalled by pid, and only once it shows it is this run's: the marker in its
environment, or (redis-server writes its title over its environment) the run's folder on its
command line. A pid reused by someone else's process, or the shared epmd a node may have
spawned, is left alone.

Run as a script, this file is that reaper: ``python private_servers.py FOLDER MARKER``, stdin
a pipe held by pytest. It imports nothing outside the standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RUN_ENV = "WECLAW_TEST_RUN"
# SIGTERM first (a RabbitMQ node stops in about 3 s, redis at once), SIGKILL after this.
STOP_GRACE_S = 15.0


def _environ(pid: int) -> list[bytes] | None:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def running(pid: int) -> bool:
    """Neither gone nor a zombie (a node is not our child once its launcher exits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def has_env(pid: int, assignment: str) -> bool:
    """Whether ``pid`` runs with ``assignment`` (``NAME=value``) in its environment."""
    environ = _environ(pid)
    return environ is not None and assignment.encode() in environ and running(pid)


def is_ours(pid: int, marker: str, root: Path) -> bool:
    """Whether ``pid`` is a running process of the run with this marker and folder."""
    if has_env(pid, marker):
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(root).encode() in cmdline and running(pid)


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found.update(int(p) for p in children.read_text().split())
    return found


def pids_under(folder: Path) -> set[int]:
    """Every pid named by a ``*.pid`` file under ``folder``, with the children of each (a
    RabbitMQ launcher's VM, before the VM has written its own pid file)."""
    pids: set[int] = set()
    for file in folder.rglob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.add(int(file.read_text().strip().strip('"')))
    return pids | {c for p in pids for c in children_of(p)}


def stop_processes(
    pids: Iterable[int], marker: str, root: Path, grace_s: float = STOP_GRACE_S
) -> list[int]:
    """SIGTERM each of ``pids`` that is ours (resumed first: a paused VM cannot stop), wait
    up to ``grace_s`` for all, then SIGKILL the rest. Returns the pids that were signalled."""
    ours = [p for p in set(pids) if is_ours(p, marker, root)]
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pid in ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while any(running(p) for p in ours) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in ours:
        if is_ours(pid, marker, root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return ours


def reap(folder: Path, marker: str) -> list[int]:
    """Stop every process of ours that a pid file under ``folder`` names."""
    return stop_processes(pids_under(folder), marker, folder) if folder.is_dir() else []


def start_reaper(folder: Path, marker: str) -> subprocess.Popen[bytes]:
    """Start the reaper for ``folder``; it acts once the returned process's stdin closes,
    i.e. once this process has ended (the pipe is not inherited by anything we start)."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), str(folder), marker],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a Ctrl-C to pytest's process group does not reach it.
        start_new_session=True,
    )


class PrivateServers:
    """One pytest run's folder for private servers, its marker, and its safety nets.

    ``watch`` is the run's whole temporary folder (pytest's basetemp): every ``*.pid`` file
    under it names a process the safety nets stop, the worker processes tests start included
    (``tests/integration/processes.py`` writes one beside each worker's log); ``root`` is
    the folder the servers themselves live in.
    """

    def __init__(self, watch: Path, root: Path, run_id: str) -> None:
        self.watch = watch
        self.root = root
        self.run_id = run_id
        self.marker = f"{RUN_ENV}={run_id}"
        self._reaper: subprocess.Popen[bytes] | None = None

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for a process we start: ours, the run marker, ``extra``."""
        return {**os.environ, RUN_ENV: self.run_id, **extra}

    def folder(self, name: str) -> Path:
        """A new folder under the run's root (``name``, ``name-1``, ...)."""
        path, n = self.root / name, 0
        while path.exists():
            n += 1
            path = self.root / f"{name}-{n}"
        path.mkdir(parents=True)
        return path

    def open(self) -> None:
        # Every process started from now on carries the marker, worker processes included.
        os.environ[RUN_ENV] = self.run_id
        self._reaper = start_reaper(self.watch, self.marker)
        atexit.register(self.reap)

    def reap(self) -> list[int]:
        return reap(self.watch, self.marker)

    def stop(self, pids: Iterable[int]) -> list[int]:
        """Stop those of ``pids`` that are this run's (see ``stop_processes``)."""
        return stop_processes(pids, self.marker, self.watch)

    def close(self) -> None:
        """Stop anything still running; the reaper then finds nothing and exits."""
        self.reap()
        atexit.unregister(self.reap)
        os.environ.pop(RUN_ENV, None)
        if self._reaper is not None and self._reaper.stdin is not None:
            self._reaper.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=10)


class PrivateRedis:
    """A redis-server of one test's own on a unix socket in ``folder``: stopped and started
    at will (the socket path, and so the URL, stay the same), never the shared 6379.

    ``appendonly``: it keeps an append-only file in ``folder`` (fsync every second, and on a
    clean stop), so what it acknowledged survives its restart; without, it keeps nothing.
    ``password``: it requires it (``requirepass``), and its URL carries it.
    """

    def __init__(
        self,
        servers: PrivateServers,
        folder: Path,
        *,
        appendonly: bool = False,
        password: str | None = None,
    ) -> None:
        self.servers = servers
        self.folder = folder
        self.appendonly = appendonly
        self.socket = folder / "redis.sock"
        self.password = password  # requirepass, when set (and in the URL)
        auth = f":{password}@" if password else ""
        self.url = f"unix://{auth}{self.socket}?db=0"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 20.0) -> float:
        """Start it and wait until it answers PING; returns the seconds that took."""
        started = time.perf_counter()
        args = ["redis-server", "--port", "0", "--unixsocket", str(self.socket)]
        args += ["--unixsocketperm", "700", "--save", ""]
        args += ["--appendonly", "yes" if self.appendonly else "no"]
        args += ["--dir", str(self.folder)]
        if self.password:
            args += ["--requirepass", self.password]
        with (self.folder / "redis.log").open("ab") as log:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=self.servers.env(),
                cwd=self.folder,
            )
        (self.folder / "redis.pid").write_text(str(self._proc.pid))
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"private redis-server did not start; see {self.folder}")
            time.sleep(0.02)
        return time.perf_counter() - started

    def stop(self) -> None:
        """Stop it (SIGTERM, by pid) and wait until it has exited."""
        if self._proc is None:
            return
        # Our own child, not yet reaped: its pid cannot belong to anyone else.
        with contextlib.suppress(ProcessLookupError):
            self._proc.terminate()
        try:
            self._proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None
        (self.folder / "redis.pid").unlink(missing_ok=True)

    def answers(self) -> bool:
        import redis  # only here: the reaper script must run on the standard library alone

        return pings(
            redis.Redis(
                unix_socket_path=str(self.socket),
                password=self.password,
                socket_connect_timeout=1,
            )
        )


def pings(client: Any) -> bool:
    """Whether the (synchronous) redis ``client`` answers PING; it is closed either way."""
    import redis  # only here: the reaper script must run on the standard library alone

    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def free_port(*, bus_offset: int = 0) -> int:
    """A TCP port free on 127.0.0.1 just now (and ``port + bus_offset`` too, the cluster bus
    of a Redis Cluster node); the server that takes it may still lose a race for it."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if not bus_offset:
            return port
        if port + bus_offset < 65536:
            with socket.socket() as bus, contextlib.suppress(OSError):
                bus.bind(("127.0.0.1", port + bus_offset))
                return port


class TcpRedis:
    """A redis-server (or Sentinel) of one test's own on 127.0.0.1 at a free port, its config,
    data and log in ``folder``. Started with ``set-proc-title no`` so its command line keeps
    the run's folder and its environment the run marker: the safety nets know it as ours."""

    def __init__(
        self, servers: PrivateServers, folder: Path, config: list[str], *, sentinel: bool = False
    ) -> None:
        self.servers = servers
        self.folder = folder
        self.port = free_port(bus_offset=10000 if "cluster-enabled yes" in config else 0)
        self.sentinel = sentinel
        self.config = [
            f"port {self.port}",
            "bind 127.0.0.1",
            "protected-mode no",
            "set-proc-title no",
            f'dir "{folder}"',
            f'logfile "{folder / "redis.log"}"',
            *config,
        ]
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        conf = self.folder / "redis.conf"
        conf.write_text("\n".join(self.config) + "\n")
        args = ["redis-server", str(conf)] + (["--sentinel"] if self.sentinel else [])
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.servers.env(),
            cwd=self.folder,
        )
        (self.folder / "redis.pid").write_text(str(self._proc.pid))

    def wait_answering(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"private redis-server exited; see {self.folder}/redis.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"private redis-server did not answer; see {self.folder}")
            time.sleep(0.02)

    def kill9(self) -> None:
        """SIGKILL, by pid (our own child), and reap it."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None
            (self.folder / "redis.pid").unlink(missing_ok=True)

    def stop(self) -> None:
        if self._proc is not None:
            self.servers.stop([self._proc.pid])
            self._proc.wait(timeout=10)
            self._proc = None
            (self.folder / "redis.pid").unlink(missing_ok=True)

    def client(self) -> Any:
        import redis  # only here: the reaper script must run on the standard library alone

        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=5, decode_responses=True
        )

    def answers(self) -> bool:
        return pings(self.client())


def _subfolder(folder: Path, name: str) -> Path:
    path = folder / name
    path.mkdir(parents=True)
    return path


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``check`` (a blocking probe of our servers) until true, or raise saying ``what``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


class PrivateRedisCluster:
    """A Redis Cluster of ``primaries`` nodes, no replicas, made with ``redis-cli --cluster
    create``; every node in its own folder under ``folder``."""

    def __init__(self, servers: PrivateServers, folder: Path, primaries: int = 3) -> None:
        self.nodes = [
            TcpRedis(
                servers,
                _subfolder(folder, f"node{n}"),
                ["cluster-enabled yes", "cluster-node-timeout 2000", 'save ""', "appendonly no"],
            )
            for n in range(primaries)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> None:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.wait_answering()
        create = ["redis-cli", "--cluster", "create", *(n.address for n in self.nodes)]
        done = subprocess.run(
            [*create, "--cluster-yes"], capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")

        def every_node_serves_every_slot() -> bool:
            for node in self.nodes:
                client = node.client()
                try:
                    info = client.cluster("info")
                finally:
                    client.close()
                if info.get("cluster_state") != "ok" or int(info["cluster_known_nodes"]) != len(
                    self.nodes
                ):
                    return False
            return True

        wait_for(every_node_serves_every_slot, timeout_s, "the private Redis Cluster to form")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class PrivateSentinelSet:
    """A primary, a replica of it and ``sentinels`` Sentinels watching it under ``SERVICE``
    (quorum: a majority), failing over a primary that stopped answering for ``down_after_ms``."""

    SERVICE = "weclaw"

    def __init__(
        self, servers: PrivateServers, folder: Path, sentinels: int = 3, down_after_ms: int = 1000
    ) -> None:
        data = ['save ""', "appendonly no"]
        self.primary = TcpRedis(servers, _subfolder(folder, "primary"), data)
        self.replica = TcpRedis(
            servers,
            _subfolder(folder, "replica"),
            [*data, f"replicaof 127.0.0.1 {self.primary.port}"],
        )
        self.down_after_ms = down_after_ms
        watch = [
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary.port} {sentinels // 2 + 1}",
            f"sentinel down-after-milliseconds {self.SERVICE} {down_after_ms}",
            f"sentinel failover-timeout {self.SERVICE} 10000",
            f"sentinel parallel-syncs {self.SERVICE} 1",
        ]
        self.sentinels = [
            TcpRedis(servers, _subfolder(folder, f"sentinel{n}"), watch, sentinel=True)
            for n in range(sentinels)
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(s.address for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.SERVICE}"

    def primary_port(self, sentinel: TcpRedis) -> int | None:
        """The primary's port as ``sentinel`` names it now (None if it cannot say)."""
        import redis

        client = sentinel.client()
        try:
            answer = client.execute_command("SENTINEL", "get-master-addr-by-name", self.SERVICE)
        except redis.RedisError:
            return None
        finally:
            client.close()
        return int(answer[1]) if answer else None

    def start(self, timeout_s: float = 30.0) -> None:
        for server in (self.primary, self.replica):
            server.start()
            server.wait_answering()

        def replica_in_sync() -> bool:
            client = self.replica.client()
            try:
                return bool(client.info("replication").get("master_link_status") == "up")
            finally:
                client.close()

        wait_for(replica_in_sync, timeout_s, "the replica to sync with the primary")
        for sentinel in self.sentinels:
            sentinel.start()
        for sentinel in self.sentinels:
            sentinel.wait_answering()

        def ready_to_fail_over() -> bool:
            # A failover needs each Sentinel to know the replica and its peers (they meet
            # through hello messages every 2 s).
            for sentinel in self.sentinels:
                client = sentinel.client()
                try:
                    fields = client.sentinel_master(self.SERVICE)
                finally:
                    client.close()
                if (
                    int(fields["num-slaves"]) < 1
                    or int(fields["num-other-sentinels"]) < len(self.sentinels) - 1
                ):
                    return False
            return True

        wait_for(ready_to_fail_over, timeout_s, "the Sentinels to know the replica and each other")

    def stop(self) -> None:
        for server in (*self.sentinels, self.replica, self.primary):
            server.stop()


def _reaper_main(folder: Path, marker: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.stdin.buffer.read()  # returns at EOF: pytest has exited
    reap(folder, marker)
    # A node launched in the very moment pytest died writes its pid file a little later.
    time.sleep(3)
    reap(folder, marker)


if __name__ == "__main__":
    _reaper_main(Path(sys.argv[1]), sys.argv[2])

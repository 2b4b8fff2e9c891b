"""Where a measured window's CPU went on this machine: the broker, Redis, and all of it.

A multi-process worker can only scale into cores nobody else uses. On a small machine the
broker and Redis run beside the worker, so the benchmark samples, around each consume window,
the CPU time of the processes listening on the broker's and Redis's ports (found through
``/proc/net/tcp*`` and each process's socket inodes) and the machine's busy time
(``/proc/stat``), all as cores used on average over the window. Linux only; elsewhere (or when a
port's owner cannot be seen) the affected figures are left out, never guessed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
TCP_LISTEN = "0A"


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` (IPv4 or IPv6)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def pid_listening_on(port: int) -> int | None:
    """The pid of the process listening on ``port``, or None when it cannot be seen."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not wanted:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return None


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (threads included)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces: fields are counted after its closing parenthesis.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_busy_s() -> float | None:
    """CPU seconds all cores spent not idle (idle and iowait excluded) since boot."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    ticks = [int(v) for v in first[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    # guest time is already counted in user/nice
    return (sum(ticks[:8]) - idle) / CLOCK_TICKS


def port_of(url: str, default: int) -> int:
    parsed = urlsplit(url.split(",")[0])
    return parsed.port or default


@dataclass
class _Mark:
    at: float
    busy: float | None
    broker: float | None
    redis: float | None


class CpuWindow:
    """Cores used by the broker, Redis and the whole machine between ``start`` and ``stop``."""

    def __init__(self, amqp_url: str, redis_url: str) -> None:
        self.broker_pid = pid_listening_on(port_of(amqp_url, 5672))
        self.redis_pid = pid_listening_on(port_of(redis_url, 6379))
        self._start: _Mark | None = None

    def _mark(self) -> _Mark:
        return _Mark(
            time.monotonic(),
            machine_busy_s(),
            process_cpu_s(self.broker_pid) if self.broker_pid else None,
            process_cpu_s(self.redis_pid) if self.redis_pid else None,
        )

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> dict[str, float]:
        """Average cores used over the window: ``machine_cores``, ``broker_cores``,
        ``redis_cores`` (each only when it could be read at both ends)."""
        if self._start is None:
            return {}
        begin, end = self._start, self._mark()
        self._start = None
        elapsed = end.at - begin.at
        if elapsed <= 0:
            return {}
        out: dict[str, float] = {}
        for name in ("busy", "broker", "redis"):
            a, b = getattr(begin, name), getattr(end, name)
            if a is not None and b is not None:
                out["machine_cores" if name == "busy" else f"{name}_cores"] = (b - a) / elapsed
        return out

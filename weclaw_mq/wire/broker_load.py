"""What the broker carries: its file-handle and memory use against their limits.

AMQP 0-9-1 says none of it: the server properties of ``connection.start`` name the product,
version and capabilities, and ``connection.blocked`` arrives only once a memory or disk alarm
already blocks publishers; a file-handle shortage has no notification at all (new
connections just hang in the handshake). The numbers are in the management plugin's HTTP
API (not always enabled, and a second set of credentials) and in ``rabbitmqctl status``. We
read them with ``rabbitmqctl`` only where it can work without further set-up: the broker
runs on this machine (the AMQP URL names a loopback host) and ``rabbitmqctl`` is on PATH.
Elsewhere we say, in one line, that they cannot be read and where to look.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from urllib.parse import urlsplit

# Past this share of a limit, a worker warns at start.
NEAR_LIMIT = 0.9
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
_TIMEOUT_S = 15.0

BROKER_LOAD_UNREADABLE = (
    "broker file handles and memory: not readable from here (AMQP does not carry them; "
    "rabbitmqctl works only beside a local broker): check 'rabbitmq-diagnostics status' "
    "(File Descriptors, Memory); each quorum queue holds about 3 file handles"
)


@dataclass(frozen=True)
class BrokerLoad:
    handles_used: int
    handles_limit: int
    memory_used: int
    memory_limit: int

    def summary(self) -> str:
        return (
            f"broker file handles: {self.handles_used} of {self.handles_limit} in use; "
            f"memory: {self.memory_used // 2**20} MiB of its {self.memory_limit // 2**20} MiB "
            "high watermark"
        )

    def warning(self) -> str | None:
        """One line naming what to raise when a use is within 10 % of its limit, else None."""
        near = []
        if self.handles_limit and self.handles_used >= NEAR_LIMIT * self.handles_limit:
            near.append(
                f"file handles {self.handles_used} of {self.handles_limit}: raise the broker's "
                "'ulimit -n' (e.g. LimitNOFILE=65536 in its systemd unit), or delete unused "
                "queues; past the limit it accepts no new connection"
            )
        if self.memory_limit and self.memory_used >= NEAR_LIMIT * self.memory_limit:
            near.append(
                f"memory {self.memory_used // 2**20} of {self.memory_limit // 2**20} MiB: raise "
                "vm_memory_high_watermark or the broker's RAM; past it publishers are blocked"
            )
        if not near:
            return None
        return "the broker is within 10 % of its limits: " + "; ".join(near)


def parse_status(text: str) -> BrokerLoad | None:
    """A load from ``rabbitmqctl status --formatter json``; None when it does not say."""
    try:
        status = json.loads(text)
        handles = status["file_descriptors"]
        memory = status["memory"]
        total = memory.get("total", memory)
        # The broker's own reading (its vm_memory_calculation_strategy) is "rss" by default.
        used = total.get("rss") or total["allocated"] if isinstance(total, dict) else total
        return BrokerLoad(
            handles_used=int(handles["total_used"]),
            handles_limit=int(handles["total_limit"]),
            memory_used=int(used),
            memory_limit=int(status["vm_memory_high_watermark_limit"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_broker_load(amqp_url: str, *, node: str | None = None) -> BrokerLoad | None:
    """The load of the broker ``amqp_url`` names, when it runs here and ``rabbitmqctl`` can
    ask it (``node``: its node name, else rabbitmqctl's default); None otherwise. Blocks up
    to about 15 s: run it off the event loop."""
    host = urlsplit(amqp_url).hostname or "localhost"
    ctl = shutil.which("rabbitmqctl")
    if host not in _LOOPBACK or ctl is None:
        return None
    command = [ctl, *(("-n", node) if node else ()), "-q", "status", "--formatter", "json"]
    nice = shutil.which("nice")
    if nice is not None:  # an Erlang VM's start: it must not take the CPU from the worker
        command = [nice, "-n", "19", *command]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_status(done.stdout) if done.returncode == 0 else None

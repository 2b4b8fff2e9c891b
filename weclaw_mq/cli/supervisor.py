"""``weclaw-mq worker --processes N``: N worker processes under one supervisor.

One event loop saturates one core long before the broker or Redis do, so a machine with more
cores runs more worker processes. The supervisor itself imports no app and opens no connection:
it starts ``weclaw-mq worker ... --processes 1`` N times and watches them.

- SIGTERM or SIGINT is forwarded to every child, each drains as a single worker does (in-flight
  tasks get the shutdown grace, then give their messages back), and the supervisor exits once
  all have ended: 0 if every child stopped cleanly.
- A child that dies while nobody asked it to stop is started again after a backoff (1 s,
  doubling, at most ``MAX_BACKOFF_S``). Its messages went back to the queue when its connection
  closed, so nothing is lost; the guard absorbs the duplicate runs.
- A child that exits with a usage or configuration error (exit 2 or 3: a bad app path, a bad
  setting) would fail the same way again: the supervisor stops the others and exits with that
  code and the child's error line. So does a child that keeps dying (more than
  ``MAX_DEATHS`` deaths within ``DEATH_WINDOW_S``), with exit 1.
- If the supervisor itself is killed, the kernel sends each child SIGTERM (Linux's parent-death
  signal), so no worker is left orphaned: they drain and exit.
- Metrics: child i (0-based) serves on the metrics port + i, when a port is set.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

from .failures import ExitCode
from .run_worker import STOP_SIGNALS

log = logging.getLogger("weclaw_mq.supervisor")

# Restarts back off from 1 s, doubling up to this, so a crash loop neither spins nor waits long.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# "Keeps dying": more deaths than this within the window ends the supervisor.
MAX_DEATHS = 5
DEATH_WINDOW_S = 60.0
# How often the supervisor looks at its children; a restart is at most this late.
POLL_S = 0.1
# A child's exit codes that a restart cannot cure.
FATAL_EXIT_CODES = frozenset({ExitCode.USAGE, ExitCode.CONFIG})
# Lines of a child's stderr kept for the supervisor's error message.
TAIL_LINES = 20
ERROR_PREFIX = "weclaw-mq: error: "

PR_SET_PDEATHSIG = 1


class SupervisorError(Exception):
    """The supervisor gave up; ``exit_code`` is what the command exits with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def parse_processes(value: str) -> int:
    """``auto`` (the cores this process may run on) or a whole number of at least 1."""
    text = value.strip().lower()
    if text == "auto":
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of processes or 'auto'") from None
    if count < 1:
        raise ValueError(f"{value!r}: at least 1 process")
    return count


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel for SIGTERM when the supervisor
    # dies, however it dies (SIGKILL included). Not available off Linux: then nothing is asked.
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class _Child:
    index: int
    popen: subprocess.Popen[bytes] | None = None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    restart_at: float | None = None
    backoff_s: float = FIRST_BACKOFF_S
    deaths: collections.deque[float] = field(default_factory=collections.deque)

    def error_line(self) -> str:
        for line in reversed(self.tail):
            if line.startswith(ERROR_PREFIX):
                return line[len(ERROR_PREFIX) :]
        return self.tail[-1] if self.tail else "no output"


class Supervisor:
    """Runs ``command(i)`` for i in 0..processes-1 and keeps them running until a stop signal."""

    def __init__(
        self,
        command: Callable[[int], Sequence[str]],
        processes: int,
        *,
        stderr: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_backoff_s: float = FIRST_BACKOFF_S,
    ) -> None:
        self.command = command
        self.children = [_Child(i, backoff_s=first_backoff_s) for i in range(processes)]
        self.stderr = stderr if stderr is not None else sys.stderr
        self.clock = clock
        self.stopping = threading.Event()
        self._write_lock = threading.Lock()

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            for child in self.children:
                self._start(child)
            return self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A second signal is forwarded too: each child then ends at once, as a lone worker does.
        self.stopping.set()
        self._signal_all(signal.Signals(signum))

    def _signal_all(self, sig: signal.Signals) -> None:
        for child in self.children:
            if child.popen is not None and child.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(sig)

    def _start(self, child: _Child) -> None:
        child.restart_at = None
        child.popen = subprocess.Popen(
            list(self.command(child.index)),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        log.info("worker process %d started (pid %d)", child.index, child.popen.pid)
        assert child.popen.stderr is not None
        threading.Thread(
            target=self._forward, args=(child, child.popen.stderr), daemon=True
        ).start()

    def _forward(self, child: _Child, stream: IO[bytes]) -> None:
        """Copies a child's stderr (its log) to ours, keeping its last lines for errors."""
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            child.tail.append(line)
            with self._write_lock, contextlib.suppress(OSError, ValueError):
                self.stderr.write(line + "\n")
                self.stderr.flush()

    def _watch(self) -> int:
        while True:
            running = 0
            for child in self.children:
                running += self._look_at(child)
            if self.stopping.is_set() and running == 0:
                failed = [c for c in self.children if c.popen is not None and c.popen.returncode]
                return ExitCode.FAILED if failed else ExitCode.OK
            time.sleep(POLL_S)  # a signal interrupts it: its handler runs at once

    def _look_at(self, child: _Child) -> int:
        """1 if ``child`` is running (or due to be started again), else 0."""
        popen = child.popen
        if popen is None:
            return 0
        code = popen.poll()
        if code is None:
            return 1
        if self.stopping.is_set():
            return 0
        if child.restart_at is None:
            self._died(child, code)
        if self.clock() >= (child.restart_at or 0.0):
            self._start(child)
        return 1

    def _died(self, child: _Child, code: int) -> None:
        now = self.clock()
        why = child.error_line()
        if code in FATAL_EXIT_CODES:
            self._give_up(f"worker process {child.index} failed (exit {code}): {why}", code)
        child.deaths.append(now)
        while child.deaths and now - child.deaths[0] > DEATH_WINDOW_S:
            child.deaths.popleft()
        if len(child.deaths) > MAX_DEATHS:
            self._give_up(
                f"worker process {child.index} died {len(child.deaths)} times in "
                f"{DEATH_WINDOW_S:.0f} s (last exit {code}): {why}",
                ExitCode.FAILED,
            )
        log.warning(
            "worker process %d died (exit %d); starting it again in %.0f s",
            child.index,
            code,
            child.backoff_s,
        )
        child.restart_at = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)

    def _give_up(self, message: str, exit_code: int) -> None:
        self.stopping.set()
        self._signal_all(signal.SIGTERM)
        for child in self.children:
            if child.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.popen.wait(timeout=60)
        raise SupervisorError(message, exit_code)


def child_command(
    app_path: str,
    *,
    concurrency: int | None,
    queues: Sequence[str] | None,
    metrics_port: int | None,
    log_level: str,
    log_format: str = "text",
    loop: str | None = None,
) -> Callable[[int], list[str]]:
    """The ``weclaw-mq worker`` command line of child ``i`` (same interpreter, same options)."""

    def command(index: int) -> list[str]:
        args = [sys.executable, "-m", "weclaw_mq.cli", "worker", app_path, "--processes", "1"]
        args += ["--log-level", log_level, "--log-format", log_format]
        if concurrency is not None:
            args += ["--concurrency", str(concurrency)]
        for queue in queues or ():
            args += ["--queue", queue]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port + index)]
        if loop is not None:
            args += ["--loop", loop]
        return args

    return command

"""``weclaw-mq worker --processes N``: N worker processes under one supervisor.

One event loop saturates one core long before the broker or Redis do, so a machine with more
cores runs more worker processes. The supervisor loads the app once (its imports done, and
what a worker will import lazily: ``run_worker.preload``), then forks the N children before
any event loop, connection, thread or Redis client exists: each child starts from the loaded
app and opens its own connections, as a single worker does. A fresh interpreter per child
imported everything again, which `make bench-start` measures.

- SIGTERM or SIGINT is forwarded to every child, each drains as a single worker does (in-flight
  tasks get the shutdown grace, then give their messages back), and the supervisor exits once
  all have ended: 0 if every child stopped cleanly.
- A child that dies while nobody asked it to stop is forked again after a backoff (1 s,
  doubling, at most ``MAX_BACKOFF_S``), from the supervisor, which still holds the loaded app
  and nothing else. Its messages went back to the queue when its connection closed, so
  nothing is lost; the guard absorbs the duplicate runs.
- A child that exits with a usage or configuration error (exit 2 or 3: a bad setting) would
  fail the same way again: the supervisor stops the others and exits with that code and the
  child's error line. So does a child that keeps dying (more than ``MAX_DEATHS`` deaths
  within ``DEATH_WINDOW_S``), with exit 1.
- If the supervisor itself is killed, the kernel sends each child SIGTERM (Linux's parent-death
  signal), so no worker is left orphaned: they drain and exit.
- Metrics: child i (0-based) serves on the metrics port + i, when a port is set.
- Each child's stderr (its log) is a pipe the supervisor copies to its own stderr, keeping the
  last lines for its error message; read in the supervisor's one thread (a selector), since a
  fork must not happen while another thread may hold a lock the child would need.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Protocol

from weclaw_mq.cli.exit_codes import ExitCode
from weclaw_mq.cli.run_worker import STOP_SIGNALS

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


def die_with_parent() -> None:
    """Ask the kernel for SIGTERM when this process's parent (the supervisor, the reloader)
    dies, however it dies (SIGKILL included); a child's first step. Not available off Linux:
    then nothing is asked."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess(Protocol):
    """A running child as the supervisor watches it: a pid, its exit, its stderr pipe."""

    pid: int

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


# Starts child ``i``: its process, and the read end of its stderr pipe.
Launcher = Callable[[int, Sequence[int]], tuple[ChildProcess, int]]


def spawning(command: Callable[[int], Sequence[str]]) -> Launcher:
    """Children that run ``command(i)``, a program of their own (the tests' crash loops)."""

    def launch(index: int, inherited: Sequence[int]) -> tuple[ChildProcess, int]:
        popen = subprocess.Popen(
            list(command(index)),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        assert popen.stderr is not None
        fd = os.dup(popen.stderr.fileno())  # read unbuffered, as a forked child's pipe is
        popen.stderr.close()
        return popen, fd

    return launch


def forking(run: Callable[[int], int]) -> Launcher:
    """Children forked from this process that call ``run(i)`` and exit with what it returns.

    Fork before any event loop, connection or thread exists here: the child has only what
    was imported and built, and ``run`` opens its own connections."""

    def launch(index: int, inherited: Sequence[int]) -> tuple[ChildProcess, int]:
        # Nothing buffered in this process may be written a second time by the child.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid:  # a signal that came meanwhile reaches our handler now
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        else:  # the child: never returns into the supervisor's frames
            code: int = ExitCode.FAILED
            try:
                _become_child(parent, read_fd, write_fd, inherited)
                code = run(index)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else ExitCode.FAILED
            except BaseException:
                traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                logging.shutdown()
                os._exit(int(code))
        os.close(write_fd)
        return _Forked(pid), read_fd

    return launch


def _become_child(parent: int, read_fd: int, write_fd: int, inherited: Sequence[int]) -> None:
    """A forked child's first steps: its own signal handling, the parent-death signal, its
    stderr into its pipe, no stdin, and none of the supervisor's pipes of other children."""
    # A fresh interpreter's handlers, not the supervisor's (which signal the children). The
    # stop signals stay blocked (since before the fork) until the worker's own handlers are
    # in place (run_worker): one sent meanwhile then stops it cleanly, never mid-start.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent()
    if os.getppid() != parent:  # the supervisor died before the kernel was asked
        os._exit(ExitCode.FAILED)
    os.close(read_fd)
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


class _Forked:
    """A forked child, with ``subprocess.Popen``'s ``poll``, ``send_signal`` and ``wait``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already (cannot happen: ours alone)
                self.returncode = ExitCode.FAILED
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(POLL_S / 10)
        return code


@dataclass
class _Child:
    index: int
    process: ChildProcess | None = None
    stderr_fd: int | None = None  # the read end of its stderr pipe, until its EOF
    partial: bytes = b""  # the start of a line not ended yet
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
    """Starts child i for i in 0..processes-1 with ``launch`` and keeps them running until a
    stop signal."""

    def __init__(
        self,
        launch: Launcher,
        processes: int,
        *,
        stderr: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_backoff_s: float = FIRST_BACKOFF_S,
    ) -> None:
        self.launch = launch
        self.children = [_Child(i, backoff_s=first_backoff_s) for i in range(processes)]
        self.stderr = stderr if stderr is not None else sys.stderr
        self.clock = clock
        self.stopping = False
        self._selector = selectors.DefaultSelector()

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            for child in self.children:
                self._start(child)
            return self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for child in self.children:
                self._close_output(child)
            self._selector.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A second signal is forwarded too: each child then ends at once, as a lone worker does.
        self.stopping = True
        self._signal_all(signal.Signals(signum))

    def _signal_all(self, sig: signal.Signals) -> None:
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(sig)

    def _start(self, child: _Child) -> None:
        child.restart_at = None
        self._close_output(child)
        # Ours alone: a child holds none of the other children's pipes, nor our selector.
        inherited = [c.stderr_fd for c in self.children if c.stderr_fd is not None]
        inherited.append(self._selector.fileno())
        child.process, fd = self.launch(child.index, inherited)
        os.set_blocking(fd, False)
        child.stderr_fd = fd
        self._selector.register(fd, selectors.EVENT_READ, child)
        log.info("worker process %d started (pid %d)", child.index, child.process.pid)

    def _read_output(self, timeout_s: float) -> None:
        """Copies what the children wrote to their stderr (their log) to ours, waiting up to
        ``timeout_s`` for some; a signal cuts the wait short (its handler runs at once)."""
        if not self._selector.get_map():
            time.sleep(timeout_s)
            return
        for key, _ in self._selector.select(timeout_s):
            self._drain(key.data)

    def _drain(self, child: _Child) -> None:
        """Reads what ``child``'s pipe holds now, without waiting."""
        while child.stderr_fd is not None:
            try:
                data = os.read(child.stderr_fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # EOF: the child (and whatever shared its stderr) ended
                self._close_output(child)
                return
            self._copy(child, data)

    def _copy(self, child: _Child, data: bytes) -> None:
        *lines, child.partial = (child.partial + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            child.tail.append(line)
            with contextlib.suppress(OSError, ValueError):
                self.stderr.write(line + "\n")
        with contextlib.suppress(OSError, ValueError):
            self.stderr.flush()

    def _close_output(self, child: _Child) -> None:
        fd, child.stderr_fd = child.stderr_fd, None
        if fd is None:
            return
        if child.partial:
            self._copy(child, b"\n")
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)
        os.close(fd)

    def _watch(self) -> int:
        while True:
            running = 0
            for child in self.children:
                running += self._look_at(child)
            if self.stopping and running == 0:
                failed = [c for c in self.children if c.process is not None and c.process.poll()]
                return ExitCode.FAILED if failed else ExitCode.OK
            self._read_output(POLL_S)

    def _look_at(self, child: _Child) -> int:
        """1 if ``child`` is running (or due to be started again), else 0."""
        process = child.process
        if process is None:
            return 0
        code = process.poll()
        if code is None:
            return 1
        # Its last lines (its error) are in the pipe already: read them before deciding.
        self._drain(child)
        if self.stopping:
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
        self.stopping = True
        self._signal_all(signal.SIGTERM)
        end = time.monotonic() + 60
        for child in self.children:
            while child.process is not None and child.process.poll() is None:
                if time.monotonic() >= end:
                    break
                self._read_output(POLL_S)  # their last lines still reach our stderr
            self._drain(child)
        raise SupervisorError(message, exit_code)

"""``weclaw-mq worker MODULE:APP --reload``: for development, the worker restarts on an edit.

The reloader never imports the app. It runs the worker in a child process (a fresh
interpreter running ``weclaw-mq worker`` with the same options, less ``--reload``), watches
``*.py`` files with watchfiles, and on a change restarts the child:

- The child gets SIGTERM and stops as any SIGTERM'd worker does: no new deliveries, in-flight
  tasks finish within ``shutdown_grace_s`` or go back to the broker. The reloader waits for it
  up to that grace + ``HARD_EXIT_MARGIN_S`` (the child's own bound) + ``STOP_SLACK_S``, then
  SIGKILLs it (the broker requeues what it held). Only then does the next child start, with
  the code as it is on disk now; changes seen meanwhile are in it already.
- A child that fails (an import error in the edit, a broker away) prints its error as the CLI
  does and exits; the reloader says it waits, and starts one again on the next change.
- Watched: the ``--reload-dir`` folders, else the current folder and the one that holds the
  app's top-level package or module (found without importing it; not when it is installed in
  site-packages). Changes to files other than ``*.py``, under a hidden folder (``.venv``,
  ``.git``...) or under ``__pycache__`` (watchfiles' ``DefaultFilter``) are ignored.
- SIGTERM or SIGINT to the reloader stops the child as above and then the reloader; a second
  one is passed on, and the child ends at once as a lone worker does. The child runs in a
  process group of its own, so a Ctrl-C at the terminal reaches it once, through the
  reloader; and the kernel sends it SIGTERM should the reloader die (the parent-death signal,
  as for the supervisor's children).

One worker process only: ``--reload`` with ``--processes`` > 1 is refused (``cli.root``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import queue
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from weclaw_mq.cli.exit_codes import ExitCode
from weclaw_mq.cli.run_worker import HARD_EXIT_MARGIN_S, STOP_SIGNALS
from weclaw_mq.cli.supervisor import die_with_parent
from weclaw_mq.errors import ConfigurationError

log = logging.getLogger("weclaw_mq.reloader")

HOW_TO_GET_WATCHFILES = "pip install 'weclaw_mq[reload]'"
# A save is several file events (write, close, an editor's rename): they are one change once
# no new one came for STEP_MS, and at most DEBOUNCE_MS after the first.
STEP_MS = 50
DEBOUNCE_MS = 500
# How often the reloader looks at its child when nothing happens.
POLL_S = 0.1
# Past the child's own bound, before the reloader kills it.
STOP_SLACK_S = 5.0
# Paths named in the "changed" line; the rest are counted.
SHOWN_PATHS = 3
# A restarted worker does not read the broker's load again (the first one did): rabbitmqctl
# costs about a second of CPU per edit, and a stop waits for it to end.
RESTART_ENV = {"WECLAW_MQ_BROKER_LOAD_CHECK": "false"}

# The child's program: the parent-death signal first, then the CLI. (Not a ``preexec_fn``,
# which is unsafe in a process with threads: the watcher has one.)
_CHILD_CODE = (
    "import sys; from weclaw_mq.cli.reloader import become_child; become_child(sys.argv[1]); "
    "from weclaw_mq.cli import main; main(sys.argv[2:])"
)


def child_command(worker_args: Sequence[str]) -> list[str]:
    """``weclaw-mq worker WORKER_ARGS`` in this interpreter, as a child of this process."""
    return [sys.executable, "-c", _CHILD_CODE, str(os.getpid()), "worker", *worker_args]


def become_child(parent: str) -> None:
    """A child's first step (``_CHILD_CODE``): SIGTERM when the reloader ``parent`` dies."""
    die_with_parent()
    if os.getppid() != int(parent):  # the reloader died before the kernel was asked
        sys.exit(ExitCode.FAILED)


def watched_dirs(module_name: str, given: Sequence[Path], cwd: Path) -> list[Path]:
    """The folders to watch: ``given``, else ``cwd`` and the folder of ``module_name``'s
    top-level package (or module) when it lies outside ``cwd`` and is not installed; a
    folder inside another one listed is left out (the outer one covers it)."""
    if given:
        return _outermost(path.resolve() for path in given)
    return _outermost([cwd.resolve(), *_module_dirs(module_name.partition(".")[0])])


def _module_dirs(top: str) -> list[Path]:
    try:  # a top-level name: finding it runs none of its code
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:  # a package (a namespace one may have several)
        places = [Path(p) for p in spec.submodule_search_locations]
    elif spec.has_location and spec.origin:
        places = [Path(spec.origin).parent]
    else:  # built in, frozen
        return []
    installed = {Path(sysconfig.get_path(name)).resolve() for name in ("purelib", "platlib")}
    return [
        place.resolve()
        for place in places
        if place.is_dir() and not any(place.resolve().is_relative_to(i) for i in installed)
    ]


def _outermost(paths: Iterable[Path]) -> list[Path]:
    unique = sorted(set(paths))
    return [p for p in unique if not any(p != q and p.is_relative_to(q) for q in unique)]


def is_source(path: str, roots: Sequence[Path]) -> bool:
    """Whether a change of ``path`` restarts the worker: a ``*.py`` file, and no folder or
    file starting with a dot on its way from the watched root that holds it."""
    if not path.endswith(".py"):
        return False
    file = Path(path)
    for root in roots:
        if file.is_relative_to(root):
            return not any(part.startswith(".") for part in file.relative_to(root).parts)
    return True


def describe(paths: Sequence[str], cwd: Path) -> str:
    """``a.py, pkg/b.py (+2 more)``: the changed files, relative to ``cwd`` when inside it."""
    shown = []
    for path in paths[:SHOWN_PATHS]:
        file = Path(path)
        shown.append(str(file.relative_to(cwd)) if file.is_relative_to(cwd) else path)
    more = len(paths) - SHOWN_PATHS
    return ", ".join(shown) + (f" (+{more} more)" if more > 0 else "")


# What the reloader's main loop is told, in order: by the watcher's thread or a signal.
@dataclass(frozen=True)
class _Changed:
    paths: tuple[str, ...]


@dataclass(frozen=True)
class _Signalled:
    signum: int


@dataclass(frozen=True)
class _WatchFailed:
    error: BaseException


_Event = _Changed | _Signalled | _WatchFailed


class _Watcher:
    """watchfiles on a thread of its own: each batch of changed sources, or its error, goes to
    ``events``. ``rust_timeout=0``: watchfiles forgets changes that arrive as a wait times
    out, so the wait never does; ``stop_event`` ends it (watchfiles asks every ``STEP_MS``)."""

    def __init__(
        self, dirs: Sequence[Path], events: queue.SimpleQueue[_Event], ready: threading.Event
    ) -> None:
        self.dirs = dirs
        self.events = events
        self.stop = threading.Event()
        self.ready = ready
        self.thread = threading.Thread(target=self._run, name="weclaw-mq-reload", daemon=True)

    def is_set(self) -> bool:
        """watchfiles' stop event. Its first call means the watch is in place."""
        if not self.ready.is_set():
            self.ready.set()
            log.info(
                "--reload (for development): watching %s for changes to *.py files",
                ", ".join(map(str, self.dirs)),
            )
        return self.stop.is_set()

    def _run(self) -> None:
        try:
            import watchfiles  # here: its import (and anyio's) is on no other command's path

            logging.getLogger("watchfiles").setLevel(logging.WARNING)  # "1 change detected"
            default = watchfiles.DefaultFilter()

            def wanted(change: Any, path: str) -> bool:
                return is_source(path, self.dirs) and default(change, path)

            for changes in watchfiles.watch(
                *self.dirs,
                watch_filter=wanted,
                debounce=DEBOUNCE_MS,
                step=STEP_MS,
                stop_event=self,
                rust_timeout=0,
            ):
                self.events.put(_Changed(tuple(sorted({path for _, path in changes}))))
        except Exception as e:  # a watch limit, a folder gone: the reloader cannot go on
            self.events.put(_WatchFailed(e))

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=1.0)


def require_watchfiles() -> None:
    """The configuration error of a ``--reload`` without watchfiles, before anything starts."""
    if importlib.util.find_spec("watchfiles") is None:
        raise ConfigurationError(
            f"--reload needs watchfiles, which is not installed: {HOW_TO_GET_WATCHFILES}"
        )


def stop_bound_s(grace_s: float) -> float:
    """How long the reloader waits for a SIGTERM'd child whose shutdown grace is ``grace_s``."""
    return grace_s + HARD_EXIT_MARGIN_S + STOP_SLACK_S


class Reloader:
    """Runs ``command`` as a child process and starts it again after every change of a source
    file under ``dirs``, until a stop signal; a child told to stop gets ``stop_bound_s``."""

    def __init__(
        self, command: Sequence[str], dirs: Sequence[Path], *, stop_bound_s: float
    ) -> None:
        self.command = list(command)
        self.dirs = dirs
        self.stop_bound_s = stop_bound_s
        self.events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self.child: subprocess.Popen[bytes] | None = None  # until it has exited and been seen
        self.child_signalled = False  # that child was sent SIGTERM
        self.signals = 0
        self.starts = 0
        self.stopping = False
        self.watching = threading.Event()  # set once the watch is in place

    def run(self) -> int:
        """Until a stop signal; the exit code: the child's that was running then (0 if none)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        watcher = _Watcher(self.dirs, self.events, self.watching)
        try:
            watcher.start()
            self._start()
            while not self.stopping:
                try:
                    event = self.events.get(timeout=POLL_S)
                except queue.Empty:
                    if (code := self._exited_by_itself()) is not None:
                        log.warning(
                            "worker process exited (exit %d); waiting for a change to start "
                            "it again",
                            code,
                        )
                    continue
                if isinstance(event, _Changed):
                    self._restart(event.paths)
                else:
                    self._handle(event)
            return self._stop_child()
        finally:
            self._stop_child()  # after an error too; a no-op once stopped
            watcher.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # SimpleQueue.put may be called from a signal handler; the main loop does the rest.
        self.events.put(_Signalled(signum))

    def _handle(self, event: _Signalled | _WatchFailed) -> None:
        if isinstance(event, _WatchFailed):
            error, dirs = event.error, ", ".join(map(str, self.dirs))
            raise ConfigurationError(
                f"--reload cannot watch {dirs}: {type(error).__name__}: {error}"
            ) from error
        self.stopping = True
        self.signals += 1
        if self.signals == 1:
            self._terminate()  # a no-op while a restart stops the child already
        elif self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(event.signum)  # a second signal: it ends at once

    def _start(self) -> None:
        env = None if self.starts == 0 else {**os.environ, **RESTART_ENV}
        self.starts += 1
        self.child = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, env=env, process_group=0
        )
        self.child_signalled = False
        log.info("worker process started (pid %d)", self.child.pid)

    def _exited_by_itself(self) -> int | None:
        """The exit code of a child that ended unasked (then forgotten), else None."""
        child = self.child
        if child is None or self.child_signalled or (code := child.poll()) is None:
            return None
        self.child = None
        return code

    def _restart(self, paths: Sequence[str]) -> None:
        log.info("%s changed: restarting the worker", describe(paths, Path.cwd()))
        self._stop_child()
        # Changes seen until now are on disk: the next child reads them. Signals still count.
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            if not isinstance(event, _Changed):
                self._handle(event)
        if not self.stopping:
            self._start()

    def _terminate(self) -> None:
        child = self.child
        if child is not None and child.poll() is None and not self.child_signalled:
            self.child_signalled = True
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)

    def _stop_child(self) -> int:
        """SIGTERM to the child and its exit code, waited for up to ``stop_bound_s`` (then
        SIGKILL, and exit 1); 0 when none was running."""
        if (code := self._exited_by_itself()) is not None:
            log.warning("worker process exited (exit %d)", code)
        child = self.child
        if child is None:
            return ExitCode.OK
        self._terminate()
        deadline = time.monotonic() + self.stop_bound_s
        while child.poll() is None:
            if time.monotonic() >= deadline:
                log.error(
                    "worker process %d still running %.0f s after SIGTERM: killing it; "
                    "what it held goes back to its queues",
                    child.pid,
                    self.stop_bound_s,
                )
                child.kill()
                child.wait()
                break
            try:
                event = self.events.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if not isinstance(event, _Changed):  # a change: the next child will have it
                self._handle(event)
        self.child = None
        log.info("worker process %d stopped (exit %d)", child.pid, child.returncode)
        return child.returncode if child.returncode >= 0 else ExitCode.FAILED

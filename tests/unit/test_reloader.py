"""The reloader of ``weclaw-mq worker --reload`` (``weclaw_mq.cli.reloader``), without a broker:
which changes count, which folders are watched, the child's command line, and its loop on
real child processes (a stand-in script for the worker) and real file changes.
The real worker under the reloader: tests/integration/test_cli_reload.py."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from tests.private_servers import running, wait_for
from weclaw_mq.cli import main
from weclaw_mq.cli import root as cli_root
from weclaw_mq.cli.exit_codes import ExitCode
from weclaw_mq.cli.reloader import (
    Reloader,
    child_command,
    describe,
    is_source,
    stop_bound_s,
    watched_dirs,
)
from weclaw_mq.cli.run_worker import HARD_EXIT_MARGIN_S

ROOT = Path("/srv/app")


@pytest.mark.parametrize(
    ("path", "counts"),
    [
        ("/srv/app/handlers.py", True),
        ("/srv/app/pkg/sub/models.py", True),
        ("/srv/app/notes.txt", False),
        ("/srv/app/handlers.pyc", False),
        ("/srv/app/.venv/lib/site.py", False),
        ("/srv/app/.git/hooks/x.py", False),
        ("/srv/app/pkg/.hidden/x.py", False),
        ("/srv/app/.#handlers.py", False),  # an editor's lock file
        ("/elsewhere/x.py", True),  # under no root: watchfiles watches only the roots anyway
    ],
)
def test_a_change_counts_for_python_sources_outside_hidden_folders(path: str, counts: bool) -> None:
    assert is_source(path, [ROOT]) is counts


def test_a_hidden_folder_above_the_watched_root_does_not_hide_it() -> None:
    assert is_source("/home/me/.projects/app/handlers.py", [Path("/home/me/.projects/app")])


def test_the_changed_files_are_named_relative_to_the_current_folder() -> None:
    paths = [f"/srv/app/m{i}.py" for i in range(5)]
    assert describe(paths[:2], ROOT) == "m0.py, m1.py"
    assert describe(paths, ROOT) == "m0.py, m1.py, m2.py (+2 more)"
    assert describe(["/other/x.py"], ROOT) == "/other/x.py"


def test_given_folders_are_watched_alone_an_inner_one_left_out(tmp_path: Path) -> None:
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    other = tmp_path / "c"
    other.mkdir()
    dirs = watched_dirs("anything", [inner, tmp_path / "a", other], Path("/"))
    assert dirs == [tmp_path / "a", other]


def test_by_default_the_current_folder_and_the_apps_package_folder_are_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    (cwd / "inside").mkdir(parents=True)
    (cwd / "inside" / "__init__.py").write_text("raise SystemExit('never imported')\n")
    src = tmp_path / "src"
    (src / "outside_pkg").mkdir(parents=True)
    (src / "outside_pkg" / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (src / "single_mod.py").write_text("raise SystemExit('never imported')\n")
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.syspath_prepend(str(cwd))

    assert watched_dirs("inside.app", [], cwd) == [cwd]
    assert watched_dirs("outside_pkg.handlers", [], cwd) == [cwd, src / "outside_pkg"]
    assert watched_dirs("single_mod", [], cwd) == [cwd, src]
    assert watched_dirs("no_such_module_xyz", [], cwd) == [cwd]
    # Installed code is not what one edits: site-packages is not watched.
    assert watched_dirs("pydantic", [], cwd) == [cwd]
    assert "inside" not in sys.modules and "outside_pkg" not in sys.modules


def test_the_stop_bound_is_the_childs_own_plus_slack() -> None:
    assert stop_bound_s(30.0) > 30.0 + HARD_EXIT_MARGIN_S


def test_the_child_runs_the_worker_command_of_this_interpreter() -> None:
    command = child_command(["m:app", "--concurrency", "2"])
    assert command[0] == sys.executable
    assert command[-4:] == ["worker", "m:app", "--concurrency", "2"]
    assert str(os.getpid()) in command


class _Captured:
    """Stands in for ``Reloader``: keeps what the worker command built."""

    made: ClassVar[list[tuple[list[str], list[Path]]]] = []

    def __init__(self, command: list[str], dirs: list[Path], *, stop_bound_s: float) -> None:
        self.made.append((command, dirs))

    def run(self) -> int:
        return 0


def test_the_child_gets_every_option_of_the_worker_but_the_reloaders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cli_root, "Reloader", _Captured)
    monkeypatch.setattr(cli_root, "configure_logging", lambda *args: None)  # this process's
    _Captured.made.clear()
    given = "-c 3 -q a -q b --metrics-port 9100 --loop uvloop --log-level debug --log-format json"
    with pytest.raises(SystemExit) as exited:
        main(["worker", "some_mod:app", "--reload", "--reload-dir", str(tmp_path), *given.split()])
    assert exited.value.code == 0
    ((command, dirs),) = _Captured.made
    assert dirs == [tmp_path.resolve()]
    # Each option by its long name, as its callback left it (the level in capitals).
    forwarded = (
        "--concurrency 3 --queue a --queue b --metrics-port 9100 --loop uvloop "
        "--log-level DEBUG --log-format json"
    )
    assert command[command.index("worker") :] == ["worker", "some_mod:app", *forwarded.split()]


# -- the loop, on a stand-in child ----------------------------------------------------------

# Writes "<pid> started <its WECLAW_MQ_BROKER_LOAD_CHECK>" to its file, and "<pid> stopped" on
# SIGTERM (or ignores SIGTERM).
STAND_IN = """
import os, signal, sys, time
record = sys.argv[1]
def say(what):
    with open(record, "a") as f:
        f.write(f"{os.getpid()} {what}\\n")
def on_term(signum, frame):
    say("stopped")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "stubborn" else on_term)
say("started " + os.environ.get("WECLAW_MQ_BROKER_LOAD_CHECK", "unset"))
while True:
    time.sleep(1)
"""


def lines(record: Path) -> list[str]:
    return record.read_text().splitlines() if record.exists() else []


@pytest.fixture
def record(tmp_path: Path) -> Iterator[Path]:
    """The stand-in's record; every process it names is SIGKILLed at the end, by pid."""
    path = tmp_path / "record.log"
    yield path
    for line in lines(path):
        pid = int(line.split()[0])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(path).encode() in cmdline:  # still that stand-in, not a reused pid
            os.kill(pid, signal.SIGKILL)


def run_in_thread(reloader: Reloader, steps: Callable[[], None]) -> int:
    """``reloader.run()`` here (it takes the signals: the main thread), ``steps`` on a thread,
    which ends by asking the reloader to stop as a SIGTERM would."""
    failures: list[BaseException] = []

    def drive() -> None:
        try:
            steps()
        except BaseException as e:
            failures.append(e)
        finally:
            reloader._on_signal(signal.SIGTERM, None)

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        code = reloader.run()
    finally:
        driver.join(timeout=30)
    if failures:
        raise failures[0]
    return code


def test_a_change_stops_the_child_then_starts_a_new_one(
    tmp_path: Path, record: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WECLAW_MQ_BROKER_LOAD_CHECK", raising=False)
    watched = tmp_path / "src"
    watched.mkdir()
    reloader = Reloader(
        [sys.executable, "-c", STAND_IN, str(record), "polite"], [watched], stop_bound_s=10
    )

    def steps() -> None:
        wait_for(lambda: len(lines(record)) == 1, 20, "the first child")
        wait_for(reloader.watching.is_set, 20, "the watch")
        (watched / "notes.txt").write_text("not a source")
        (watched / "handlers.py").write_text("VERSION = 2\n")
        wait_for(lambda: len(lines(record)) == 3, 20, "a second child")

    assert run_in_thread(reloader, steps) == 0
    first, stopped, second, last = (line.split() for line in lines(record))
    assert (first[1], stopped[1], second[1], last[1]) == (
        "started",
        "stopped",
        "started",
        "stopped",
    )
    assert first[0] == stopped[0] != second[0] == last[0]
    # The first worker reads the broker's load as configured; a restarted one does not.
    assert (first[2], second[2]) == ("unset", "false")


def test_a_child_that_ignores_sigterm_is_killed_past_the_bound(
    tmp_path: Path, record: Path
) -> None:
    reloader = Reloader(
        [sys.executable, "-c", STAND_IN, str(record), "stubborn"], [tmp_path], stop_bound_s=0.5
    )

    def steps() -> None:
        wait_for(lambda: len(lines(record)) == 1, 20, "the child")

    started = time.monotonic()
    assert run_in_thread(reloader, steps) == ExitCode.FAILED
    assert time.monotonic() - started < 20
    (pid,) = {int(line.split()[0]) for line in lines(record)}
    assert not running(pid)


def test_reload_without_watchfiles_is_a_configuration_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "watchfiles", None)  # as if not installed
    monkeypatch.setattr(cli_root, "configure_logging", lambda *args: None)
    with pytest.raises(SystemExit) as exited:
        main(["worker", "some_mod:app", "--reload"])
    assert exited.value.code == ExitCode.CONFIG
    assert capsys.readouterr().err == (
        "weclaw-mq: error: --reload needs watchfiles, which is not installed: "
        "pip install 'weclaw_mq[reload]'\n"
    )

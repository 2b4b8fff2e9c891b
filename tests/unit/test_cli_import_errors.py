"""A bug in the user's own module points at the bug: the error line, then the file, line and
code of the user's last frames, without the library's or importlib's frames, and exit 3.
No broker is needed: every command loads ``MODULE:APP`` before it connects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = """SETTINGS = {}


def lookup() -> str:
    return SETTINGS["missing"]
"""


def run_cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WECLAW_MQ_")}
    # A broker nobody answers on: reaching it would mean the app loaded, which it must not.
    env["WECLAW_MQ_AMQP_URL"] = "amqp://guest:guest@127.0.0.1:1/"
    return subprocess.run(
        [sys.executable, "-m", "weclaw_mq.cli", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "helper_mod.py").write_text(HELPER)
    return tmp_path


def test_an_error_raised_while_importing_names_the_users_file_and_line(folder: Path) -> None:
    (folder / "bad_app.py").write_text("from helper_mod import lookup\n\nVALUE = lookup()\n")

    run = run_cli(folder, "declare", "bad_app:app")

    assert run.returncode == 3, run.stderr
    lines = run.stderr.splitlines()
    assert lines[0] == "weclaw-mq: error: importing 'bad_app' failed: KeyError: 'missing'"
    assert lines[1:] == [
        f'  File "{folder / "bad_app.py"}", line 3, in <module>',
        "    VALUE = lookup()",
        f'  File "{folder / "helper_mod.py"}", line 5, in lookup',
        '    return SETTINGS["missing"]',
    ], run.stderr
    assert "Traceback" not in run.stderr and "importlib" not in run.stderr


def test_a_missing_dependency_of_the_users_module_is_shown_at_its_import(folder: Path) -> None:
    (folder / "needs_dep.py").write_text("import os\nimport not_installed_pkg_xyz\n")

    run = run_cli(folder, "declare", "needs_dep:app")

    assert run.returncode == 3, run.stderr
    lines = run.stderr.splitlines()
    assert lines[0] == (
        "weclaw-mq: error: importing 'needs_dep' failed: "
        "ModuleNotFoundError: No module named 'not_installed_pkg_xyz'"
    )
    assert lines[1:] == [
        f'  File "{folder / "needs_dep.py"}", line 2, in <module>',
        "    import not_installed_pkg_xyz",
    ], run.stderr


def test_a_module_that_does_not_exist_stays_one_line(folder: Path) -> None:
    run = run_cli(folder, "declare", "no_such_module:app")

    assert run.returncode == 3
    assert run.stderr.splitlines() == [
        "weclaw-mq: error: cannot import 'no_such_module': No module named 'no_such_module'"
    ]


def test_a_password_in_the_failing_line_is_not_printed(folder: Path) -> None:
    (folder / "with_url.py").write_text(
        'URL = "amqp://admin:s3cret-pw@broker:5672/"\nraise RuntimeError(URL)\n'
    )

    run = run_cli(folder, "declare", "with_url:app")

    assert run.returncode == 3, run.stderr
    assert "s3cret-pw" not in run.stderr
    assert f'File "{folder / "with_url.py"}", line 2, in <module>' in run.stderr
    assert "amqp://admin:***@broker:5672/" in run.stderr

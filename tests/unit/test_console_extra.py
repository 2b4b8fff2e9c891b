"""``weclaw-mq console`` on a machine without the ``console`` extra (or with part of it): one
line that names the extra to install, exit 3, whatever the other options say. markupsafe:
a package the extra's packages need, missing under them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weclaw_mq.cli.console_command import HOW_TO_GET_CONSOLE
from weclaw_mq.cli.exit_codes import ExitCode

# None in sys.modules makes an import fail as on a machine without the package. A fresh
# interpreter: this one may have imported the console's packages already.
RUN_WITHOUT = """
import sys
sys.modules[sys.argv[1]] = None
from weclaw_mq.cli import main
main(sys.argv[2:])
"""


def _console_without(package: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", RUN_WITHOUT, package, "console", "some_module:app", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("package", ["jinja2", "starlette", "uvicorn", "markupsafe"])
@pytest.mark.parametrize("args", [(), ("--host", "0.0.0.0", "--token", "t" * 20)])
def test_the_console_without_its_extra_names_the_extra_in_one_line(
    package: str, args: tuple[str, ...]
) -> None:
    done = _console_without(package, *args)
    assert done.returncode == ExitCode.CONFIG, done
    assert done.stderr == (
        f"weclaw-mq: error: the console needs {package}, not installed: {HOW_TO_GET_CONSOLE}\n"
    )

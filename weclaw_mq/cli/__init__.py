"""The ``weclaw-mq`` command. Thin: parse, call the library, print.

Exit codes (``weclaw_mq.cli.exit_codes.ExitCode``): 0 ok; 1 the answer is no or the operation
failed (unknown task, not in the DLQ, unhealthy, refused); 2 usage; 3 configuration; 4 broker
unavailable; 5 state store (Redis) unavailable; 130 interrupted.
"""

from __future__ import annotations

import sys
import warnings

from typer import Abort

try:  # recent typer carries its own copy of click, whose errors are not click's
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on the real click
    from click.exceptions import UsageError  # type: ignore[assignment]

from weclaw_mq.cli.exit_codes import ExitCode, classify, report, where_of
from weclaw_mq.cli.root import cli
from weclaw_mq.cli.tree import built_command

# aio-pika's Connection.__del__ schedules a close() it cannot run once the loop has stopped;
# a connection that failed mid-handshake is collected then (seen on 'publish' with the broker
# down), and Python prints two lines of "never awaited" beside our one. Nothing is left open.
_UNAWAITED_CLOSE = "coroutine 'Connection.close' was never awaited"


def main(argv: list[str] | None = None) -> None:
    """Entry point: every failure ends as one line on stderr and a documented exit code (a bug
    in the user's own module adds the lines of its last frames: file, line, code)."""
    warnings.filterwarnings("ignore", message=_UNAWAITED_CLOSE, category=RuntimeWarning)
    command = built_command()
    try:
        code = command.main(args=argv, prog_name="weclaw-mq", standalone_mode=False)
    except UsageError as e:
        message = e.format_message()
        if not message:  # bare 'weclaw-mq': the help was printed, nothing went wrong
            sys.exit(ExitCode.OK)
        report(message)
        sys.exit(ExitCode.USAGE)
    except (Abort, KeyboardInterrupt):
        code = ExitCode.INTERRUPTED
    except Exception as e:  # the one boundary: no traceback ever reaches the operator
        exit_code, message = classify(e)
        report(message, where_of(e))
        sys.exit(exit_code)
    if code == ExitCode.INTERRUPTED:  # recent typer turns Ctrl-C into a silent exit 130
        report("interrupted")
    sys.exit(code if isinstance(code, int) else ExitCode.OK)


__all__ = ["cli", "main"]

"""The ``weclaw-mq`` command. Thin: parse, call the library, print."""

from __future__ import annotations

import sys

import typer
from typer import Abort

try:  # recent typer carries its own copy of click, whose errors are not click's
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on the real click
    from click.exceptions import UsageError  # type: ignore[assignment]

from ..errors import WeclawMQError
from .root import cli


def main(argv: list[str] | None = None) -> None:
    """Entry point: every error ends as one line on stderr, never a stack trace."""
    command = typer.main.get_command(cli)
    try:
        code = command.main(args=argv, prog_name="weclaw-mq", standalone_mode=False)
    except UsageError as e:
        message = e.format_message()
        if not message:  # bare 'weclaw-mq': the help was printed, nothing went wrong
            sys.exit(0)
        print(f"weclaw-mq: {message}", file=sys.stderr)
        sys.exit(2)
    except WeclawMQError as e:
        print(f"weclaw-mq: {e}", file=sys.stderr)
        sys.exit(1)
    except (Abort, KeyboardInterrupt):
        print("weclaw-mq: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["cli", "main"]

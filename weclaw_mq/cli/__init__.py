"""The ``weclaw-mq`` command. Thin: parse, call the library, print."""

from __future__ import annotations

import sys

import click
import typer

from ..errors import WeclawMQError
from .root import cli


def main(argv: list[str] | None = None) -> None:
    """Entry point: every error ends as one line on stderr, never a stack trace."""
    command = typer.main.get_command(cli)
    try:
        code = command.main(args=argv, prog_name="weclaw-mq", standalone_mode=False)
    except click.UsageError as e:
        print(f"weclaw-mq: {e.format_message()}", file=sys.stderr)
        sys.exit(2)
    except WeclawMQError as e:
        print(f"weclaw-mq: {e}", file=sys.stderr)
        sys.exit(1)
    except (click.Abort, KeyboardInterrupt):
        print("weclaw-mq: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["cli", "main"]

"""The ``weclaw-mq`` command as typer builds it, and a walk over its commands.

One place for both: the entry point (``weclaw_mq.cli.main``) runs the command built here, the
docs site's CLI page (``docs/hooks.py``) and the docs' reference check
(``tests/unit/test_docs_references.py``) walk it, so all three see the same tree that
``weclaw-mq --help`` shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer

from weclaw_mq.cli.options import name_placeholders
from weclaw_mq.cli.root import cli

PROGRAM = "weclaw-mq"


def built_command() -> Any:
    """The click command typer builds from ``cli``, every value given its ``--help`` placeholder.

    Typed ``Any``: recent typer builds it from its own copy of click, not the ``click`` package.
    """
    command = typer.main.get_command(cli)
    name_placeholders(command)
    return command


def walk_commands(
    command: Any, path: tuple[str, ...] = (PROGRAM,)
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``command`` and every subcommand below it, depth first, in their declared order; a
    hidden command, and everything under it, is left out."""
    if getattr(command, "hidden", False):
        return
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk_commands(sub, (*path, name))

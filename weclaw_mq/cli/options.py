"""Options more than one command takes, declared once."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer

from weclaw_mq.contract.task_ids import check_task_id
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability.tracing import LOG_FORMATS

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def task_id_value(value: str | None) -> str | None:
    """A task id argument or option, refused (a usage error) unless publish could have given it."""
    try:
        if value is not None:
            check_task_id(value)
    except ConfigurationError as e:
        raise typer.BadParameter(str(e)) from None
    return value


LogLevel = Annotated[
    str,
    typer.Option(
        "--log-level",
        envvar="WECLAW_MQ_LOG_LEVEL",
        callback=_log_level,
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL.",
    ),
]


def _log_format(value: str) -> str:
    fmt = value.strip().lower()
    if fmt not in LOG_FORMATS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_FORMATS)}")
    return fmt


# The worker's and the outbox relay's: the long-running processes whose logs a collector reads.
LogFormatOption = Annotated[
    str,
    typer.Option(
        "--log-format",
        envvar="WECLAW_MQ_LOG_FORMAT",
        callback=_log_format,
        metavar="text|json",
        help="text (one line per record, for people) or json (one object per line).",
    ),
]

AppPath = Annotated[
    str,
    typer.Argument(
        metavar="MODULE:APP",
        help="Where your App lives, as MODULE:ATTRIBUTE (e.g. consumers.demo:app).",
        show_default=False,
    ),
]


def name_placeholders(command: Any) -> None:
    """Give every value of ``command`` and its subcommands a named placeholder in ``--help``.

    Without one, typer shows the Python type (``TEXT``, ``INTEGER``; ``<str>``, ``<int range>``
    and a ``<bool>`` on every flag in recent typer). A parameter declared with a ``metavar``
    keeps it; the others are named after their option (``--limit`` -> ``LIMIT``) or argument
    (``queue`` -> ``QUEUE``), flags show none, and an argument shows no type beside its name.
    (Typer's ``{QUEUE}`` for a required argument in the usage line is its own notation and
    stays.) Runs once on the built click command, so
    every command, whoever adds it, reads the same way."""
    params = list(getattr(command, "params", ()))
    help_option = _help_option(command)
    if help_option is not None:
        params.append(help_option)
    for param in params:
        if param.param_type_name == "argument" and hasattr(param, "display_type_rich"):
            # Recent typer prints an argument's Python type beside its name (QUEUE <str>):
            # the name and its help say it already.
            param.display_type_rich = _no_type
        if param.metavar is not None:
            continue
        if param.param_type_name == "argument":
            param.metavar = (param.name or "VALUE").upper()
        elif getattr(param, "is_flag", False):
            param.metavar = ""
        else:
            longest = max(param.opts, key=len)
            param.metavar = longest.lstrip("-").replace("-", "_").upper()
    for sub in getattr(command, "commands", {}).values():
        name_placeholders(sub)


def _no_type(ctx: Any) -> None:
    return None


def _help_option(command: Any) -> Any:
    """``--help`` of ``command``, where typer builds it once and keeps it (recent typer), so a
    placeholder set on it is shown; older click builds a new one per call: then None."""
    if not hasattr(command, "_help_option"):
        return None
    return command.get_help_option(command.context_class(command, info_name=command.name))

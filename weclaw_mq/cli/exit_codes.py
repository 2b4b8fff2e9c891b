"""How a failed ``weclaw-mq`` command ends: one line on stderr and an exit code.

Every exception that reaches the CLI boundary (``weclaw_mq.cli.main``) is mapped here, by
class, to one of a few documented codes, and printed as ``weclaw-mq: error: <one line>`` with
any URL password redacted. Commands that answer "no" (an unknown task, a missing dead letter,
a refused purge) end the same way through ``fail``.
"""

from __future__ import annotations

import re
import sys
from enum import IntEnum
from typing import NoReturn

import pydantic
import typer

from weclaw_mq.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    ConnectionLostError,
    PayloadError,
    PayloadTooLargeError,
    PayloadValidationError,
    StateUnavailableError,
    WeclawMQError,
)
from weclaw_mq.state.outages import is_command_error, state_unavailable

PROG = "weclaw-mq"


class ExitCode(IntEnum):
    OK = 0
    # The command ran and the answer is no: unknown task, not in the DLQ, unhealthy, a
    # publish the broker refused, a queue with other arguments, a file it could not write.
    FAILED = 1
    # A bad argument or option (typer's own code), and a --data the handler's model or the
    # size bound refuses: nothing was sent.
    USAGE = 2
    CONFIG = 3  # an invalid WECLAW_MQ_* value or URL, an App that cannot be loaded
    BROKER_UNAVAILABLE = 4  # RabbitMQ did not answer, or the link died mid-command
    STATE_UNAVAILABLE = 5  # Redis (task states, results) did not answer
    INTERRUPTED = 130  # Ctrl-C


# user:password@ in any URL-looking text; the scheme and user stay, the password goes.
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*):[^@\s/]*@")


def one_line(text: str) -> str:
    """``text`` on one line, with every URL password replaced by ``***``."""
    flat = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return _URL_PASSWORD.sub(r"\g<head>:***@", flat)


def report(message: str, where: list[str] | tuple[str, ...] = ()) -> None:
    """The error line, then (for a bug in the user's code) the lines that say where it is."""
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr)
    for line in where:  # a frame's "File ..." line, and its code indented below it
        indent = "  " if line.startswith("File ") else "    "
        print(f"{indent}{one_line(line)}", file=sys.stderr)


def where_of(e: BaseException) -> list[str]:
    """The user's frames of an error raised by their own module, else nothing."""
    where = getattr(e, "where", None)
    return list(where) if isinstance(where, list) else []


def fail(message: str, code: ExitCode = ExitCode.FAILED) -> NoReturn:
    """End a command with one error line and ``code`` (a typer exit, no traceback)."""
    report(message)
    raise typer.Exit(int(code))


def _settings_problem(e: pydantic.ValidationError) -> str:
    # Never e's str(): it spans lines. Inputs are hidden by the model config; loc and msg
    # say which variable and what is wrong with it.
    parts = []
    for err in e.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"])
        name = f"WECLAW_MQ_{where.upper()}" if e.title == "Settings" and where else where
        msg = err["msg"].removeprefix("Value error, ")  # our validators' own words
        parts.append(f"{name}: {msg}" if name else msg)
    return f"invalid configuration: {'; '.join(parts) or e.title}"


def classify(e: BaseException) -> tuple[ExitCode, str]:
    """The exit code and the message for an exception that ended a command."""
    if isinstance(e, pydantic.ValidationError):
        return ExitCode.CONFIG, _settings_problem(e)
    if isinstance(e, (PayloadTooLargeError, PayloadValidationError)):  # only publish's task
        return ExitCode.USAGE, f"invalid value for '--data': {e}"
    if isinstance(e, PayloadError):  # a queue name AMQP cannot carry
        return ExitCode.USAGE, str(e)
    if isinstance(e, ConfigurationError):
        return ExitCode.CONFIG, str(e)
    if isinstance(e, (BrokerUnavailableError, ConnectionLostError, ConfirmTimeoutError)):
        return ExitCode.BROKER_UNAVAILABLE, str(e)
    if isinstance(e, StateUnavailableError):
        return ExitCode.STATE_UNAVAILABLE, str(e)
    # A path that does not wrap them (yet). No Redis error exists unless redis-py was loaded,
    # and a worker with the guard and results off never loads it: not for this check either.
    redis_errors = sys.modules.get("redis.exceptions")
    if redis_errors is not None and isinstance(e, redis_errors.RedisError):
        if is_command_error(e):  # Redis answered, and no wait would change its answer
            return ExitCode.FAILED, str(state_unavailable(e))
        return ExitCode.STATE_UNAVAILABLE, f"Redis did not answer: {type(e).__name__}: {e}"
    if isinstance(e, WeclawMQError):
        return ExitCode.FAILED, str(e)
    if isinstance(e, OSError) and e.filename is not None:  # a local file: the export path
        return ExitCode.FAILED, f"cannot write {e.filename}: {e.strerror or e}"
    return ExitCode.FAILED, f"unexpected {type(e).__name__}: {e}"

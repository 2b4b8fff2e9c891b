"""Putting a failure into words that always exist and always encode.

A handler may raise anything: an exception whose ``__str__`` itself raises, or whose message
holds a lone surrogate (``"\\ud800"``) that UTF-8 cannot encode. That text goes into AMQP
headers, the task's status record (JSON in Redis) and log lines; any of them failing on it
would leave the delivery unsettled. Every failure text is made here, once, safe for all three.
"""

from __future__ import annotations

import importlib
import traceback
from pathlib import Path

from weclaw_mq.errors import WeclawMQError
from weclaw_mq.policy.breaker import UpstreamDown
from weclaw_mq.policy.signals import Reject, Retry

_OURS = (WeclawMQError, Reject, Retry, UpstreamDown)
# weclaw_mq's own folder (this file's parent's parent): frames from there are ours, not the user's.
_LIBRARY = Path(__file__).resolve().parents[1]
_IMPORTLIB = Path(importlib.__file__).resolve().parent


def in_library(filename: str) -> bool:
    """Whether a traceback frame's file is weclaw_mq's own code."""
    return Path(filename).resolve().is_relative_to(_LIBRARY)


# The user's frames shown under an error raised by their own code: the bug is in the last ones.
USER_FRAMES = 3


def user_frames(error: BaseException) -> list[str]:
    """The last ``USER_FRAMES`` frames of ``error``'s traceback that are the user's code, as
    ``File "...", line N, in NAME`` and the source line below it (weclaw_mq's own frames and
    importlib's left out)."""
    lines: list[str] = []
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith("<")  # importlib's frozen bootstrap
        and not in_library(frame.filename)
        and not Path(frame.filename).resolve().is_relative_to(_IMPORTLIB)
    ]
    for frame in frames[-USER_FRAMES:]:
        lines.append(f'File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            lines.append(f"  {frame.line.strip()}")
    return lines


def safe_text(value: object) -> str:
    """``str(value)``, or a stand-in when that raises; never a string UTF-8 cannot encode."""
    try:
        text = str(value)
    except BaseException:  # a broken __str__ may raise anything (or return a non-str)
        return f"<{type(value).__name__}: str() failed>"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates become visible escapes (\ud800), never an encoding error later.
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


# Our own errors' names start with this; nothing else written as an error type does.
OUR_PREFIX = "weclaw_mq."


def error_type(error: BaseException) -> str:
    """The error's stable name, written into ``x-weclaw-error-type``: part of the wire format.

    Our own exceptions (the ``WeclawMQError`` tree, ``Reject``, ``Retry``, ``UpstreamDown``)
    carry it as ``error_type`` (``weclaw_mq.HandlerTimeout``), so moving or renaming code never
    changes what an operator's filter matches. Any other exception is written as its class
    ``__name__`` (``RuntimeError``, ``RateLimitError``). Only our class's own ``error_type``
    counts: a user's subclass of one of ours is named by its ``__name__``, and a user's class
    that happens to have an ``error_type`` attribute is not mistaken for ours.
    """
    kind = type(error)
    own = kind.__dict__.get("error_type") if issubclass(kind, _OURS) else None
    return own if isinstance(own, str) else safe_text(kind.__name__)


def stable_error_types() -> frozenset[str]:
    """Every stable name ours may write into ``x-weclaw-error-type`` (``weclaw_mq.<Name>``):
    the ``error_type`` of each of our classes, read from the classes themselves."""
    found: set[str] = set()
    todo: list[type[BaseException]] = list(_OURS)
    while todo:
        kind = todo.pop()
        todo.extend(kind.__subclasses__())
        own = kind.__dict__.get("error_type")
        # A user's subclass is named by its __name__, whatever attributes it has.
        if isinstance(own, str) and kind.__module__.startswith(OUR_PREFIX):
            found.add(own)
    return frozenset(found)


def error_class(error: BaseException) -> str:
    """``module.QualifiedName`` of the error's class: for people, not for filters."""
    kind = type(error)
    return safe_text(f"{kind.__module__}.{kind.__qualname__}")


def stable_error_type(written: str) -> str:
    """The stable name for an ``x-weclaw-error-type`` value, whichever version wrote it.

    Before stable names, the header held ``module.QualifiedName`` (``builtins.RuntimeError``,
    ``weclaw_mq.process.HandlerTimeout``), and such messages may wait in a DLQ for weeks.
    Ours keep our prefix and their class name (which equals the stable name); anything else
    keeps its last dotted part, the class name. A stable name reads as itself.
    """
    last = written.rpartition(".")[2]
    return OUR_PREFIX + last if written.startswith(OUR_PREFIX) else last


def describe(error: BaseException) -> str:
    """``ErrorName: message``: one line for logs and the task's status record."""
    return f"{safe_text(type(error).__name__)}: {safe_text(error)}"


def traceback_text(error: BaseException) -> str:
    """The formatted traceback (the standard library already survives a broken __str__)."""
    try:
        text = "".join(traceback.format_exception(error))
    except Exception:  # a pathological exception chain: the type and message still help
        return describe(error)
    return safe_text(text)


def handler_traceback(error: BaseException) -> str | None:
    """``error``'s traceback as safe text, starting at the first frame outside weclaw_mq (the
    handler's own); None for an error that was never raised (a decision of ours, a signal
    such as ``Reject``), whose line says all there is."""
    tb = error.__traceback__
    if tb is None or isinstance(error, (Reject, Retry)):
        return None
    while tb is not None and in_library(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    try:
        lines = traceback.format_exception(type(error), error, tb or error.__traceback__)
    except Exception:  # a pathological exception chain: the line's text still names it
        return None
    return safe_text("".join(lines).rstrip("\n"))

"""Putting a failure into words that always exist and always encode.

A handler may raise anything: an exception whose ``__str__`` itself raises, or whose message
holds a lone surrogate (``"\\ud800"``) that UTF-8 cannot encode. That text goes into AMQP
headers, the task's status record (JSON in Redis) and log lines; any of them failing on it
would leave the delivery unsettled. Every failure text is made here, once, safe for all three.
"""

from __future__ import annotations

import traceback


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


def error_type(error: BaseException) -> str:
    """The error's class as ``module.QualifiedName``."""
    kind = type(error)
    return safe_text(f"{kind.__module__}.{kind.__qualname__}")


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

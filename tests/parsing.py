"""``ast.parse`` for the tests that read the project's own source."""

from __future__ import annotations

import ast
import threading


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, once more in a thread of its own if it raises ``SystemError``.

    CPython 3.11's AST validator keeps its recursion depth per thread, and after a deep
    recursion earlier in the same thread (a hostile-input test of the same test process) it
    can fail a valid file with "AST constructor recursion depth mismatch"; a new thread starts
    at depth 0."""
    try:
        return ast.parse(source, filename)
    except SystemError:
        parsed: list[ast.Module] = []
        thread = threading.Thread(target=lambda: parsed.append(ast.parse(source, filename)))
        thread.start()
        thread.join()
        if not parsed:
            raise
        return parsed[0]

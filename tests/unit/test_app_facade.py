"""``App`` is a facade: its public methods (its own and those it inherits by topic from
``weclaw_mq/facade/``) are each a docstring and one statement handing the call to the part
that does the work, and no class of the facade outgrows a reader's head."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "weclaw_mq"
FACADE = [PACKAGE / "app.py", *sorted((PACKAGE / "facade").glob("*.py"))]
# What holds work of its own, and why: registering checks options at import time (handler,
# schedule); the App opens its store and sync client lazily, declares and closes what it
# opened; publish prepares and sends inline (no extra frame on the hot path); calls refuses
# a bad task id before it opens a ledger.
HOLDS_WORK = {"handler", "schedule", "store", "sync", "declare", "close", "publish", "calls"}
CLASS_MAX_LINES = 500


def classes() -> list[tuple[Path, ast.ClassDef]]:
    return [
        (path, node)
        for path in FACADE
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    ]


def test_the_app_inherits_every_topic_of_the_facade() -> None:
    import weclaw_mq.facade.local_outbox as local_outbox
    import weclaw_mq.facade.reading as reading
    import weclaw_mq.facade.registration as registration
    import weclaw_mq.facade.workflows_and_costs as workflows_and_costs
    from weclaw_mq import App

    topics = {
        registration.Registration,
        reading.Reading,
        workflows_and_costs.WorkflowsAndCosts,
        local_outbox.LocalOutbox,
    }
    assert topics <= set(App.__mro__)


@pytest.mark.parametrize(("path", "node"), classes(), ids=lambda v: getattr(v, "name", ""))
def test_each_public_method_is_documented_and_one_statement(path: Path, node: ast.ClassDef) -> None:
    assert node.end_lineno is not None
    assert node.end_lineno - node.lineno < CLASS_MAX_LINES, f"{node.name} has grown"
    for method in node.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if method.name.startswith("_") or method.name in HOLDS_WORK:
            continue
        overload = any(
            isinstance(d, ast.Name) and d.id == "overload" for d in method.decorator_list
        )
        if overload:
            continue
        docstring = ast.get_docstring(method)
        assert docstring, f"{node.name}.{method.name} has no docstring"
        assert len(method.body) == 2, f"{node.name}.{method.name} is not one statement"

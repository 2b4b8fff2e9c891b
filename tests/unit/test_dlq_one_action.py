"""Every front end requeues and purges through the one action object,
``admin.dlq_action.DlqAction``: read from the code, so a front end that drives the DLQ its own
way again (the console's purge once lost its limit like that) fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from weclaw_mq.admin.dlq_action import DlqAction
from weclaw_mq.admin.dlq_filter import DlqFilter
from weclaw_mq.errors import ConfigurationError

PACKAGE = Path(__file__).resolve().parents[2] / "weclaw_mq"
FRONT_ENDS = [PACKAGE / "cli" / "dlq_commands.py", *sorted((PACKAGE / "console").glob("*.py"))]
# What only the engine may touch: the pass it walks, and the ways around the action object.
ENGINE_ONLY = {"pass_over", "Pass", "redrive", "purge_matching", "requeue", "purge", "_walk"}
# Where a dead letter is matched against a filter: the looks and the action's walk.
MATCHERS = {PACKAGE / "admin" / "dlq.py", PACKAGE / "admin" / "dlq_action.py"}


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def names_from_admin(module: ast.Module) -> set[str]:
    """Each name a module takes from ``weclaw_mq.admin``, and each ``dlq.NAME`` it uses."""
    used = {
        alias.name
        for node in ast.walk(module)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("weclaw_mq.admin")
        for alias in node.names
    }
    used |= {
        node.attr
        for node in ast.walk(module)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in {"dlq", "dlq_action", "dlq_pass"}
    }
    return used


def calls(module: ast.Module) -> set[str]:
    """The names called in a module: ``f(...)`` and ``x.f(...)`` both give ``f``."""
    found = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.add(func.id)
            elif isinstance(func, ast.Attribute):
                found.add(func.attr)
    return found


@pytest.mark.parametrize("path", FRONT_ENDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_front_end_drives_the_dlq_pass_or_a_way_around_the_action_object(path: Path) -> None:
    module = tree(path)
    assert not names_from_admin(module) & ENGINE_ONLY
    assert "matches" not in calls(module), "filtering belongs to the engine"


@pytest.mark.parametrize(
    "path",
    [PACKAGE / "cli" / "dlq_commands.py", PACKAGE / "console" / "dead_letters.py"],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_the_cli_and_the_console_build_a_dlq_action_and_preview_or_apply_it(path: Path) -> None:
    module = tree(path)
    assert "DlqAction" in calls(module)
    assert {"preview", "apply"} <= {
        node.attr for node in ast.walk(module) if isinstance(node, ast.Attribute)
    }


def test_only_the_looks_and_the_action_walk_match_dead_letters_against_a_filter() -> None:
    matching = {p for p in PACKAGE.rglob("*.py") if "matches" in calls(tree(p))}
    matching.discard(PACKAGE / "admin" / "dlq_filter.py")  # where matches is defined
    assert {p for p in matching if "dlq" in p.name or p.parent.name in {"cli", "console"}} <= (
        MATCHERS
    )


def test_the_admin_wrappers_are_one_action_each() -> None:
    module = tree(PACKAGE / "admin" / "dlq.py")
    wrappers = {
        node.name: node
        for node in module.body
        if isinstance(node, ast.AsyncFunctionDef)
        and node.name in {"requeue", "purge", "purge_matching"}
    }
    assert set(wrappers) == {"requeue", "purge", "purge_matching"}
    for name, node in wrappers.items():
        assert "DlqAction" in calls(ast.Module(body=[node], type_ignores=[])), name


def test_a_big_preview_is_pinned_to_its_count_and_a_small_one_to_its_task_ids() -> None:
    where = DlqFilter.of(reasons=["rejected"])
    action = DlqAction("purge", "q", where)
    assert action.pinned(["a", "b", "c"], by_id_max=2) == DlqAction("purge", "q", where, 3)
    small = action.pinned(["a", "b"], by_id_max=2)
    assert small.where.task_ids == {"a", "b"} and small.where.reasons == {"rejected"}
    assert small.limit is None
    assert action.pinned([], by_id_max=2).limit == 0
    assert action.pinned(["a", ""], by_id_max=2).limit == 2  # a message without a task id


@pytest.mark.parametrize(
    ("kind", "limit", "rate_per_s"),
    [("shovel", None, None), ("purge", -1, None), ("purge", None, 5.0), ("requeue", None, 0.0)],
)
def test_an_action_that_cannot_be_carried_out_is_refused_when_made(
    kind: str, limit: int | None, rate_per_s: float | None
) -> None:
    with pytest.raises(ConfigurationError):
        DlqAction(kind, "q", limit=limit, rate_per_s=rate_per_s)  # type: ignore[arg-type]

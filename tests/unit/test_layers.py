"""The package's folders are its layers: every import points down, and no import cycle.

The layers are the contract in ``pyproject.toml`` (``[tool.importlinter]``, checked by
``lint-imports`` in ``make lint``); this test reads the same list and checks the import graph
grimp builds of ``weclaw_mq`` (``TYPE_CHECKING`` and in-function imports included), so a broken
layer fails the suite too, with the offending import named."""

from __future__ import annotations

import itertools
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

import weclaw_mq

ROOT = Path(__file__).resolve().parents[2]
# The App, its settings, its errors, the handler's Context and the package itself.
TOP_LEVEL_MODULES = {"__init__", "app", "settings", "errors", "context"}


def contract_layers() -> list[list[str]]:
    """The layers of pyproject.toml's contract, top first; each a list of siblings."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "layers"]
    return [[name.strip() for name in layer.split("|")] for layer in contract["layers"]]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("weclaw_mq", exclude_type_checking_imports=False, cache_dir=None)


def room(module: str) -> str:
    """The child of ``weclaw_mq`` a module belongs to."""
    return module.split(".")[1] if module.count(".") else ""


def upward_imports(graph: grimp.ImportGraph, layers: list[list[str]]) -> Iterator[str]:
    """Every import from a room to a room above it, or between independent siblings."""
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            a, b = room(importer), room(imported)
            if not a or not b or a == b:
                continue  # the package's own __init__ re-exports; a room's inner imports
            if rank[b] <= rank[a]:
                yield f"{importer} -> {imported} ({a} may not import {b})"


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_every_room_of_the_package_is_in_exactly_one_layer() -> None:
    package = Path(weclaw_mq.__file__).parent
    rooms = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    rooms |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    listed = [name for layer in contract_layers() for name in layer]
    assert sorted(listed) == sorted(rooms)


def test_no_import_points_up_a_layer(graph: grimp.ImportGraph) -> None:
    assert list(upward_imports(graph, contract_layers())) == []


def test_an_upward_import_is_found(graph: grimp.ImportGraph) -> None:
    # The check itself can fail: one import from the policy layer up into the worker.
    graph.add_import(importer="weclaw_mq.policy.retry", imported="weclaw_mq.worker.ends")
    try:
        found = list(upward_imports(graph, contract_layers()))
        assert found == [
            "weclaw_mq.policy.retry -> weclaw_mq.worker.ends (policy may not import worker)"
        ]
        assert cycles(graph) != []  # and the worker imports the policy: a cycle
    finally:
        graph.remove_import(importer="weclaw_mq.policy.retry", imported="weclaw_mq.worker.ends")


def test_the_package_has_no_import_cycle(graph: grimp.ImportGraph) -> None:
    assert cycles(graph) == []


def test_at_most_five_modules_stay_at_the_top() -> None:
    package = Path(weclaw_mq.__file__).parent
    assert {p.stem for p in package.glob("*.py")} == TOP_LEVEL_MODULES


def test_lint_imports_keeps_the_contracts() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    run = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(contracts)} kept, 0 broken" in run.stdout
    assert "the delivery core does not import the LLM layer KEPT" in run.stdout

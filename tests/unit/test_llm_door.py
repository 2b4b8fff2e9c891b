"""``weclaw_mq.llm`` is the LLM layer's door: every type a how-to page of that layer uses is
importable from it (the same objects as where they live), and no how-to example imports a
deep module for them."""

from __future__ import annotations

import re
from pathlib import Path

import weclaw_mq
import weclaw_mq.llm
from weclaw_mq.handlers.middleware import Usage
from weclaw_mq.policy.costs import Cap, Price
from weclaw_mq.policy.fair_share import Fair
from weclaw_mq.policy.fallback import Fallback

ROOT = Path(__file__).resolve().parents[2]


def test_the_llm_door_holds_the_layers_types_as_the_same_objects() -> None:
    door = {name: getattr(weclaw_mq.llm, name) for name in weclaw_mq.llm.__all__}
    assert door == {
        "Cap": Cap,
        "Fair": Fair,
        "Fallback": Fallback,
        "Limit": weclaw_mq.Limit,
        "Price": Price,
        "Usage": Usage,
    }


def test_no_howto_example_imports_a_deep_module_of_the_package() -> None:
    # A door per topic: weclaw_mq, weclaw_mq.llm, weclaw_mq.outbox, weclaw_mq.workflows,
    # weclaw_mq.testing, weclaw_mq.errors; nothing a how-to page shows lives only deeper.
    doors = {"llm", "outbox", "workflows", "testing", "errors"}
    deep = []
    for path in sorted((ROOT / "docs" / "examples" / "howto").glob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            found = re.match(r"\s*from weclaw_mq\.([\w.]+) import", line)
            if found and found[1] not in doors:
                deep.append(f"{path.name}: {line.strip()}")
    assert not deep, "\n".join(deep)


def test_the_llm_features_are_middleware_on_the_public_seam_only() -> None:
    # The library's cap, fallback chain, limits and costs are one Middleware subclass that
    # overrides public hooks and nothing else of it: what a team's own middleware can do.
    from weclaw_mq.llm.calls import ModelCalls

    assert issubclass(ModelCalls, weclaw_mq.Middleware)
    hooks = {name for name in vars(weclaw_mq.Middleware) if not name.startswith("_")}
    overridden = {
        name
        for name, value in vars(ModelCalls).items()
        if not name.startswith("_") and callable(value)
    }
    assert overridden and overridden <= hooks, overridden - hooks


def test_no_module_of_the_llm_layer_imports_the_worker() -> None:
    # Beside the layers contract (tests/unit/test_layers.py), said where one looks for it.
    found = []
    for path in sorted((ROOT / "weclaw_mq" / "llm").glob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if re.match(r"\s*(from|import) weclaw_mq\.(worker|app|facade)\b", line):
                found.append(f"{path.name}: {line.strip()}")
    assert not found, "\n".join(found)

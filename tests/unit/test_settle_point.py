"""One place settles a delivery: the worker's gates and ends answer with an ``End`` value, and
only ``weclaw_mq/worker/ends.py`` carries it out through the ``Settler``; only the Settler
(``settle.py``) touches a message's ack, nack or reject. Read from the code itself, so a new
early return that settles on its own fails here."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from tests.parsing import parse_source
from weclaw_mq.worker import ends

WORKER = Path(__file__).resolve().parents[2] / "weclaw_mq" / "worker"
# The Settler's methods that end a delivery (publish-with-confirm moves, acks, nacks).
SETTLER_ENDS = {"ack", "give_back", "reject", "retry", "defer", "dead_letter"}
MESSAGE_SETTLES = {"ack", "nack", "reject"}


def calls(path: Path) -> list[tuple[int, str, str]]:
    """(line, the called object's last name, the method) of every ``x.y.method(...)`` call."""
    found = []
    for node in ast.walk(parse_source(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = (
                owner.attr
                if isinstance(owner, ast.Attribute)
                else owner.id
                if isinstance(owner, ast.Name)
                else ""
            )
            found.append((node.lineno, name, node.func.attr))
    return found


def test_only_ends_py_calls_the_settlers_ends() -> None:
    elsewhere = [
        f"{path.name}:{line}: {owner}.{method}()"
        for path in sorted(WORKER.glob("*.py"))
        if path.name not in ("ends.py", "settle.py")
        for line, owner, method in calls(path)
        if owner == "settler" and method in SETTLER_ENDS
    ]
    assert not elsewhere, "settled outside ends.carry_out:\n" + "\n".join(elsewhere)
    used = {m for _, owner, m in calls(WORKER / "ends.py") if owner == "settler"}
    assert used >= SETTLER_ENDS, f"ends.py never calls settler.{SETTLER_ENDS - used}"


def test_only_the_settler_acks_nacks_or_rejects_a_message() -> None:
    elsewhere = [
        f"{path.name}:{line}: {owner}.{method}()"
        for path in sorted(WORKER.glob("*.py"))
        if path.name != "settle.py"
        for line, owner, method in calls(path)
        if owner == "message" and method in MESSAGE_SETTLES
    ]
    assert not elsewhere, "a message settled outside the Settler:\n" + "\n".join(elsewhere)


def test_carry_out_has_a_case_for_every_end() -> None:
    kinds = set(typing.get_args(ends.End))
    source = (WORKER / "ends.py").read_text(encoding="utf-8")
    tree = parse_source(source)
    carry_out = next(
        n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "carry_out"
    )
    named = {n.id for n in ast.walk(carry_out) if isinstance(n, ast.Name)}
    missing = [k.__name__ for k in kinds if k.__name__ not in named]
    assert not missing, f"carry_out has no case for {missing}"
    assert len(kinds) >= 8


def test_the_checks_see_a_settle_outside_its_place(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text(
        "async def gate(message, rt):\n"
        "    await rt.settler.defer(message)\n"
        "    await message.ack()\n"
    )
    found = {(owner, method) for _, owner, method in calls(stray)}
    assert ("settler", "defer") in found and ("message", "ack") in found


def carry_out_calls() -> dict[str, int]:
    """``file:function`` -> how many calls of ``carry_out`` it makes, over the worker."""
    found: dict[str, int] = {}
    for path in sorted(WORKER.glob("*.py")):
        tree = parse_source(path.read_text(encoding="utf-8"))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = sum(
                1
                for node in ast.walk(func)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "carry_out"
            )
            if n:
                found[f"{path.name}:{func.name}"] = n
    return found


def test_a_delivery_carries_out_its_one_end_in_one_place() -> None:
    # A delivery's stages answer with an End; one call carries it out. Besides it: the end
    # of an attempt abandoned by its handler (a task of its own), and the give-back of a
    # message never read (the worker stops, its consumer is gone).
    assert carry_out_calls() == {
        "delivery.py:_to_the_end": 1,
        "running.py:_end_abandoned": 1,
        "ends.py:give_back": 1,
        "in_flight.py:_give_back": 1,
    }

"""The public API's docstrings share one style, Google's, as the API page renders them.

Every callable reachable from ``weclaw_mq.__all__`` (functions, classes and their public
methods; the default Redis stores too) is read with griffe, the parser mkdocstrings uses for
docs/reference/api.md. Each must have a docstring that opens with a one-line summary, whose
``Args:`` section names exactly the parameters of its signature and which, when it returns
something, has a ``Returns:`` or ``Yields:`` section. A class documents its constructor's
parameters (a dataclass's fields) in its own docstring or in its ``__init__``'s: the page
merges the two (``merge_init_into_class``). Error classes are exempt from ``Args:`` and may
wrap their one sentence over two lines: docs/reference/errors.md shows them, and their
constructors are the library's to call. A store's method without a docstring of its own shows
the one of the protocol method it implements (griffe-inherited-docstrings, which mkdocs.yml
loads too).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import weclaw_mq
from weclaw_mq.errors import WeclawMQError

griffe = pytest.importorskip(
    "griffe", reason="griffe comes with mkdocstrings: pip install -e '.[dev]'"
)
# The stores' methods take the docstrings of the protocol methods they implement, as on the page.
INHERITED_DOCSTRINGS = pytest.importorskip(
    "griffe_inherited_docstrings", reason="pip install -e '.[dev]'"
).__name__

ROOT = Path(__file__).resolve().parents[2]
# Parameters no docstring lists: the instance and the class.
IMPLICIT = frozenset({"self", "cls"})
# The stores an App opens by default: not exported, but what the protocols' users run on.
DEFAULT_STORES = ("state.redis.RedisTaskStore", "streaming.redis.RedisStreamStore")
# Return annotations that mean "nothing to describe".
NOTHING = frozenset({"None", "NoReturn", "Never"})


def _load() -> Any:
    # Parse warnings are checked by the strict docs build; here only the sections matter.
    logging.getLogger("griffe").setLevel(logging.ERROR)
    return griffe.load(
        "weclaw_mq",
        search_paths=[str(ROOT)],
        docstring_parser="google",
        allow_inspection=False,
        extensions=griffe.load_extensions(INHERITED_DOCSTRINGS),
    )


@pytest.fixture(scope="module")
def package() -> Any:
    return _load()


def _target(obj: Any) -> Any:
    return obj.final_target if obj.is_alias else obj


def public_callables(package: Any) -> Iterator[tuple[str, Any]]:
    """(dotted name, griffe object) of every public function, class and method of the API."""
    seen: set[str] = set()
    for name in [*weclaw_mq.__all__, *DEFAULT_STORES]:
        obj = _target(package[name])
        if obj.path in seen:
            continue
        seen.add(obj.path)
        if not (obj.is_class or obj.is_function):
            continue
        yield name, obj
        if not obj.is_class:
            continue
        for member_name, member in obj.members.items():
            if member_name.startswith("_") or member.is_alias:
                continue
            if member.is_function or (member.is_attribute and "property" in member.labels):
                yield f"{name}.{member_name}", member
        # And what it inherits from the package's own classes (App's topics in facade/).
        for member_name, alias in obj.inherited_members.items():
            member = alias.final_target
            if member_name.startswith("_") or not member.path.startswith("weclaw_mq."):
                continue
            if member.is_function or (member.is_attribute and "property" in member.labels):
                yield f"{name}.{member_name}", member


def _is_error(obj: Any) -> bool:
    value = getattr(weclaw_mq, obj.name, None)
    return isinstance(value, type) and issubclass(value, WeclawMQError)


def _section(docstrings: list[Any], kind: str) -> list[Any] | None:
    """The items of the ``kind`` sections of ``docstrings``; None when none has one."""
    found = None
    for docstring in docstrings:
        for section in docstring.parse("google"):
            if section.kind.value == kind:
                found = (found or []) + list(section.value)
    return found


def _docstrings(obj: Any) -> list[Any]:
    """``obj``'s docstring, and for a class its own ``__init__``'s (merged on the page)."""
    found = [obj.docstring] if obj.docstring is not None else []
    init = obj.members.get("__init__") if obj.is_class else None
    if init is not None and not init.is_alias and init.docstring is not None:
        found.append(init.docstring)
    return [d for d in found if d.value.strip()]


def _signature_names(obj: Any) -> list[str]:
    names = []
    for parameter in obj.parameters:
        if parameter.name in IMPLICIT:
            continue
        star = {"variadic positional": "*", "variadic keyword": "**"}.get(parameter.kind.value, "")
        names.append(star + parameter.name)
    return names


def problems(obj: Any) -> list[str]:
    """What is wrong with ``obj``'s docstring under the style; empty when nothing is."""
    docstrings = _docstrings(obj)
    if not docstrings or obj.docstring is None:
        return ["no docstring"]
    found = []
    summary = docstrings[0].value.strip().split("\n\n")[0]
    if "\n" in summary and not _is_error(obj):
        found.append("the summary is not one line")
    is_property = obj.is_attribute and "property" in obj.labels
    checks_args = obj.is_function or (obj.is_class and not _is_error(obj))
    if checks_args:
        expected = _signature_names(obj)
        documented = [p.name for p in _section(docstrings, "parameters") or []]
        bare = {n.lstrip("*"): n for n in expected}
        missing = [n for n in expected if n not in documented and n.lstrip("*") not in documented]
        unknown = [n for n in documented if n not in expected and n.lstrip("*") not in bare]
        if missing:
            found.append(f"Args: does not list {missing}")
        if unknown:
            found.append(f"Args: lists {unknown}, not in the signature")
    if obj.is_function and not is_property:
        returns = str(obj.returns) if obj.returns is not None else "None"
        has_section = (
            _section(docstrings, "returns") is not None
            or _section(docstrings, "yields") is not None
        )
        if returns not in NOTHING and obj.name != "__init__" and not has_section:
            found.append(f"returns {returns} but has no Returns: or Yields: section")
    return found


def test_every_public_callable_follows_the_google_style(package: Any) -> None:
    report = {name: found for name, obj in public_callables(package) if (found := problems(obj))}
    assert not report, "docstrings off the Google style:\n" + "\n".join(
        f"  {name}: {'; '.join(found)}" for name, found in sorted(report.items())
    )


def test_the_walk_reaches_the_classes_methods_and_properties(package: Any) -> None:
    names = {name for name, _ in public_callables(package)}
    assert {"App", "App.publish", "App.store", "Context.emit", "retry_after_s"} <= names
    assert {"TaskStore.claim", "Worker.run", "RetryPolicy.delay_ms"} <= names
    assert {"state.redis.RedisTaskStore.claim", "streaming.redis.RedisStreamStore.read"} <= names


# -- the checker itself, on docstrings written to break it ---------------------------------
SAMPLE = '''
def good(queue: str, *, count: int = 1, **options: object) -> list[str]:
    """Read some tasks.

    Args:
        queue: Where from.
        count: How many.
        **options: Passed on.

    Returns:
        Their ids.
    """


def missing_arg(queue: str, count: int) -> None:
    """Read some tasks.

    Args:
        queue: Where from.
    """


def unknown_arg(queue: str) -> None:
    """Read some tasks.

    Args:
        queue: Where from.
        limit: Not a parameter.
    """


def no_returns(queue: str) -> int:
    """Count the tasks.

    Args:
        queue: Where from.
    """


def undocumented(queue: str) -> None:
    pass


def long_summary() -> None:
    """Read some tasks, and go on
    about it on the next line.
    """


class Options:
    """Some options.

    Args:
        size: How big.
    """

    def __init__(self, size: int, colour: str) -> None:
        self.size = size
'''


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("sample")
    (folder / "docstring_sample.py").write_text(inspect.cleandoc(SAMPLE) + "\n")
    return griffe.load("docstring_sample", search_paths=[str(folder)], docstring_parser="google")


def test_the_checker_passes_a_google_docstring(sample: Any) -> None:
    assert problems(sample["good"]) == []


def test_the_checker_finds_a_parameter_the_docstring_leaves_out(sample: Any) -> None:
    assert problems(sample["missing_arg"]) == ["Args: does not list ['count']"]


def test_the_checker_finds_a_documented_parameter_the_signature_lacks(sample: Any) -> None:
    assert problems(sample["unknown_arg"]) == ["Args: lists ['limit'], not in the signature"]


def test_the_checker_finds_a_return_value_left_undescribed(sample: Any) -> None:
    assert problems(sample["no_returns"]) == ["returns int but has no Returns: or Yields: section"]


def test_the_checker_finds_a_summary_of_more_than_one_line(sample: Any) -> None:
    assert problems(sample["long_summary"]) == ["the summary is not one line"]


def test_the_checker_finds_a_missing_docstring(sample: Any) -> None:
    assert problems(sample["undocumented"]) == ["no docstring"]


def test_the_checker_reads_a_constructor_from_the_class_docstring(sample: Any) -> None:
    assert problems(sample["Options"]) == ["Args: does not list ['colour']"]

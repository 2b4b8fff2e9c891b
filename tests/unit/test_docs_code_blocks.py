"""Every Python code block of the docs is code that a test runs.

A how-to or tutorial page (docs/how-to/, docs/tutorial/) shows its code inline, so it reads the
same on a code host as on the site: each such block follows a ``<!-- code: PATH[:SECTION]
... -->`` line naming the example files (and sections) it is a copy of, and must equal them as
the site's snippets would show them (sections dedented, marker lines left out, joined by a
newline). The files are run by tests/integration/test_docs_howto_examples.py (docs/examples/
howto/) and tests/unit/test_docs_site.py (the tutorial's).

Any other ```python block of docs/**/*.md is either

- a snippet include (``--8<-- "docs/examples/....py"`` or ``...py:section``, pymdownx.snippets)
  of a file that exists, with that section marked in it: the files under docs/examples/howto/
  are run by tests/integration/test_docs_howto_examples.py, the tutorial's by
  tests/unit/test_docs_site.py; or
- one of the blocks run by name (RUN_BY_NAME): the testing page's two files, which
  tests/integration/test_testing_kit_examples.py writes into a folder and runs pytest on.

A ```python block of README.md starts with ``# NAME.py`` and is docs/examples/NAME.py without
its module docstring (GitHub shows no includes, so the README holds a copy, checked here),
or is an include as above.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from docs.site_files import shown_code
from tests.parsing import parse_source

ROOT = Path(__file__).resolve().parents[2]
HOWTO = ROOT / "docs" / "examples" / "howto"
HOWTO_TEST = ROOT / "tests" / "integration" / "test_docs_howto_examples.py"

# (page, first line of the block): blocks a test executes as they are on the page.
RUN_BY_NAME = {
    ("docs/how-to/testing.md", "# summaries.py"),
    ("docs/how-to/testing.md", "# test_summaries.py"),
}

_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*python\b.*$")
_INCLUDE = re.compile(r'^-+8<-+\s+"(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"$')
_NAMED = re.compile(r"^# (?P<name>\w+\.py)$")
_MARKER = re.compile(r"^[ \t]*<!-- code: (?P<paths>[^>]+?) -->[ \t]*$")
_ANY_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*\S.*$")
# The pages whose code is shown inline (a copy of its example file, checked here).
INLINE_PAGES = ("docs/how-to/", "docs/tutorial/")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lines: tuple[str, ...]  # the block's lines, without the fences and their indent
    # The files (and sections) the ``<!-- code: ... -->`` line before the fence names.
    copied_from: tuple[str, ...] = ()

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks(page: Path, root: Path = ROOT, *, any_language: bool = False) -> list[Block]:
    """The ```python blocks of a Markdown page (also inside lists: indented fences); with
    ``any_language``, every fenced block that names a language."""
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = (_ANY_FENCE_OPEN if any_language else _FENCE_OPEN).match(lines[i])
        if opened is None:
            i += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j].removeprefix(indent))
            j += 1
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        copied = tuple(marker["paths"].split()) if marker else ()
        blocks.append(Block(page.relative_to(root).as_posix(), i + 1, tuple(body), copied))
        i = j + 1
    return blocks


def inline_problem(block: Block, root: Path = ROOT) -> str | None:
    """Why a block of a how-to or tutorial page is not an exact copy of the example sections
    its ``<!-- code: ... -->`` line names; None if it is one."""
    if any(_INCLUDE.match(line.strip()) for line in block.lines):
        return (
            f"{block.where()}: a snippet include shows as a bare line on a code host; put the "
            "code inline after a '<!-- code: docs/examples/...py:section -->' line"
        )
    if not block.copied_from:
        if (block.page, block.lines[0].strip() if block.lines else "") in RUN_BY_NAME:
            return None
        return (
            f"{block.where()}: inline code with no '<!-- code: docs/examples/...py:section -->' "
            "line before it naming the file a test runs"
        )
    for ref in block.copied_from:
        problem = include_problem(Block(block.page, block.line, (f'--8<-- "{ref}"',)), root)
        if problem is not None:
            return problem
    if "\n".join(block.lines) != shown_code(block.copied_from, root):
        return (
            f"{block.where()}: differs from {' '.join(block.copied_from)}; copy the sections "
            "into the block again"
        )
    return None


def include_problem(block: Block, root: Path = ROOT) -> str | None:
    """Why a docs block is not a snippet include of an existing file (and section); None if
    it is one (a block may include several sections, blank lines between them)."""
    includes = [line for line in block.lines if line.strip()]
    if not includes:
        return f"{block.where()}: an empty python block"
    for line in includes:
        m = _INCLUDE.match(line.strip())
        if m is None:
            return (
                f"{block.where()}: inline code ({line.strip()[:50]!r}); put it in a file under "
                'docs/examples/ that a test runs and include it: --8<-- "docs/examples/...py:name"'
            )
        path = root / m["path"]
        if not path.is_file():
            return f"{block.where()}: includes {m['path']}, which does not exist"
        section = m["section"]
        if section is not None:
            text = path.read_text(encoding="utf-8")
            for end in ("start", "end"):
                if f"--8<-- [{end}:{section}]" not in text:
                    return f"{block.where()}: {m['path']} has no '# --8<-- [{end}:{section}]'"
    return None


def docs_block_problem(block: Block, root: Path = ROOT) -> str | None:
    if block.page.startswith(INLINE_PAGES):
        return inline_problem(block, root)
    if block.lines and (block.page, block.lines[0].strip()) in RUN_BY_NAME:
        return None
    return include_problem(block, root)


def without_docstring(source: str) -> str:
    """``source`` after its module docstring (and the blank lines after it)."""
    body = parse_source(source).body
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        source = "\n".join(source.splitlines()[first.end_lineno or 0 :])
    return source.strip("\n")


def readme_block_problem(block: Block, root: Path = ROOT) -> str | None:
    """Why a README block is not a copy of docs/examples/NAME.py named on its first line."""
    named = _NAMED.match(block.lines[0].strip()) if block.lines else None
    if named is None:
        if include_problem(block, root) is None:
            return None  # an include works on the site, though GitHub shows the bare line
        return f"{block.where()}: the first line is not '# NAME.py' naming docs/examples/NAME.py"
    example = root / "docs" / "examples" / named["name"]
    if not example.is_file():
        return f"{block.where()}: docs/examples/{named['name']} does not exist"
    shown = "\n".join(block.lines[1:]).strip("\n")
    if shown != without_docstring(example.read_text(encoding="utf-8")):
        return (
            f"{block.where()}: differs from docs/examples/{named['name']} without its "
            "docstring; copy the file into the block"
        )
    return None


def docs_pages(root: Path = ROOT) -> list[Path]:
    return sorted((root / "docs").rglob("*.md"))


def test_every_python_block_of_the_docs_is_an_included_file_or_run_by_name() -> None:
    blocks = [b for page in docs_pages() for b in python_blocks(page)]
    assert len(blocks) >= 15  # the walk found the how-to pages' blocks
    problems = [p for b in blocks if (p := docs_block_problem(b)) is not None]
    assert not problems, "\n".join(problems)


def test_every_code_copy_of_a_howto_or_tutorial_page_equals_its_example_file() -> None:
    pages = [p for p in docs_pages() if p.relative_to(ROOT).as_posix().startswith(INLINE_PAGES)]
    blocks = [b for page in pages for b in python_blocks(page, any_language=True)]
    copies = [b for b in blocks if b.copied_from]
    assert len(copies) >= 30  # the walk found the pages' copies
    problems = [p for b in copies if (p := inline_problem(b)) is not None]
    problems += [
        f"{b.where()}: a snippet include shows as a bare line on a code host; inline it"
        for b in blocks
        if any(_INCLUDE.match(line.strip()) for line in b.lines)
    ]
    assert not problems, "\n".join(problems)


def test_the_blocks_run_by_name_are_on_their_pages() -> None:
    found = {
        (b.page, b.lines[0].strip())
        for page in docs_pages()
        for b in python_blocks(page)
        if b.lines
    }
    assert found >= RUN_BY_NAME, RUN_BY_NAME - found


def test_every_howto_example_file_is_included_by_a_page_and_run_by_the_integration_test() -> None:
    blocks = [b for page in docs_pages() for b in python_blocks(page)]
    included = {
        m["path"] for b in blocks for line in b.lines if (m := _INCLUDE.match(line.strip()))
    } | {ref.partition(":")[0] for b in blocks for ref in b.copied_from}
    runner = HOWTO_TEST.read_text(encoding="utf-8")
    files = sorted(HOWTO.glob("*.py"))
    assert files
    for file in files:
        assert file.relative_to(ROOT).as_posix() in included, f"no page includes {file.name}"
        assert f'"{file.name}"' in runner, f"{HOWTO_TEST.name} never loads {file.name}"


def test_every_python_block_of_the_readme_is_a_named_docs_example() -> None:
    blocks = python_blocks(ROOT / "README.md")
    problems = [p for b in blocks if (p := readme_block_problem(b)) is not None]
    assert not problems, "\n".join(problems)


# -- the rules themselves, on a repository of their own ---------------------------------------


def write(root: Path, path: str, text: str) -> Path:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text, encoding="utf-8")
    return file


EXAMPLE = '"""The docstring."""\n\n# --8<-- [start:one]\nx = 1\n# --8<-- [end:one]\n'


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        ('```python\n--8<-- "docs/examples/x.py"\n```', None),
        ('```python\n--8<-- "docs/examples/x.py:one"\n\n--8<-- "docs/examples/x.py"\n```', None),
        ('  ```python\n  --8<-- "docs/examples/x.py:one"\n  ```', None),  # in a list item
        ('```python title="x.py"\n--8<-- "docs/examples/x.py"\n```', None),
        ('```python\n--8<-- "docs/examples/y.py"\n```', "does not exist"),
        ('```python\n--8<-- "docs/examples/x.py:two"\n```', "has no '# --8<-- [start:two]'"),
        ("```python\nx = 1\n```", "inline code"),
        ('```python\n--8<-- "docs/examples/x.py"\nx = 1\n```', "inline code"),
        ("```python\n```", "an empty python block"),
        ("```python\n# summaries.py\nx = 1\n```", "inline code"),  # run by name only on its page
    ],
)
def test_a_docs_block_passes_only_as_an_include_of_an_existing_file_and_section(
    tmp_path: Path, block: str, problem: str | None
) -> None:
    write(tmp_path, "docs/examples/x.py", EXAMPLE)
    page = write(tmp_path, "docs/design/page.md", f"# A page\n\n{block}\n\nText.\n")

    (found,) = python_blocks(page, tmp_path)
    answer = docs_block_problem(found, tmp_path)

    if problem is None:
        assert answer is None
    else:
        assert answer is not None and problem in answer, answer


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        ("<!-- code: docs/examples/x.py:one -->\n```python\nx = 1\n```", None),
        ("<!-- code: docs/examples/x.py:one -->\n```python\nx = 2\n```", "differs from"),
        ("<!-- code: docs/examples/x.py:two -->\n```python\nx = 1\n```", "has no"),
        ("<!-- code: docs/examples/y.py -->\n```python\nx = 1\n```", "does not exist"),
        ("```python\nx = 1\n```", "no '<!-- code:"),
        ('```python\n--8<-- "docs/examples/x.py:one"\n```', "bare line on a code host"),
        ("  <!-- code: docs/examples/x.py:one -->\n  ```python\n  x = 1\n  ```", None),
    ],
)
def test_a_howto_block_passes_only_as_an_exact_copy_of_the_example_it_names(
    tmp_path: Path, block: str, problem: str | None
) -> None:
    write(tmp_path, "docs/examples/x.py", EXAMPLE)
    page = write(tmp_path, "docs/how-to/page.md", f"# A page\n\n{block}\n\nText.\n")

    (found,) = python_blocks(page, tmp_path)
    answer = docs_block_problem(found, tmp_path)

    if problem is None:
        assert answer is None
    else:
        assert answer is not None and problem in answer, answer


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        ("```python\n# x.py\n# --8<-- [start:one]\nx = 1\n# --8<-- [end:one]\n```", None),
        ("```python\n# x.py\nx = 1\n```", "differs from docs/examples/x.py"),
        ("```python\n# y.py\nx = 1\n```", "does not exist"),
        ("```python\nx = 1\n```", "is not '# NAME.py'"),
        ('```python\n--8<-- "docs/examples/x.py:one"\n```', None),
    ],
)
def test_a_readme_block_passes_only_as_a_copy_of_the_named_example_without_its_docstring(
    tmp_path: Path, block: str, problem: str | None
) -> None:
    write(tmp_path, "docs/examples/x.py", EXAMPLE)
    readme = write(tmp_path, "README.md", f"# Project\n\n{block}\n")

    (found,) = python_blocks(readme, tmp_path)
    answer = readme_block_problem(found, tmp_path)

    if problem is None:
        assert answer is None
    else:
        assert answer is not None and problem in answer, answer


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository() -> None:
    # GitHub shows README.md from the repository: a link to a page the site generates
    # (docs/hooks.py) would lead nowhere there.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link and not link.startswith("mailto:")]
    assert len(local) > 20
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files the repository does not have: {missing}"

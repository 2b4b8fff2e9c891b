"""mkdocs hook: the files the built site carries beside its HTML pages.

- each page's markdown next to its HTML (``tutorial/index.md`` beside ``tutorial/index.html``),
  snippets (``--8<--``) included, the pages ``docs/hooks.py`` generates as generated;
- ``llms.txt`` (https://llmstxt.org): the site's name, its summary, then one section per
  top-level nav entry linking each page's markdown with the first sentence of its first
  paragraph; ``llms-full.txt``: every page's markdown, in nav order, in one file;
- ``javascripts/mermaid.min.js``: mermaid.js from ``.tools/mermaid/`` (``make tools`` fetches
  it from the npm registry), loaded before mkdocs-material's own code asks for it. Material
  loads mermaid from unpkg.com only when no ``window.mermaid`` exists, so with this file the
  diagrams render offline; without it the build still passes and says where the site will
  load mermaid from.

Registered under ``hooks:`` in ``mkdocs.yml``, after ``docs/hooks.py``. A page's markdown is
what mkdocs hands the renderer, with what the renderer would add written out as markdown:
each snippet's file, and for mkdocstrings' ``::: name`` the object's signature and docstring
(a class's public methods and properties too, unless its options say ``members: false``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import shutil
import sys
import textwrap
from enum import Enum
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure import StructureItem
from mkdocs.structure.files import Files
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
# The API text is this tree's docstrings (docs/hooks.py, loaded first, checks the same).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Where 'make tools' puts mermaid.js (see the Makefile's MERMAID_VERSION), and where the site
# serves it from.
MERMAID_SOURCE = ROOT / ".tools" / "mermaid" / "mermaid.min.js"
MERMAID_SITE_PATH = "javascripts/mermaid.min.js"

log = logging.getLogger("mkdocs.hooks.site_files")

# src_uri -> the page's markdown, and the nav as (section title, [(page title, src_uri)]);
# reset at the start of each build (mkdocs serve rebuilds in the same process).
_markdown: dict[str, str] = {}
_sections: list[tuple[str, list[tuple[str, str]]]] = []


def on_pre_build(config: MkDocsConfig) -> None:
    _markdown.clear()
    _sections.clear()


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    if MERMAID_SOURCE.is_file():
        if MERMAID_SITE_PATH not in [str(s) for s in config.extra_javascript]:
            config.extra_javascript.append(MERMAID_SITE_PATH)
    else:
        log.info(
            "%s is missing: diagrams load mermaid.js from unpkg.com when viewed "
            "('make tools' fetches it for offline use)",
            MERMAID_SOURCE.relative_to(ROOT),
        )
    return config


def on_nav(nav: Navigation, config: MkDocsConfig, files: Files) -> Navigation:
    for item in nav.items:
        pages = list(_nav_pages(item))
        if pages:
            _sections.append((str(item.title or pages[0][0]), pages))
    return nav


def _nav_pages(item: StructureItem) -> list[tuple[str, str]]:
    if isinstance(item, Page):
        return [(str(item.title or item.file.src_uri), item.file.src_uri)]
    if isinstance(item, Section):
        return [page for child in item.children for page in _nav_pages(child)]
    return []  # a Link (an external address) has no markdown here


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    _markdown[page.file.src_uri] = with_api_text(with_snippets(markdown))
    return markdown


def on_post_build(config: MkDocsConfig) -> None:
    site = Path(config.site_dir)
    for src_uri, markdown in _markdown.items():
        target = site / src_uri
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(markdown, encoding="utf-8")
    (site / "llms.txt").write_text(
        llms_txt(config.site_name, config.site_description or "", _sections, _markdown),
        encoding="utf-8",
    )
    (site / "llms-full.txt").write_text(llms_full_txt(_sections, _markdown), encoding="utf-8")
    if MERMAID_SOURCE.is_file():
        target = site / MERMAID_SITE_PATH
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(MERMAID_SOURCE, target)
        # mermaid is MIT-licensed: its notice travels with the copy.
        notice = MERMAID_SOURCE.with_name("LICENSE")
        if notice.is_file():
            shutil.copyfile(notice, target.with_name("mermaid.LICENSE.txt"))


# -- llms.txt ------------------------------------------------------------------------------


def llms_txt(
    name: str,
    summary: str,
    sections: list[tuple[str, list[tuple[str, str]]]],
    markdown: dict[str, str],
) -> str:
    lines = [f"# {name}", "", f"> {summary}", ""]
    lines += [
        "Each link is a page's markdown; llms-full.txt holds all of them in one file.",
        "",
    ]
    in_nav = {src_uri for _, pages in sections for _, src_uri in pages}
    # A page the nav leaves out is still a page of the site: listed last, by its heading.
    others = [(_heading(markdown[uri]) or uri, uri) for uri in sorted(set(markdown) - in_nav)]
    for title, pages in [*sections, *([("Other pages", others)] if others else [])]:
        lines += [f"## {title}", ""]
        for page_title, src_uri in pages:
            about = description(markdown.get(src_uri, ""))
            lines.append(f"- [{page_title}]({src_uri})" + (f": {about}" if about else ""))
        lines.append("")
    return "\n".join(lines)


def llms_full_txt(
    sections: list[tuple[str, list[tuple[str, str]]]], markdown: dict[str, str]
) -> str:
    in_nav = [src_uri for _, pages in sections for _, src_uri in pages]
    order = in_nav + sorted(set(markdown) - set(in_nav))
    parts = [
        f"<!-- {src_uri} -->\n\n{markdown[src_uri].strip()}\n"
        for src_uri in order
        if src_uri in markdown
    ]
    return "\n".join(parts)


_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
# A line that does not start a paragraph of prose.
_NOT_PROSE = re.compile(r"^\s*(#|```|~~~|\||:::|!!!|\?\?\?|-{1,}8<|<|>|[-*+] |\d+\. |---)")


def _heading(markdown: str) -> str | None:
    found = re.search(r"^# (.+)$", _COMMENT.sub("", markdown), re.M)
    return found.group(1).strip() if found else None


def description(markdown: str) -> str:
    """The first sentence of the page's first paragraph of prose, on one line."""
    paragraph: list[str] = []
    fenced = False
    for line in _COMMENT.sub("", markdown).splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        if paragraph and not line.strip():
            break
        if paragraph or (line.strip() and not _NOT_PROSE.match(line)):
            paragraph.append(line.strip())
    text = _LINK.sub(r"\1", " ".join(paragraph))
    sentence = re.match(r"(.+?[.!?])(?=\s|$)", text)
    return sentence.group(1) if sentence else text


# -- snippets ------------------------------------------------------------------------------

# pymdownx.snippets' one-line form, as mkdocs.yml configures it: paths from the repository root.
_SNIPPET = re.compile(r'^(?P<indent>\s*)-{1,}8<-{1,}\s+"(?P<path>[^"]+)"\s*$', re.M)


def with_snippets(markdown: str) -> str:
    """``markdown`` with each ``--8<-- "file"`` line replaced by the file, as the site shows it."""

    def include(match: re.Match[str]) -> str:
        name, _, section = match.group("path").partition(":")
        path = ROOT / name
        if not path.is_file():
            return match.group(0)  # the build fails on it anyway (check_paths)
        indent = match.group("indent")
        lines = path.read_text(encoding="utf-8").rstrip("\n").split("\n")
        if section:
            inside = section_lines(lines, section)
            if inside is None:
                return match.group(0)  # the build fails on it anyway
            lines = inside
        text = "\n".join(line for line in lines if not _SECTION_MARK.search(line))
        if section:  # dedent_subsections: true in mkdocs.yml
            text = textwrap.dedent(text)
        return "\n".join(indent + line if line else line for line in text.split("\n"))

    return _SNIPPET.sub(include, markdown)


# A section's markers in an included file: ``# --8<-- [start:name]`` ... ``[end:name]``.
_SECTION_MARK = re.compile(r"-{1,}8<-{1,}\s*\[(?:start|end):[^\]]+\]")


def section_lines(lines: list[str], section: str) -> list[str] | None:
    """The lines between a section's start and end markers, or None when it has none."""
    start = re.compile(rf"-{{1,}}8<-{{1,}}\s*\[start:{re.escape(section)}\]")
    end = re.compile(rf"-{{1,}}8<-{{1,}}\s*\[end:{re.escape(section)}\]")
    begin = next((i for i, line in enumerate(lines) if start.search(line)), None)
    if begin is None:
        return None
    stop = next((i for i, line in enumerate(lines) if i > begin and end.search(line)), None)
    return lines[begin + 1 : stop]


def shown_code(paths: tuple[str, ...], root: Path = ROOT) -> str | None:
    """What the site shows for ``--8<--`` includes of ``paths`` (one a line), as
    pymdownx.snippets does with mkdocs.yml's options; None if a file or section is missing."""
    parts: list[str] = []
    for ref in paths:
        name, _, section = ref.partition(":")
        file = root / name
        if not file.is_file():
            return None
        lines = file.read_text(encoding="utf-8").rstrip("\n").split("\n")
        if section:
            inside = section_lines(lines, section)
            if inside is None:
                return None
            lines = inside
        text = "\n".join(line for line in lines if not _SECTION_MARK.search(line))
        parts.append(textwrap.dedent(text) if section else text)  # dedent_subsections
    return "\n".join(parts)


# -- mkdocstrings' ::: lines ---------------------------------------------------------------

# "::: weclaw_mq.App" and the indented options below it.
_DIRECTIVE = re.compile(r"^::: (?P<name>[\w.]+)[ \t]*\n(?P<options>(?:[ \t]+\S.*(?:\n|$))*)", re.M)


def with_api_text(markdown: str) -> str:
    """``markdown`` with each ``::: name`` written out: the object's signature and docstring."""

    def document(match: re.Match[str]) -> str:
        found = _resolve(match.group("name"))
        if found is None:
            return match.group(0)  # mkdocstrings fails the build on it
        options = match.group("options")
        members = not re.search(r"^\s*members:\s*false\s*$", options, re.M)
        inherited = bool(re.search(r"^\s*inherited_members:\s*true\s*$", options, re.M))
        text = _api_text(match.group("name"), found, members=members, inherited=inherited)
        return "\n".join(text) + "\n"

    return _DIRECTIVE.sub(document, markdown)


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                found = getattr(found, attr)
        except AttributeError:
            return None
        return found
    return None


def _api_text(dotted: str, found: Any, *, members: bool, inherited: bool = False) -> list[str]:
    name = dotted.rpartition(".")[2]
    kind = "class " if inspect.isclass(found) else "def " if callable(found) else ""
    lines = [f"### `{name}`", "", "```python", f"{kind}{name}{_signature(found)}", "```", ""]
    if inspect.isclass(found):
        # Its own docstring only: inspect.getdoc gives a class with none its base class's.
        doc = inspect.cleandoc(vars(found).get("__doc__") or "")
    else:
        doc = inspect.getdoc(found) or ""
    if doc:
        lines += [doc, ""]
    if inspect.isclass(found) and issubclass(found, Enum):
        lines += ["Members: " + ", ".join(f"`{m.name}` (`{m.value!r}`)" for m in found), ""]
    if members and inspect.isclass(found):
        for attr, value in _members(found, inherited=inherited).items():
            function = (
                value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            )
            if attr.startswith("_") or not inspect.isfunction(function):
                continue
            shown = "" if isinstance(value, property) else _signature(function)
            lines += [f"#### `{name}.{attr}`", "", "```python", f"{name}.{attr}{shown}", "```", ""]
            method_doc = inspect.getdoc(function)
            if method_doc:
                lines += [method_doc, ""]
    return lines


def _members(cls: type, *, inherited: bool) -> dict[str, Any]:
    """The class's own members; with ``inherited``, then those of its bases in this package
    (the App's topics in ``weclaw_mq/facade/``), as mkdocstrings' ``inherited_members``."""
    found = dict(vars(cls))
    if inherited:
        for base in cls.__mro__[1:]:
            if base.__module__.startswith("weclaw_mq."):
                for attr, value in vars(base).items():
                    found.setdefault(attr, value)
    return found


def _signature(found: Any) -> str:
    """As mkdocstrings shows it: no ``self``, no ``-> None`` on a class, annotations unquoted."""
    if not callable(found):
        return ""
    if inspect.isclass(found) and (
        "__init__" not in vars(found) or getattr(found, "_is_protocol", False)
    ):
        return ""  # an inherited constructor (an enum, a pydantic model) or a Protocol's: noise
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # a builtin, or an enum, without one
        return ""
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls") and not inspect.isclass(found):
        signature = signature.replace(parameters=params[1:])
    if inspect.isclass(found):
        signature = signature.replace(return_annotation=inspect.Signature.empty)
    # With postponed annotations each one is a string: 'str' reads as str.
    return re.sub(
        r"(?<=: )'([^']*)'|(?<=-> )'([^']*)'", lambda m: m.group(1) or m.group(2), str(signature)
    )

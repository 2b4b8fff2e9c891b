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
taken as mkdocs hands it to the renderer: mkdocstrings' ``::: name`` lines stay as written.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure import StructureItem
from mkdocs.structure.files import Files
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
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
    _markdown[page.file.src_uri] = with_snippets(markdown)
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
    for title, pages in sections:
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
        path = ROOT / match.group("path")
        if not path.is_file():
            return match.group(0)  # the build fails on it anyway (check_paths)
        indent = match.group("indent")
        text = path.read_text(encoding="utf-8").rstrip("\n")
        return "\n".join(indent + line if line else line for line in text.split("\n"))

    return _SNIPPET.sub(include, markdown)

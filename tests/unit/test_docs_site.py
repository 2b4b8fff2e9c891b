"""The documentation site builds under ``mkdocs build --strict``, and its generated pages
(docs/hooks.py) name everything the code has: every CLI command, every setting's
environment variable, every task status of the transition table. The tutorial's included
handler runs as the page says. The site carries llms.txt, llms-full.txt and each page's
markdown (docs/site_files.py), and its Mermaid diagram renders in headless Chromium from the
site's own mermaid.js, with the CDN blocked."""

from __future__ import annotations

import html
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.support.ui import WebDriverWait

import weclaw_mq
from tests.conftest import load_module
from tests.integration.browser import chromium  # noqa: F401  (the fixture)
from tests.unit import test_layers
from weclaw_mq import Settings, TaskStatus, errors
from weclaw_mq.cli.tree import built_command, walk_commands
from weclaw_mq.contract import headers, naming
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.state.transitions import TRANSITIONS
from weclaw_mq.testing import TestBroker

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # mkdocs-material prints a banner about its successor on every build otherwise.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
            cwd=ROOT,  # the snippets' base_path and mkdocs.yml are the repository root's
            env=env,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mkdocs build --strict took over {BUILD_TIMEOUT_S} s:\n{e.stderr!r}")
    assert run.returncode == 0, (
        f"mkdocs build --strict failed (exit {run.returncode}); without mkdocs: "
        f"pip install -e '.[dev]'\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    )
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's text with tags removed and entities decoded."""
    raw = (site / page).read_text(encoding="utf-8")
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_the_cli_page_names_every_command_of_the_typer_app(site: Path) -> None:
    text = page_text(site, "operations/cli.html")
    commands = [" ".join(path) for path, _ in walk_commands(built_command())]
    assert len(commands) > 10  # the walk reached the subcommands of dlq and outbox
    missing = [c for c in commands if c not in text]
    assert not missing, f"operations/cli.md names no {missing}"


def test_the_configuration_page_names_every_settings_environment_variable(site: Path) -> None:
    text = page_text(site, "operations/configuration.html")
    variables = [f"{Settings.env_prefix}{name.upper()}" for name in Settings.model_fields]
    missing = [v for v in variables if v not in text]
    assert not missing, f"operations/configuration.md names no {missing}"
    # Each setting's text is the comment above its field in settings.py.
    undescribed = [v for v in variables if re.search(rf"{v}\W*\s+No description", text)]
    assert not undescribed, f"settings.py has no comment above {undescribed}"


# user:password@ in a URL, unless the password is redact_url's ***.
URL_PASSWORD = re.compile(r"://[^/\s:@]*:(?!\*\*\*@)[^/\s@]+@")


def test_the_generated_pages_show_no_password(site: Path) -> None:
    for page in ("operations/configuration.html", "operations/cli.html"):
        shown = URL_PASSWORD.findall(page_text(site, page))
        assert not shown, f"{page} shows a URL's password: {shown}"
    # The default AMQP URL carries guest's password; the page shows it redacted.
    assert "amqp://guest:***@localhost" in page_text(site, "operations/configuration.html")


def test_the_state_diagram_names_every_status_of_the_transition_table(site: Path) -> None:
    raw = (site / "design/task-states.html").read_text(encoding="utf-8")
    diagrams = re.findall(r'<pre class="mermaid"><code>(.*?)</code></pre>', raw, re.S)
    assert len(diagrams) == 1, "design/task-states.md has no Mermaid diagram"
    diagram = html.unescape(diagrams[0])
    assert diagram.startswith("stateDiagram-v2")
    statuses = {s for s in TRANSITIONS if s is not None}
    statuses |= {s for allowed in TRANSITIONS.values() for s in allowed}
    assert statuses == set(TaskStatus)
    missing = [s.value for s in TaskStatus if not re.search(rf"\b{s.value}\b", diagram)]
    assert not missing, f"the state diagram names no {missing}"
    for current, allowed in TRANSITIONS.items():  # each arrow is in the table, and back
        source = "[*]" if current is None else current.value
        drawn = set(re.findall(rf"^\s*{re.escape(source)} --> (\w+)$", diagram, re.M))
        if current is None and allowed == frozenset(TaskStatus) and not drawn:
            continue  # "no record -> any status" is said in words, not drawn
        assert drawn == {s.value for s in allowed if s is not current}, source


def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    raw = (site / "reference/api.html").read_text(encoding="utf-8")
    documented = set(re.findall(r'id="weclaw_mq\.(\w+)"', raw))
    # ResultStore is TaskStore under its former name: the page says so in words.
    missing = [n for n in weclaw_mq.__all__ if n not in documented and n != "ResultStore"]
    assert not missing, f"reference/api.md has no '::: weclaw_mq.NAME' for {missing}"
    assert "ResultStore" in page_text(site, "reference/api.html")


def test_the_tutorial_includes_its_example_files(site: Path) -> None:
    text = page_text(site, "tutorial/index.html")
    for example in ("first_handler.py", "publish_first.py"):
        source = (ROOT / "docs" / "examples" / example).read_text(encoding="utf-8")
        # Highlighting splits the code into spans; every source line survives as text.
        missing = [line for line in source.splitlines() if line.strip() and line not in text]
        assert not missing, f"tutorial/index.md shows {example} without {missing[:3]}"


def load_first_handler() -> ModuleType:
    return load_module(ROOT / "docs" / "examples" / "first_handler.py", "docs_first_handler")


async def test_the_tutorials_handler_replies_and_rejects_an_empty_prompt() -> None:
    example = load_first_handler()
    async with TestBroker(example.app) as broker:
        ok = await example.app.publish("ai-replies", example.Prompt(text="Write a haiku"))
        empty = await example.app.publish("ai-replies", {"text": "  "})
        await broker.run_until_idle()
        done = await example.app.status(ok)
        rejected = await example.app.status(empty)
    assert done is not None and done.status is TaskStatus.SUCCEEDED
    assert done.result == {"reply": "echo: Write a haiku"}
    assert rejected is not None and rejected.status is TaskStatus.DEAD_LETTERED
    assert rejected.reason == "rejected"


def test_the_errors_page_lists_every_error_and_dead_letter_reason(site: Path) -> None:
    text = page_text(site, "reference/errors.html")
    ours = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, Exception) and c.__module__ == errors.__name__
    ]
    assert len(ours) > 30
    missing = [c.__name__ for c in ours if f"{c.__name__} ({c.error_type})" not in text]
    assert not missing, f"reference/errors.md's generated tree has no {missing}"
    assert "<!-- generated:" not in text
    absent = [r.value for r in DeadLetterReason if not re.search(rf"\b{r.value}\b", text)]
    assert not absent, f"reference/errors.md names no dead-letter reason {absent}"


def test_the_wire_page_shows_every_header_and_the_names_the_code_derives(site: Path) -> None:
    text = page_text(site, "reference/wire.html")
    values = [v for k, v in vars(headers).items() if k.isupper() and isinstance(v, str)]
    missing = [v for v in values if v != headers.PREFIX and v not in text]
    assert not missing, f"reference/wire.md has no header {missing}"
    for name in (
        naming.dlq_name("ai-replies"),
        naming.lane_queue_name("ai-replies", "urgent"),
        naming.ladder_queue_name(5_000),
        naming.parking_queue_name(),
        naming.guard_key("ai-replies", "T"),
        naming.state_key("ai-replies", "T"),
        naming.stream_key("T"),
        naming.inbox_key("S"),
    ):
        assert name in text, f"reference/wire.md does not show {name}"


def test_the_layout_page_draws_the_layers_of_the_import_contract(site: Path) -> None:
    raw = html.unescape((site / "design/architecture.html").read_text(encoding="utf-8"))
    (diagram,) = re.findall(r'<pre class="mermaid"><code>(.*?)</code></pre>', raw, re.S)
    for layer, lower in itertools.pairwise(test_layers.contract_layers()):
        for name in layer:  # every room, and an arrow to each room of the layer below
            for below in lower:
                assert f"{name} --> {below}" in diagram
    for module in sorted(Path(weclaw_mq.__file__).parent.glob("*/*.py")):
        if module.name != "__init__.py":  # every module of every room, with its first line
            assert f"<code>{module.name}</code>: " in raw, f"{module} is not on the page"


def test_the_topology_page_draws_the_names_the_code_derives(site: Path) -> None:
    raw = (site / "design/topology.html").read_text(encoding="utf-8")
    diagrams = re.findall(r'<pre class="mermaid"><code>(.*?)</code></pre>', raw, re.S)
    assert len(diagrams) == 1, "design/topology.md has no generated Mermaid diagram"
    diagram = html.unescape(diagrams[0])
    for name in (
        "ai-replies",
        naming.dlq_name("ai-replies"),
        naming.ladder_queue_name(5_000),
        naming.RETURN_EXCHANGE,
        naming.parking_queue_name(),
    ):
        assert f'"{name}"' in diagram, f"the topology diagram does not draw {name}"


# The how-to pages' includes of a file's section: --8<-- "docs/examples/howto/x.py:name".
_SECTION_INCLUDE = re.compile(r'^--8<-- "(docs/examples/howto/[\w/]+\.py):([\w-]+)"$', re.M)
# A how-to page's inline copy names its sections on the line before the block.
_COPIED_FROM = re.compile(r"^[ \t]*<!-- code: ([^>]+?) -->[ \t]*$", re.M)
_HOWTO_SECTION = re.compile(r"^(docs/examples/howto/[\w/]+\.py):([\w-]+)$")


def shown_sections(markdown: str) -> list[tuple[str, str]]:
    """The (file, section) pairs a page shows: its includes and its inline copies."""
    copied = [
        (m[1], m[2])
        for refs in _COPIED_FROM.findall(markdown)
        for ref in refs.split()
        if (m := _HOWTO_SECTION.match(ref))
    ]
    return [*_SECTION_INCLUDE.findall(markdown), *copied]


def section_lines(path: Path, name: str) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index(next(ln for ln in lines if ln.strip() == f"# --8<-- [start:{name}]"))
    end = lines.index(next(ln for ln in lines if ln.strip() == f"# --8<-- [end:{name}]"))
    return lines[start + 1 : end]


def test_the_how_to_pages_show_their_example_sections_whole_and_at_the_margin(
    site: Path,
) -> None:
    shown = 0
    for page in sorted((ROOT / "docs").rglob("*.md")):
        built = page.relative_to(ROOT / "docs").with_suffix(".html")
        for file, name in shown_sections(page.read_text(encoding="utf-8")):
            text = page_text(site, built.as_posix())
            lines = [ln for ln in section_lines(ROOT / file, name) if ln.strip()]
            margin = min(len(ln) - len(ln.lstrip()) for ln in lines)
            # dedent_subsections: a section inside a function shows at the left margin.
            missing = [ln for ln in lines if "\n" + ln[margin:] not in "\n" + text]
            assert not missing, f"{built} shows {file}:{name} without {missing[:3]}"
            assert "--8<--" not in text, f"{built} shows a snippet marker"
            shown += 1
    assert shown >= 14


class _NavLoader(yaml.SafeLoader):
    """mkdocs.yml as plain data: its ``!!python/name:`` tags (the mermaid fence) read as None."""


_NavLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav_pages() -> list[str]:
    """Every page of mkdocs.yml's nav (its markdown path), in order."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_NavLoader)

    def walk(item: Any) -> Iterator[str]:
        if isinstance(item, str):
            if item.endswith(".md"):
                yield item
        elif isinstance(item, list):
            for child in item:
                yield from walk(child)
        elif isinstance(item, dict):
            for child in item.values():
                yield from walk(child)

    return list(walk(config["nav"]))


LLMS_LINK = re.compile(r"^- \[(?P<title>[^\]]+)\]\((?P<path>[^)]+)\)(?::\s*(?P<about>.*))?$", re.M)


def test_llms_txt_links_every_nav_page_to_its_markdown_with_a_description(site: Path) -> None:
    text = (site / "llms.txt").read_text(encoding="utf-8")
    lines = text.splitlines()
    # llmstxt.org: the name as the one H1, then a blockquote summary, then H2 file lists.
    assert lines[0] == "# weclaw_mq"
    assert next(line for line in lines[1:] if line.strip()).startswith("> ")
    assert [line for line in lines if line.startswith("# ")] == ["# weclaw_mq"]
    assert any(line.startswith("## ") for line in lines)
    links = {m["path"]: m for m in LLMS_LINK.finditer(text)}
    pages = nav_pages()
    assert len(pages) >= 8
    missing = [p for p in pages if p not in links]
    assert not missing, f"llms.txt links no {missing}"
    for path, link in links.items():
        assert (site / path).is_file(), f"llms.txt links {path}, which the built site lacks"
        assert (site / path).with_suffix(".html").is_file(), f"{path} has no HTML page beside it"
        about = link["about"] or ""
        assert len(about) > 15 and "\n" not in about, f"llms.txt: {path} has no description"
    # The generated pages' markdown is what the site shows, not a placeholder.
    assert "# CLI reference" in (site / "operations/cli.md").read_text(encoding="utf-8")


def test_llms_full_txt_holds_every_pages_markdown_snippets_included(site: Path) -> None:
    full = (site / "llms-full.txt").read_text(encoding="utf-8")
    for page in nav_pages():
        marker = f"<!-- {page} -->"
        assert marker in full, f"llms-full.txt has no {page}"
        copy = (site / page).read_text(encoding="utf-8").strip()
        assert copy in full, f"llms-full.txt holds another text of {page} than {page} in the site"
    assert "stateDiagram-v2" in full  # the generated task-states page, as rendered markdown
    assert "# Configuration reference" in full
    # Snippets are included as the site shows them: the tutorial's handler, the changelog.
    handler = (ROOT / "docs" / "examples" / "first_handler.py").read_text(encoding="utf-8")
    assert handler.strip().splitlines()[-1] in full
    assert "--8<--" not in full
    assert "## [Unreleased]" in full
    # The API page's mkdocstrings lines as the objects' signatures and docstrings.
    assert not re.search(r"^::: ", full, re.M)
    assert "#### `App.publish`" in full
    assert weclaw_mq.App.publish.__doc__ is not None
    first_line = weclaw_mq.App.publish.__doc__.strip().splitlines()[0]
    assert first_line in full
    assert not re.search(r" at 0x[0-9a-f]+", full), "a default shown by its address"


# mkdocs-material draws each diagram into a closed shadow root; opened here (before the page's
# scripts run) so the test can read the SVG. Nothing else of the page changes.
OPEN_SHADOW_ROOTS_JS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
  return attach.call(this, {...init, mode: "open"});
};
"""
DIAGRAM_SVG_TEXT_JS = """
const host = document.querySelector("div.mermaid");
const svg = host && host.shadowRoot && host.shadowRoot.querySelector("svg");
return svg ? svg.textContent : null;
"""
# Every script the page holds, the ones mkdocs-material adds later (its unpkg.com loader) too.
LOADED_SCRIPTS_JS = "return [...document.scripts].map((s) => s.src).filter((src) => src);"
MERMAID_RENDER_WAIT_S = 30
SCREENSHOT = Path("/tmp/docsdrift_states.png")


def test_the_state_diagram_renders_offline_with_the_local_mermaid(
    site: Path,
    chromium: webdriver.Chrome,  # noqa: F811
) -> None:
    local = site / "javascripts" / "mermaid.min.js"
    if not local.is_file():
        pytest.fail(
            "the site has no javascripts/mermaid.min.js, so its diagrams would load mermaid from "
            "unpkg.com: run 'make tools' (npm pack mermaid into .tools/mermaid/), then the test",
            pytrace=False,
        )
    page = site / "design" / "task-states.html"
    assert "javascripts/mermaid.min.js" in page.read_text(encoding="utf-8")
    # Offline as a user without internet is: a CDN request fails instead of being answered.
    chromium.execute_cdp_cmd("Network.enable", {})
    chromium.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*unpkg.com*", "*jsdelivr.net*"]})
    chromium.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": OPEN_SHADOW_ROOTS_JS}
    )
    chromium.set_window_size(1000, 1300)
    chromium.get(page.as_uri())
    try:
        text = WebDriverWait(chromium, MERMAID_RENDER_WAIT_S, poll_frequency=0.1).until(
            lambda driver: driver.execute_script(DIAGRAM_SVG_TEXT_JS)
        )
    except TimeoutException:
        source = chromium.execute_script(
            "const p = document.querySelector('pre.mermaid'); return p && p.textContent;"
        )
        pytest.fail(
            f"no Mermaid SVG within {MERMAID_RENDER_WAIT_S} s on {page}; the diagram is still "
            f"source: {source!r}; scripts loaded: {chromium.execute_script(LOADED_SCRIPTS_JS)}"
        )
    missing = [s.value for s in TaskStatus if s.value not in text]
    assert not missing, f"the rendered state diagram names no {missing}: {text!r}"
    loaded = chromium.execute_script(LOADED_SCRIPTS_JS)
    assert any(name.endswith("/javascripts/mermaid.min.js") for name in loaded), loaded
    assert not [name for name in loaded if "unpkg.com" in name], "mermaid came from the CDN"
    # The whole diagram in the picture, below the page's fixed header.
    chromium.execute_script(
        "const top = document.querySelector('div.mermaid').getBoundingClientRect().top;"
        "window.scrollTo(0, window.scrollY + top - 70);"
    )
    chromium.save_screenshot(str(SCREENSHOT))


def rendered_diagram_text(chromium: webdriver.Chrome, page: Path) -> str:  # noqa: F811
    """The text of ``page``'s first Mermaid diagram as Chromium draws it, offline."""
    chromium.execute_cdp_cmd("Network.enable", {})
    chromium.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*unpkg.com*", "*jsdelivr.net*"]})
    chromium.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": OPEN_SHADOW_ROOTS_JS}
    )
    chromium.get(page.as_uri())
    try:
        text: str = WebDriverWait(chromium, MERMAID_RENDER_WAIT_S, poll_frequency=0.1).until(
            lambda driver: driver.execute_script(DIAGRAM_SVG_TEXT_JS)
        )
    except TimeoutException:
        pytest.fail(f"no Mermaid SVG within {MERMAID_RENDER_WAIT_S} s on {page}", pytrace=False)
    return text


@pytest.mark.parametrize(
    ("page", "names"),
    [
        ("design/topology.html", ("ai-replies.dlq", "weclaw_mq.delay.5s", "weclaw_mq.return")),
        ("how-to/streaming.html", ("Browser", "RabbitMQ", "Worker", "Redis", "final event")),
        ("design/architecture.html", ("testing/", "worker/", "policy/", "errors.py")),
    ],
)
def test_the_topology_and_reply_path_diagrams_render_offline(
    site: Path,
    chromium: webdriver.Chrome,  # noqa: F811
    page: str,
    names: tuple[str, ...],
) -> None:
    if not (site / "javascripts" / "mermaid.min.js").is_file():
        pytest.fail("the site has no local mermaid.js: run 'make tools'", pytrace=False)
    text = rendered_diagram_text(chromium, site / page)
    missing = [n for n in names if n not in text]
    assert not missing, f"the rendered diagram of {page} shows no {missing}: {text!r}"

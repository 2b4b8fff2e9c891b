"""Docs that cannot drift: every name the markdown gives the reader exists in the code.

Read: README.md, ops/RUNBOOK.md and every docs/**/*.md on disk (the generated pages of
docs/hooks.py are drawn from the code and are not files). Checked, each against a set built
from the code, never a hand list:

- ``weclaw-mq <command> [<sub>] ... --option`` in code blocks and inline code: the command
  path exists in the typer app (walked by ``weclaw_mq.cli.tree``) and each option is one of
  that command's (``--help`` anywhere; the root's own before the first command);
- every ``WECLAW_MQ_*`` name: a ``Settings`` field's variable, a CLI option's ``envvar``, or
  one the package reads itself (``os.environ`` / ``os.getenv`` in weclaw_mq/, found with
  ``ast``); a name ending in ``_`` is a prefix (``WECLAW_MQ_AMQP_TLS_*``) and must start one;
- every ``weclaw_mq.<Name>``: a stable error type (``failures.stable_error_types``) or a name
  the package exports; every entry of a table's "reason" column: a DLQ reason
  (``admin.dlq_message.DEAD_LETTER_REASONS``);
- every ``weclaw_mq_*`` metric: one ``Metrics`` exports, with the series suffixes Prometheus
  gives a counter (``_total``, ``_created``) or a histogram (``_bucket``, ``_sum``,
  ``_count``, ``_created``).

Each failure names the file, the line and what is missing there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import weclaw_mq
from tests.parsing import parse_source
from weclaw_mq import Settings
from weclaw_mq.admin import asyncapi
from weclaw_mq.admin.dlq_message import DEAD_LETTER_REASONS
from weclaw_mq.cli.tree import PROGRAM, built_command, walk_commands
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.policy.failures import stable_error_types

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "weclaw_mq"

# Names the docs may mention although the code has none of them. Empty by design: a stale
# name is fixed in the docs (or the code), not listed here. Entries: (file, name).
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "ops" / "RUNBOOK.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str  # the name as the docs wrote it
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}: {self.problem}"


# -- the markdown --------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line, code) for each logical line of a fenced block (``\\`` continuations joined)
    and each inline code span (which may run over a line break, never a blank line)."""
    lines = text.split("\n")
    prose = list(lines)  # the text with every fenced line blanked, so line numbers hold
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for number, line in enumerate(lines, 1):
        opened = FENCE.match(line)
        if fence is None:
            if opened:
                fence = opened.group(1)
                prose[number - 1] = ""
            continue
        prose[number - 1] = ""
        if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
            fence = None
            continue
        start, code = pending if pending else (number, "")
        code += line
        if code.endswith("\\"):
            pending = (start, code[:-1] + " ")
            continue
        pending = None
        yield start, code
    joined = "\n".join(prose)
    for match in INLINE.finditer(joined):
        code = match.group(2)
        if "\n\n" not in code:
            yield joined.count("\n", 0, match.start()) + 1, code.replace("\n", " ")


def table_columns(text: str, word: str) -> Iterator[tuple[int, str]]:
    """(line, cell) for each body cell of every table column whose header holds ``word``."""
    lines = text.split("\n")
    for i in range(len(lines) - 1):
        header, rule = lines[i].strip(), lines[i + 1].strip()
        if not (header.startswith("|") and re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", rule)):
            continue
        if i > 0 and lines[i - 1].strip().startswith("|"):
            continue  # not a header: the row above belongs to the same table
        names = _cells(header)
        wanted = [n for n, name in enumerate(names) if word in name.lower()]
        for j in range(i + 2, len(lines)):
            row = lines[j].strip()
            if not row.startswith("|"):
                break
            cells = _cells(row)
            for n in wanted:
                if n < len(cells):
                    yield j + 1, cells[n]


def _cells(row: str) -> list[str]:
    # A \| inside a cell is text, not a border.
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# -- what the code has ---------------------------------------------------------------------


@cache
def commands() -> dict[tuple[str, ...], Any]:
    return dict(walk_commands(built_command()))


def option_names(command: Any) -> dict[str, bool]:
    """Each option of ``command`` (long, short, ``--no-...``): whether it is a flag."""
    found: dict[str, bool] = {}
    for param in command.params:
        if param.param_type_name == "option":
            flag = bool(getattr(param, "is_flag", False) or getattr(param, "count", False))
            for name in (*param.opts, *param.secondary_opts):
                found[name] = flag
    return found


@cache
def environment_variables() -> frozenset[str]:
    """Every variable the code reads: Settings fields, CLI ``envvar=``, and os.environ."""
    found = {f"{Settings.env_prefix}{name.upper()}" for name in Settings.model_fields}
    for _, command in walk_commands(built_command()):
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            found.update([envvar] if isinstance(envvar, str) else envvar or [])
    for source in sorted(PACKAGE.rglob("*.py")):
        found |= environment_reads(source.read_text(encoding="utf-8"))
    return frozenset(found)


def environment_reads(source: str) -> set[str]:
    """Names read with ``os.environ.get/[]/pop/setdefault`` or ``os.getenv``: a literal, or a
    module-level constant holding one."""
    tree = parse_source(source)
    constants: dict[str, object] = {}
    for statement in tree.body:
        target = value = None
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign):
            target, value = statement.target, statement.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            constants[target.id] = value.value

    def named(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        found = constants.get(node.id) if isinstance(node, ast.Name) else None
        return found if isinstance(found, str) else None

    def is_environ(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    reads: set[str] = set()
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            reads_environ = isinstance(func, ast.Attribute) and (
                (func.attr in ("get", "pop", "setdefault") and is_environ(func.value))
                or func.attr == "getenv"
            )
            if reads_environ or (isinstance(func, ast.Name) and func.id == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        name = named(key) if key is not None else None
        if name is not None:
            reads.add(name)
    return reads


@cache
def metric_names() -> frozenset[str]:
    """Every series name ``Metrics`` exposes, as a scrape would show it."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
    }
    found = set()
    for family in Metrics().collect():
        found.add(family.name)
        found.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    return frozenset(found)


# -- the checks ----------------------------------------------------------------------------

# weclaw-mq where a shell would run it: first on the line (a path before it allowed), or after
# a separator, a variable assignment, a prompt or a word that runs a command.
INVOCATION = re.compile(r"(?<![\w./\-])(?:[\w.\-~]*/)*weclaw-mq(?=\s|$)")
COMMAND_POSITION = re.compile(
    r"(?:^|[;&|('\"]|\$|\b(?:exec|sudo|time|nohup|env|then|do)|\w+=\S*|:|^\s*-)\s*$"
)
# Where the invocation ends: a comment, a pipe, a list of commands, a redirect, a subshell.
END = {"#", "|", "||", "&&", "&", ";", ">", ">>", "2>", "2>&1", ")"}


def check_cli(path: str, text: str) -> Iterator[Finding]:
    for line, code in code_spans(text):
        for match in INVOCATION.finditer(code):
            before = code[: match.start()]
            if not COMMAND_POSITION.search(before):
                continue  # an argument (pip install weclaw-mq), not the command
            tokens = []
            for token in code[match.end() :].split():
                if token in END or token.startswith("#"):
                    break
                tokens.append(token)
            problem = invocation_problem(tokens)
            if problem is not None:
                shown = " ".join([PROGRAM, *tokens])
                yield Finding(path, line, f"`{shown}`", problem)


def invocation_problem(tokens: list[str]) -> str | None:
    """What in ``weclaw-mq <tokens>`` the CLI does not have, or None."""
    tree = commands()
    at: tuple[str, ...] = (PROGRAM,)
    positional = False
    take_value = False
    reason_next = False
    for raw in tokens:
        token = re.sub(r"[\])}.,:;`'\"]+$", "", re.sub(r"^[\[({`'\"]+", "", raw))
        if reason_next:
            reason_next = False
            if not reason_known(token):
                return (
                    f"--reason {token}: not a DLQ reason ({', '.join(sorted(DEAD_LETTER_REASONS))})"
                )
        if take_value:
            take_value = False
            continue
        if token in ("", "-", "--"):
            continue
        if token.startswith("-") and not token[1].isdigit():
            for option in re.split(r"[/|]", token):
                name, _, value = option.partition("=")
                if name in ("--reason", "-r") and value and not reason_known(value):
                    return f"{option}: not a DLQ reason ({', '.join(sorted(DEAD_LETTER_REASONS))})"
                if not name.startswith("-") or name == "--help":
                    continue
                options = option_names(tree[at])
                if name not in options:
                    where = " ".join(at)
                    known = ", ".join(sorted(o for o in options if o.startswith("--")))
                    return f"'{where}' has no option {name} (it has: {known or 'none'})"
                take_value = getattr(tree[at], "commands", None) is not None and not options[name]
                reason_next = name in ("--reason", "-r") and "=" not in option
            continue
        group = getattr(tree[at], "commands", None)
        if group is None or positional:
            positional = True  # an argument or a placeholder: not checked
            continue
        if (*at, token) in tree:
            at = (*at, token)
        elif token.isupper() or token.startswith("<"):
            return None  # a placeholder (COMMAND, <command>): nothing more to check
        else:
            known = ", ".join(group)
            return f"'{' '.join(at)}' has no command '{token}' (it has: {known})"
    return None


def reason_known(value: str) -> bool:
    """A DLQ reason, or a placeholder for one (``R``, ``REASON``)."""
    return not value or value.isupper() or value in DEAD_LETTER_REASONS


ENV_NAME = re.compile(r"\bWECLAW_MQ_[A-Z0-9_]+")


def check_environment(path: str, text: str) -> Iterator[Finding]:
    known = environment_variables()
    for match in ENV_NAME.finditer(text):
        name = match.group()
        if name in known:
            continue
        if name.endswith("_") and any(k.startswith(name) for k in known):
            continue  # a prefix: WECLAW_MQ_AMQP_TLS_*
        yield Finding(
            path,
            line_of(text, match.start()),
            name,
            "no Settings field, CLI option or os.environ read of weclaw_mq has this variable",
        )


OUR_NAME = re.compile(r"(?<![\w.])weclaw_mq\.([A-Z][A-Za-z0-9_]*)\b(?!\.)")
REASON_IN_CELL = re.compile(r"`([a-z][a-z0-9_]*)`")
# "with reason `expired`", "reason: `rejected`"
REASON_IN_PROSE = re.compile(r"\breasons?:?\s+`([a-z][a-z0-9_]*)`")


def check_error_names(path: str, text: str) -> Iterator[Finding]:
    # The AsyncAPI document's own schema names (components.schemas) are spelled the same way.
    stable = stable_error_types() | {asyncapi.TASK_HEADERS, asyncapi.DEAD_LETTER_HEADERS}
    for match in OUR_NAME.finditer(text):
        if match.group() in stable or hasattr(weclaw_mq, match.group(1)):
            continue
        yield Finding(
            path,
            line_of(text, match.start()),
            match.group(),
            "neither a stable error type (x-weclaw-error-type), an AsyncAPI schema name, nor a "
            "name weclaw_mq exports",
        )
    known = ", ".join(sorted(DEAD_LETTER_REASONS))
    reasons = [
        (line, r)
        for line, cell in table_columns(text, "reason")
        for r in REASON_IN_CELL.findall(cell)
    ]
    reasons += [(line_of(text, m.start(1)), m.group(1)) for m in REASON_IN_PROSE.finditer(text)]
    for line, reason in reasons:
        if reason not in DEAD_LETTER_REASONS:
            yield Finding(path, line, f"`{reason}`", f"not a DLQ reason (they are: {known})")


METRIC = re.compile(r"(?<![\w./\-])weclaw_mq_[a-z0-9_]+")


def check_metrics(path: str, text: str) -> Iterator[Finding]:
    known = metric_names()
    for match in METRIC.finditer(text):
        name = match.group()
        if name in known or (name.endswith("_") and any(k.startswith(name) for k in known)):
            continue
        yield Finding(
            path,
            line_of(text, match.start()),
            name,
            "weclaw_mq.observability.metrics exports no such metric",
        )


CHECKS = (check_cli, check_environment, check_error_names, check_metrics)


def findings(path: str, text: str) -> list[Finding]:
    found = [f for check in CHECKS for f in check(path, text)]
    return [f for f in found if (f.path, f.what.strip("`")) not in ALLOWED]


# -- the tests -----------------------------------------------------------------------------


def test_every_name_the_docs_mention_exists_in_the_code() -> None:
    files = doc_files()
    assert ROOT / "README.md" in files and len(files) > 5
    found = []
    for file in files:
        found += findings(str(file.relative_to(ROOT)), file.read_text(encoding="utf-8"))
    assert not found, "the docs name what the code does not have:\n" + "\n".join(map(str, found))


def test_the_checks_see_todays_docs() -> None:
    """Not vacuous: the docs hold many invocations and names of each kind, and they parse."""
    text = "\n".join(f.read_text(encoding="utf-8") for f in doc_files())
    invocations = [c for _, c in code_spans(text) if INVOCATION.search(c)]
    assert len(invocations) > 30
    assert len(set(ENV_NAME.findall(text))) > 20
    assert len(set(METRIC.findall(text))) > 3
    assert sum(1 for _ in table_columns(text, "reason")) > 10
    assert len(REASON_IN_PROSE.findall(text)) > 5


SAMPLE = """# Page

Run `weclaw-mq worker app:app --concurrency 4` or `.venv/bin/weclaw-mq dlq list Q --json`.

```bash
weclaw-mq dlq requeue Q --task-id T --rate 20/s \\
    --dry-run   # a comment --not-an-option
WECLAW_MQ_AMQP_URL=amqp://x weclaw-mq declare app:app --log-level INFO | tee out
pip install weclaw-mq && weclaw-mq --version
```

Set `WECLAW_MQ_REDIS_URL` or any `WECLAW_MQ_AMQP_TLS_*`; watch `weclaw_mq_messages_total` and
`weclaw_mq_handler_seconds_bucket`. A `weclaw_mq.Reject` lands in the DLQ; so does
`weclaw_mq.HandlerTimeout`. See `weclaw_mq.App`.

| reason | meaning |
|---|---|
| `rejected` | the handler said no |
| `delivery_limit` | the worker died on it |

It lands in the DLQ with reason `expired`: `weclaw-mq dlq purge Q --reason expired --yes`.
"""


def test_a_page_that_names_only_what_exists_passes(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(SAMPLE, encoding="utf-8")
    assert findings(str(page), page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("insert", "what", "problem"),
    [
        ("`weclaw-mq frobnicate Q`", "`weclaw-mq frobnicate Q`", "has no command 'frobnicate'"),
        ("`weclaw-mq dlq relist Q`", "`weclaw-mq dlq relist Q`", "'weclaw-mq dlq' has no command"),
        (
            "```\nweclaw-mq worker a:b --turbo\n```",
            "`weclaw-mq worker a:b --turbo`",
            "no option --turbo",
        ),
        ("`weclaw-mq dlq list Q --yes`", "`weclaw-mq dlq list Q --yes`", "no option --yes"),
        (
            "`weclaw-mq --log-level INFO worker a:b`",
            "`weclaw-mq --log-level INFO worker a:b`",
            "'weclaw-mq' has no option --log-level",
        ),
        ("Set WECLAW_MQ_WARP_DRIVE=1.", "WECLAW_MQ_WARP_DRIVE", "no Settings field"),
        ("All of `WECLAW_MQ_NOPE_*`.", "WECLAW_MQ_NOPE_", "no Settings field"),
        (
            "Alert on `weclaw_mq_gremlins_total`.",
            "weclaw_mq_gremlins_total",
            "exports no such metric",
        ),
        (
            "Not `weclaw_mq_in_flight_total`: a gauge.",
            "weclaw_mq_in_flight_total",
            "exports no such metric",
        ),
        (
            "Filter on `weclaw_mq.GremlinError`.",
            "weclaw_mq.GremlinError",
            "neither a stable error type",
        ),
        ("| reason | x |\n|---|---|\n| `gremlins` | y |", "`gremlins`", "not a DLQ reason"),
        ("It ends with reason `gremlins`.", "`gremlins`", "not a DLQ reason"),
        (
            "`weclaw-mq dlq list Q --reason=gremlins`",
            "`weclaw-mq dlq list Q --reason=gremlins`",
            "--reason=gremlins: not a DLQ reason",
        ),
        (
            "`weclaw-mq dlq list Q --reason gremlins`",
            "`weclaw-mq dlq list Q --reason gremlins`",
            "--reason gremlins: not a DLQ reason",
        ),
    ],
)
def test_a_name_the_code_does_not_have_fails_with_file_and_line(
    tmp_path: Path, insert: str, what: str, problem: str
) -> None:
    page = tmp_path / "page.md"
    before = SAMPLE + "\nSome text.\n\n"
    page.write_text(before + insert + "\n", encoding="utf-8")
    found = findings(str(page), page.read_text(encoding="utf-8"))
    assert len(found) == 1, found
    (finding,) = found
    assert finding.what == what
    assert problem in finding.problem
    # The line the name is on (a fenced block's content begins one line below its fence).
    inserted_at = before.count("\n") + 1 + (1 if insert.startswith("```") else 0)
    if insert.startswith("|"):
        inserted_at += 2  # the table's body row
    assert finding.line == inserted_at
    assert str(finding).startswith(f"{page}:{inserted_at}: {what}: ")


def test_the_variables_read_are_found_in_the_code() -> None:
    names = environment_variables()
    assert "WECLAW_MQ_LANES_BULK" in names  # os.environ.get("...") in worker/consume.py
    assert "WECLAW_MQ_SERVICE_WAIT_S" in names  # os.environ.get(SERVICE_WAIT_ENV)
    assert "WECLAW_MQ_LOG_FORMAT" in names  # a CLI option's envvar=
    assert environment_reads('import os\nX = "A"\nos.environ.get(X)\nos.getenv("B")\n') == {
        "A",
        "B",
    }


# A path into the package: ``weclaw_mq/worker/ends.py``, ``weclaw_mq/state/``.
PACKAGE_PATH = re.compile(r"\bweclaw_mq/[\w/]*\w(?:\.py)?")


def stale_paths(files: list[Path]) -> Iterator[Finding]:
    """Every package path a file names that does not exist."""
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in PACKAGE_PATH.finditer(text):
            named = ROOT / match.group(0)
            if not (named.exists() or named.with_suffix(".py").exists()):
                yield Finding(
                    str(path), line_of(text, match.start()), match.group(0), "no such path"
                )


def test_every_package_path_the_docs_and_code_name_exists() -> None:
    # The docs, and the comments and docstrings of the code and tests: a moved module leaves
    # no reader looking for its old file.
    files = [*doc_files(), ROOT / "SECURITY.md", ROOT / "CONTRIBUTING.md"]
    files += [p for d in ("weclaw_mq", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    found = [str(f) for f in stale_paths([f for f in files if f.is_file()])]
    assert found == []


def test_a_path_that_moved_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    gone = "weclaw_mq/" + "worker/notify.py"  # split: this file is checked too
    page.write_text(f"See `weclaw_mq/worker/ends.py` and\n`{gone}`.\n")
    assert [(f.line, f.what) for f in stale_paths([page])] == [(2, gone)]

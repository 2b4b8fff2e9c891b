"""A pydantic model read from environment variables and a ``.env`` file (``EnvSettings``).

What ``Settings`` needs of pydantic-settings, without it: that package and python-dotenv
cost an idle worker about 4 MiB of RSS (docs/design/performance.md). The rules are
pydantic-settings' own, so configurations keep working unchanged:

- a field ``foo`` is read from ``<prefix>FOO``, the name matched in any case;
- values passed to the constructor win over the environment, which wins over the ``.env``
  file, which wins over the field's default; ``_env_file=None`` reads no file;
- a field of a complex type (a model, list, dict, set, tuple) takes its value as JSON;
- a bad value is a ``pydantic.ValidationError`` titled with the class's name, whose ``loc``
  is the field (``cli.exit_codes`` turns it into the variable's name), the input never echoed.
"""

from __future__ import annotations

import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict

_DEFAULT_ENV_FILE: Any = object()  # "use the class's env_file"

# ${NAME} or ${NAME:-default} in a .env value (python-dotenv's interpolation)
_REFERENCE = re.compile(r"\$\{([^}:]+)(?::-([^}]*))?\}")
_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*(.*?)\s*$")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'"}


class EnvSettings(BaseModel):
    """Subclasses set ``env_prefix`` and ``env_file`` and declare their fields."""

    model_config = ConfigDict(
        extra="ignore",
        # A rejected value is never echoed back: it may be a URL with a password in it.
        hide_input_in_errors=True,
    )
    env_prefix: ClassVar[str] = ""
    env_file: ClassVar[str | None] = ".env"

    def __init__(self, _env_file: str | Path | None = _DEFAULT_ENV_FILE, **values: Any) -> None:
        env_file = type(self).env_file if _env_file is _DEFAULT_ENV_FILE else _env_file
        found = _read_env(type(self), env_file)
        found.update(values)
        super().__init__(**found)


def _read_env(model: type[EnvSettings], env_file: str | Path | None) -> dict[str, Any]:
    """The fields' values found in ``env_file`` and then the environment (which wins)."""
    prefix = model.env_prefix.lower()
    sources: list[dict[str, str]] = []
    if env_file is not None and Path(env_file).is_file():
        sources.append(read_dotenv(Path(env_file)))
    sources.append(dict(os.environ))
    found: dict[str, Any] = {}
    for source in sources:
        by_name = {key.lower(): value for key, value in source.items()}
        for name, field in model.model_fields.items():
            raw = by_name.get(prefix + name.lower())
            if raw is not None:
                found[name] = _decode(raw, field.annotation)
    return found


def _decode(raw: str, annotation: Any) -> Any:
    """``raw`` as JSON for a complex field (left as text when it is not JSON, so pydantic
    rejects it naming the field); as text, for pydantic to convert, otherwise."""
    if not _is_complex(annotation):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _is_complex(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return any(_is_complex(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return False
    if origin is not None:
        annotation = origin
    return isinstance(annotation, type) and (
        issubclass(annotation, (BaseModel, list, dict, set, frozenset, tuple))
    )


def read_dotenv(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of a ``.env`` file, as python-dotenv reads them: ``#`` comments,
    ``export``, single quotes (literal), double quotes (escapes), ``${NAME}`` references to
    earlier keys or the environment (not inside single quotes)."""
    values: dict[str, str] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = _LINE.match(lines[i])
        i += 1
        if match is None:
            continue  # blank, a comment, or not a KEY=value line
        key, value = match.group(1), match.group(2)
        if value[:1] in ("'", '"'):
            quote = value[0]
            # A quoted value may span lines, up to its closing quote.
            while not _closed(value, quote) and i < len(lines):
                value += "\n" + lines[i]
                i += 1
            end = _closing(value, quote)
            body = value[1:end] if end != -1 else value[1:]  # never closed: to the end
            if quote == "'":
                values[key] = body
                continue
            value = re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), body)
        else:
            value = re.split(r"\s+#", value, maxsplit=1)[0].strip()
        values[key] = _REFERENCE.sub(lambda m: _resolve(m, values), value)
    return values


def _closing(value: str, quote: str) -> int:
    """The index of the quote closing ``value``'s opening one, or -1."""
    j = 1
    while j < len(value):
        if value[j] == "\\" and quote == '"':
            j += 2
            continue
        if value[j] == quote:
            return j
        j += 1
    return -1


def _closed(value: str, quote: str) -> bool:
    return _closing(value, quote) != -1


def _resolve(match: re.Match[str], earlier: dict[str, str]) -> str:
    name, default = match.group(1), match.group(2)
    found = os.environ.get(name, earlier.get(name))
    return found if found else (default or "")

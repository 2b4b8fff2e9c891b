"""The wire does not change under a refactoring: every header, broker name, Redis key, each
handler's declarations on every broker version, and the messages ``App.prepare`` builds are
those of the last release (``tests/unit/wire/wire_0.1.0.json``, printed by
``python -m tests.unit.wire.snapshot`` on that release); new header and name constants may be
added beside the released ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.wire.snapshot import snapshot

RELEASED = Path(__file__).parent / "wire" / "wire_0.1.0.json"


@pytest.fixture(scope="module")
def released() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RELEASED.read_text())
    return data


@pytest.fixture(scope="module")
def today() -> dict[str, Any]:
    # Through JSON, as the release was written: tuples become lists on both sides.
    data: dict[str, Any] = json.loads(json.dumps(snapshot(), sort_keys=True))
    return data


@pytest.mark.parametrize("part", ["names", "messages"])
def test_names_and_messages_are_the_released_ones(
    part: str, released: dict[str, Any], today: dict[str, Any]
) -> None:
    assert today[part] == released[part]


@pytest.mark.parametrize("part", ["headers", "naming_constants"])
def test_every_released_header_and_name_constant_is_kept(
    part: str, released: dict[str, Any], today: dict[str, Any]
) -> None:
    # A new feature may add one (a header, a key prefix); none released changes or goes.
    assert {name: today[part].get(name) for name in released[part]} == released[part]


@pytest.mark.parametrize("version", ["None", "3.10.8", "3.13.7", "4.0.5", "4.2.1", "4.3.0"])
def test_declarations_are_the_released_ones_on_every_broker_version(
    version: str, released: dict[str, Any], today: dict[str, Any]
) -> None:
    assert today["declarations"][version] == released["declarations"][version]

"""requirements/dev.lock pins what the tests and linters run on (issue 38 item 14): a release
upstream must not turn a fresh clone red, and the lock must stay inside pyproject's ranges."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def locked() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "requirements" / "dev.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"dev.lock: {line!r} is not name==version"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def requirements() -> list[Requirement]:
    """What 'make install' installs: the package's dependencies and its dev extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    return [Requirement(r) for r in listed]


def test_every_dependency_make_install_installs_is_pinned_within_its_range() -> None:
    pins = locked()
    for req in requirements():
        name = canonicalize_name(req.name)
        if name == "weclaw-mq":
            continue
        assert name in pins, f"{req.name} is in pyproject.toml but not pinned in dev.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"dev.lock pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}"
        )


def test_make_install_installs_at_the_locked_versions() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe is not None, "no install recipe"
    assert "-c $(LOCK)" in recipe.group(1) and "LOCK := requirements/dev.lock" in makefile
    assert re.search(r"^\$\(STAMP\):[^\n]*\$\(LOCK\)", makefile, re.M), "a new lock reinstalls"

"""Apps that integration tests run as real worker processes (``weclaw-mq worker ...``).

Each app module builds its ``app`` from environment variables, and only on first access to
``app``: tests import the same modules for their helpers without that environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weclaw_mq import App


def required_env(module: str, *names: str) -> list[str]:
    """The values of ``names``; a missing one names the module that needs it."""
    try:
        return [os.environ[name] for name in names]
    except KeyError as e:
        raise RuntimeError(f"{module} needs the environment variable {e}") from e


def lazy_app(module: str, build: Callable[[], App]) -> Callable[[str], App]:
    """A module ``__getattr__`` (PEP 562) that builds ``app`` with ``build`` on first access."""
    built: list[App] = []

    def __getattr__(name: str) -> App:
        if name != "app":
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if not built:
            built.append(build())
        return built[0]

    return __getattr__

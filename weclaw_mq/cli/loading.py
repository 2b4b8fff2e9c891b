"""Finding the user's ``App`` from a ``MODULE:ATTRIBUTE`` string."""

from __future__ import annotations

import importlib
import os
import sys

import pydantic

from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.failures import user_frames


class UserCodeError(ConfigurationError):
    """The user's module raised while it was imported; ``where`` holds the lines of its
    last frames (file, line, code), the library's and importlib's own left out."""

    def __init__(self, message: str, where: list[str]) -> None:
        super().__init__(message)
        self.where = where


def split_app_path(path: str) -> tuple[str, str]:
    """``MODULE:ATTRIBUTE`` as its two parts, or the configuration error that says the form."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"expected MODULE:APP (e.g. consumers.demo:app), got {path!r}")
    return module_name, attr


def load_app(path: str) -> App:
    module_name, attr = split_app_path(path)
    # Like 'python -m': modules in the current folder are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            raise ConfigurationError(f"cannot import {module_name!r}: {e}") from e
        # The module exists and imports something that does not: the user's line says which.
        raise UserCodeError(
            f"importing {module_name!r} failed: {type(e).__name__}: {e}", user_frames(e)
        ) from e
    except pydantic.ValidationError:
        raise  # the App's Settings(): an invalid WECLAW_MQ_* value, said as such by the CLI
    except Exception as e:  # the user's module failed while importing: show where
        raise UserCodeError(
            f"importing {module_name!r} failed: {type(e).__name__}: {e}", user_frames(e)
        ) from e
    try:  # a module's __getattr__ may build the App lazily, and fail doing so
        app = getattr(module, attr, None)
    except pydantic.ValidationError:
        raise
    except Exception as e:
        raise UserCodeError(
            f"loading {path!r} failed: {type(e).__name__}: {e}", user_frames(e)
        ) from e
    if not isinstance(app, App):
        raise ConfigurationError(
            f"{path!r} is {type(app).__name__}, not a weclaw_mq.App"
            if app is not None
            else f"module {module_name!r} has no attribute {attr!r}"
        )
    return app

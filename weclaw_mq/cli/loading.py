"""Finding the user's ``App`` from a ``MODULE:ATTRIBUTE`` string."""

from __future__ import annotations

import importlib
import os
import sys

import pydantic

from ..app import App
from ..errors import ConfigurationError


def load_app(path: str) -> App:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"expected MODULE:APP (e.g. consumers.demo:app), got {path!r}")
    # Like 'python -m': modules in the current folder are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigurationError(f"cannot import {module_name!r}: {e}") from e
    except pydantic.ValidationError:
        raise  # the App's Settings(): an invalid WECLAW_MQ_* value, said as such by the CLI
    except Exception as e:  # the user's module failed while importing: say where, not how
        raise ConfigurationError(
            f"importing {module_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    try:  # a module's __getattr__ may build the App lazily, and fail doing so
        app = getattr(module, attr, None)
    except pydantic.ValidationError:
        raise
    except Exception as e:
        raise ConfigurationError(f"loading {path!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(app, App):
        raise ConfigurationError(
            f"{path!r} is {type(app).__name__}, not a weclaw_mq.App"
            if app is not None
            else f"module {module_name!r} has no attribute {attr!r}"
        )
    return app

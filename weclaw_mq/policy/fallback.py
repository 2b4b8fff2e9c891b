"""Model fallback chains: which model an attempt calls. Pure.

    @app.handler("answers", fallback=Fallback(["big-1", "big-2", "small-1"]))
    async def answer(task: Question, ctx: Context) -> str:
        return await call(ctx.model, task.prompt)   # ctx.model: this attempt's model

Every attempt gets the first model of the list that is up and that this task has not tried
yet; when all are tried, the first that is up. A model is down while its Retry-After runs (an
attempt ended with ``Retry(after_s=)``: every worker skips it that long) and for
``cool_down_s`` after ``failures`` attempts in a row failed on it; its first success makes it
count from zero again. So a new task goes back to the first model as soon as it is up, and a
retried task moves on down the list. When every model is down, the task waits for the first
to come back, in the delay queues, without spending an attempt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weclaw_mq.errors import ConfigurationError


@dataclass(frozen=True)
class Fallback:
    """A handler's models, in the order it prefers them.

    Args:
        models: The model (or provider) names, best first; at least one, no repeats.
        failures: Attempts in a row failing on one model before it is skipped.
        cool_down_s: How long a model that failed so is skipped, in seconds.

    Raises:
        ConfigurationError: An empty or repeating list, a name that is not a non-empty str,
            ``failures`` under 1, or a ``cool_down_s`` that is not a number > 0.
    """

    models: Sequence[str]
    failures: int = 3
    cool_down_s: float = 30.0

    def __post_init__(self) -> None:
        models = tuple(self.models) if not isinstance(self.models, str) else ()
        if not models or not all(isinstance(m, str) and m for m in models):
            raise ConfigurationError("Fallback models must be a list of model names (str)")
        if len(set(models)) != len(models):
            raise ConfigurationError(f"Fallback models repeat a name: {list(models)}")
        object.__setattr__(self, "models", models)
        if (
            isinstance(self.failures, bool)
            or not isinstance(self.failures, int)
            or self.failures < 1
        ):
            raise ConfigurationError(
                f"Fallback failures must be an int >= 1, got {self.failures!r}"
            )
        if not (
            isinstance(self.cool_down_s, int | float)
            and math.isfinite(self.cool_down_s)
            and self.cool_down_s > 0
        ):
            raise ConfigurationError(
                f"Fallback cool_down_s must be a number of seconds > 0, got {self.cool_down_s!r}"
            )


def choose(
    fallback: Fallback, tried: Sequence[str], down_until_ms: Mapping[str, int], now_ms: int
) -> str | int:
    """The model of the next attempt, or how many ms until the first model is up again.

    Args:
        fallback: The handler's models.
        tried: The models this task's earlier attempts failed on.
        down_until_ms: When each model that is down comes back (epoch ms); up if missing.
        now_ms: Now (epoch ms), on the clock the times were written with.
    """
    up = [m for m in fallback.models if down_until_ms.get(m, 0) <= now_ms]
    if not up:
        return max(1, min(down_until_ms[m] for m in fallback.models) - now_ms)
    untried = [m for m in up if m not in tried]
    return (untried or up)[0]

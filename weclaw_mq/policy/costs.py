"""What model tokens cost, and a tenant's daily cap: what the user declares. Pure.

    app = App("answers", prices={"big-1": Price(input_per_1k=0.5, output_per_1k=1.5),
                                 "small-1": Price(input_per_1k=0.05, output_per_1k=0.15)})

    @app.handler("answers", tenant=lambda task: task.tenant,
                 cap=Cap(per_day=20.0, action="downgrade", model="small-1"))

A handler reports each model call's tokens with ``ctx.usage(input_tokens=, output_tokens=,
model=)``; the worker turns them into a cost with the App's price table and records them on
the task and in the tenant's and the model's daily totals (``state.cost_ledger``). A tenant
whose day's total reached its ``Cap`` gets its next tasks parked until the next UTC day,
dead-lettered (reason ``budget_exceeded``), or run on a cheaper model (``ctx.model``).

Each run reserves its estimated cost against the cap before it starts (atomically, across
workers) and settles to what it reported when it ends, so tasks running at once cannot
together spend past the cap by more than their estimates' errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from weclaw_mq.errors import ConfigurationError

CapAction = Literal["park", "shed", "downgrade"]
CAP_ACTIONS: tuple[CapAction, ...] = ("park", "shed", "downgrade")


@dataclass(frozen=True)
class Price:
    """One model's price, per 1,000 tokens, in the currency of your bill.

    Args:
        input_per_1k: Per 1,000 prompt tokens.
        output_per_1k: Per 1,000 answer tokens.

    Raises:
        ConfigurationError: A price that is not a finite number of at least 0.
    """

    input_per_1k: float
    output_per_1k: float

    def __post_init__(self) -> None:
        for name, value in (
            ("input_per_1k", self.input_per_1k),
            ("output_per_1k", self.output_per_1k),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ConfigurationError(f"Price {name} must be a number >= 0, got {value!r}")

    def of(self, input_tokens: int, output_tokens: int) -> float:
        """The cost of one call's tokens."""
        return (input_tokens * self.input_per_1k + output_tokens * self.output_per_1k) / 1000


@dataclass(frozen=True)
class Cap:
    """A tenant's spending cap per UTC day, and what happens to its tasks past it.

    Args:
        per_day: The cap, in the price table's currency, per UTC day.
        action: ``"park"``: its tasks wait in the delay queues until the next UTC day (no
            attempt spent); ``"shed"``: dead-lettered with reason ``budget_exceeded``;
            ``"downgrade"``: run with ``ctx.model`` set to ``model`` (the handler calls that
            model instead of its own).
        model: The cheaper model of ``"downgrade"``.
        estimate: A function of the validated task returning what its run is expected to
            cost (in the price table's currency), reserved against the cap as it starts;
            default the mean cost of the handler's runs recorded that day (and, before
            one was, the rest of the cap: the day's first run runs alone).

    Raises:
        ConfigurationError: A cap that is not a number > 0, an unknown action, a downgrade
            without a model (or a model without a downgrade), or an ``estimate`` that is
            not callable.
    """

    per_day: float
    action: CapAction = "park"
    model: str | None = None
    estimate: Callable[[Any], float] | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.per_day, bool)
            or not isinstance(self.per_day, int | float)
            or not math.isfinite(self.per_day)
            or self.per_day <= 0
        ):
            raise ConfigurationError(f"Cap per_day must be a number > 0, got {self.per_day!r}")
        if self.action not in CAP_ACTIONS:
            raise ConfigurationError(
                f"Cap action must be one of {', '.join(CAP_ACTIONS)}, got {self.action!r}"
            )
        if (self.action == "downgrade") != (self.model is not None):
            raise ConfigurationError('Cap model= goes with action="downgrade" (the cheaper model)')
        if self.estimate is not None and not callable(self.estimate):
            raise ConfigurationError(
                f"Cap estimate must be a function of the task, got {self.estimate!r}"
            )

    @property
    def per_day_micros(self) -> int:
        """``per_day`` in millionths of the currency, as the ledger counts."""
        return round(self.per_day * 1_000_000)


def check_prices(prices: object) -> dict[str, Price]:
    """``App(prices=)`` as a dict of model -> ``Price``, checked at construction."""
    if prices is None:
        return {}
    if not isinstance(prices, dict) or not all(
        isinstance(k, str) and isinstance(v, Price) for k, v in prices.items()
    ):
        raise ConfigurationError(
            "prices= takes a dict of model name -> Price(input_per_1k=, output_per_1k=)"
        )
    return dict(prices)

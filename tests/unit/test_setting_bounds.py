"""Every duration setting has a floor and a ceiling, checked when the settings load.

A value that validates but cannot work (a guard lease of 1e-9 s parked every task forever, a
lease of inf crashed each claim, a shutdown grace of inf killed the hard-exit watchdog) is a
configuration error at load: the CLI ends with exit 3 naming the variable and its bounds.
"""

from __future__ import annotations

import asyncio
import math
import os

import pydantic
import pytest

from tests.integration.processes import one_error_line, run_cli
from weclaw_mq import App, ConfigurationError, Worker
from weclaw_mq.cli.exit_codes import ExitCode, classify
from weclaw_mq.settings import Settings, duration_bounds

DURATIONS = sorted(f for f in Settings.model_fields if f.endswith(("_s", "_ms")))


def test_every_duration_setting_has_a_floor_and_a_ceiling_around_its_default() -> None:
    assert "guard_lease_s" in DURATIONS and "shutdown_grace_s" in DURATIONS
    for field in DURATIONS:
        bounds = duration_bounds(field)
        assert bounds is not None, f"{field} has no floor and ceiling: make it with seconds()"
        floor, ceiling = bounds
        default = Settings.model_fields[field].default
        assert 0 <= floor <= default <= ceiling < math.inf, (field, bounds, default)


@pytest.mark.parametrize("field", DURATIONS)
@pytest.mark.parametrize("value", ["1e-9", "-1", "inf", "-inf", "nan", "1e12", "soon"])
def test_a_duration_outside_its_bounds_is_refused_with_both_bounds_named(
    field: str, value: str
) -> None:
    floor, ceiling = duration_bounds(field) or (0.0, 0.0)
    if value == "1e-9" and floor == 0:
        return  # a floor of 0 takes it (a grace of 1e-9 s is just no grace)
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings(_env_file=None, **{field: value})
    code, message = classify(caught.value)
    assert code is ExitCode.CONFIG
    assert f"WECLAW_MQ_{field.upper()}" in message, message
    assert f"from {floor:g} to {ceiling:g}" in message, message


@pytest.mark.parametrize("field", DURATIONS)
def test_each_bound_itself_is_accepted(field: str) -> None:
    floor, ceiling = duration_bounds(field) or (0.0, 0.0)
    for value in (floor, ceiling):
        wanted = int(value) if Settings.model_fields[field].annotation is int else value
        assert getattr(Settings(_env_file=None, **{field: wanted}), field) == wanted


def test_the_retry_multiplier_is_finite_and_capped() -> None:
    for value in ("inf", "nan", "1e300"):
        with pytest.raises(pydantic.ValidationError):
            Settings(_env_file=None, retry_multiplier=value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WECLAW_MQ_GUARD_LEASE_S", "1e-9"),
        ("WECLAW_MQ_GUARD_LEASE_S", "inf"),
        ("WECLAW_MQ_SHUTDOWN_GRACE_S", "inf"),
    ],
)
def test_a_worker_given_an_unusable_duration_exits_3_naming_it_and_its_bounds(
    variable: str, value: str
) -> None:
    env = {variable: value}
    # The app's module builds its App (and so reads the settings) on import.
    result = asyncio.run(run_cli("worker", "consumers.demo:app", env=env))
    line = one_error_line(result)
    assert result.code == ExitCode.CONFIG, (result.code, line)
    assert variable in line and "number of seconds from " in line, line
    assert os.environ.get(variable) is None  # the child's, not ours


@pytest.mark.parametrize("grace_s", [math.inf, math.nan, -1.0, 1e12])
def test_a_worker_given_an_unusable_grace_in_code_refuses_it(grace_s: float) -> None:
    app = App("bounds", settings=Settings(_env_file=None))

    @app.handler("bounds-q")
    async def work(job: dict[str, int]) -> None:
        return None

    with pytest.raises(ConfigurationError, match="from 0 to 86400"):
        Worker(app, shutdown_grace_s=grace_s)

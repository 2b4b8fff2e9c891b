"""The benchmark's ratio arithmetic: paired per-repeat ratios, and targets judged on the median."""

from __future__ import annotations

import pytest

from benchmarks.report import (
    Results,
    RowSpec,
    Target,
    paired_ratios,
    ratio_text,
    result_text,
    spread,
)


def test_ratios_pair_each_repeat_with_the_baselines_run_in_the_same_round() -> None:
    ours = {0: 90.0, 1: 50.0, 2: 120.0}
    base = {0: 100.0, 1: 50.0, 2: 100.0}
    assert paired_ratios(ours, base) == {0: 0.9, 1: 1.0, 2: 1.2}


def test_paired_ratios_differ_from_the_ratio_of_medians() -> None:
    # A slow round slows both sides: pairing cancels it, medians of each side do not.
    ours = {0: 95.0, 1: 45.0, 2: 96.0}
    base = {0: 100.0, 1: 50.0, 2: 60.0}
    ratios = paired_ratios(ours, base)
    assert ratios == pytest.approx({0: 0.95, 1: 0.9, 2: 1.6})
    paired = spread(ratios)
    assert paired is not None
    assert paired.median == pytest.approx(0.95)
    ours_median, base_median = spread(ours), spread(base)
    assert ours_median is not None and base_median is not None
    assert ours_median.median / base_median.median == pytest.approx(95.0 / 60.0)


def test_a_repeat_missing_on_either_side_or_a_zero_baseline_has_no_ratio() -> None:
    ours = {0: 1.0, 1: 2.0, 3: 4.0, 4: 5.0}
    base = {0: 2.0, 2: 3.0, 3: 0.0, 4: 10.0}
    assert paired_ratios(ours, base) == {0: 0.5, 4: 0.5}


def test_spread_of_nothing_is_none() -> None:
    assert spread({}) is None
    s = spread({0: 3.0, 1: 1.0, 2: 2.0, 3: 10.0})
    assert s is not None
    assert (s.median, s.min, s.max) == (2.5, 1.0, 10.0)


def _results(ours: dict[int, float], base: dict[int, float], target: Target) -> dict[str, object]:
    results = Results()
    spec = RowSpec(
        case_id="c",
        case_label="case",
        contender="ours",
        contender_label="ours",
        metric="rate",
        unit="msg/s",
        baseline="base",
        baseline_label="base",
        target=target,
    )
    results.add_spec(spec)
    for r, v in base.items():
        results.record("c", "base", r, {"rate": v})
    for r, v in ours.items():
        results.record("c", "ours", r, {"rate": v})
    return results.row(spec)


def test_a_ratio_target_is_met_on_the_median_and_says_where_it_held() -> None:
    base = {r: 100.0 for r in range(5)}
    row = _results({0: 95.0, 1: 85.0, 2: 91.0, 3: 92.0, 4: 80.0}, base, Target("ratio_min", 0.9))
    assert row["ratio"] == pytest.approx(0.91)
    assert (row["ratio_min"], row["ratio_max"]) == (pytest.approx(0.8), pytest.approx(0.95))
    assert row["result"] == "pass"
    assert (row["held_in"], row["held_of"]) == (3, 5)
    assert result_text(row) == "pass (held in 3/5 repeats)"
    assert ratio_text(row) == "0.91x base (0.80-0.95)"


def test_a_ratio_target_missed_on_the_median_is_a_miss_even_if_some_repeats_held() -> None:
    base = {r: 100.0 for r in range(5)}
    row = _results({0: 95.0, 1: 85.0, 2: 89.0, 3: 92.0, 4: 80.0}, base, Target("ratio_min", 0.9))
    assert row["result"] == "MISS"
    assert result_text(row) == "MISS (held in 2/5 repeats)"


def test_a_target_held_in_every_repeat_says_so() -> None:
    row = _results({0: 30.0, 1: 31.0}, {0: 50.0, 1: 50.0}, Target("max", 40))
    assert row["result"] == "pass"
    assert result_text(row) == "pass (held in every repeat, 2/2)"


def test_an_absolute_target_is_checked_per_repeat_on_the_values() -> None:
    row = _results({0: 0.95, 1: 0.85, 2: 0.91}, {0: 1.0, 1: 1.0, 2: 1.0}, Target("min", 0.9))
    assert row["result"] == "pass"  # median 0.91
    assert (row["held_in"], row["held_of"]) == (2, 3)


def test_a_failed_repeat_leaves_its_round_out_of_the_ratios() -> None:
    row = _results({0: 90.0, 2: 70.0}, {0: 100.0, 1: 100.0, 2: 100.0}, Target("ratio_min", 0.9))
    assert row["repeats"] == [0, 2]
    assert row["ratios"] == [pytest.approx(0.9), pytest.approx(0.7)]
    assert row["held_of"] == 2


def test_an_every_repeat_target_misses_when_one_repeat_missed_it_even_if_the_median_holds() -> None:
    base = {r: 100.0 for r in range(5)}
    ours = {0: 95.0, 1: 85.0, 2: 91.0, 3: 92.0, 4: 93.0}
    target = Target("ratio_min", 0.9, every=True)
    row = _results(ours, base, target)
    assert row["ratio"] == pytest.approx(0.92)
    assert row["result"] == "MISS"
    assert row["target"] == ">= 0.9x base in every repeat"
    assert _results({**ours, 1: 90.0}, base, target)["result"] == "pass"

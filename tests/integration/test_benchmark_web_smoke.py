"""The PostgreSQL outbox and sync client benchmarks still run end to end (tiny counts): their
numbers live in `make bench`."""

from __future__ import annotations

import psycopg

from tests.integration.benchmark_runs import queues_left, run_benchmark
from tests.integration.postgres_db import SERVER_URL


def test_postgres_outbox_benchmark_smoke_run_prints_every_measure_and_leaves_no_schema() -> None:
    proc, tag = run_benchmark("benchmarks.postgres_outbox", "--smoke", timeout=120)
    for measure in ("plus add_to_outbox", "commit -> confirm", "1 relay", "3 relays"):
        assert measure in proc.stdout, measure
    assert "target < 50 ms:" in proc.stdout
    assert not queues_left(tag), "the benchmark left its queue behind"
    with psycopg.connect(SERVER_URL, autocommit=True) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE %s", (f"%{tag}%",)
        ).fetchone()
    assert left == (0,), "the benchmark left its schema behind"


def test_sync_client_benchmark_smoke_run_prints_every_case_and_the_ratio() -> None:
    proc, tag = run_benchmark("benchmarks.sync_client", "--smoke", timeout=120)
    for case in ("| async publish x8 |", "| async publish x1 |", "| sync publish, 8 threads |"):
        assert case in proc.stdout, case
    assert "sync 8 threads / async x8:" in proc.stdout
    assert not queues_left(tag), "the benchmark left its queue behind"

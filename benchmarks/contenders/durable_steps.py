"""What a memoized step costs: weclaw_mq's ``ctx.step`` against a DBOS ``@DBOS.step``.

    benchmarks/.venv/bin/python -m benchmarks.contenders.durable_steps
    benchmarks/.venv/bin/python -m benchmarks.contenders.durable_steps --steps 200 --rounds 5
    benchmarks/.venv/bin/python -m benchmarks.contenders.durable_steps --smoke

DBOS lives only in benchmarks/.venv (benchmarks/requirements.txt), never in the project's
environment. Both run on this machine: weclaw_mq on the real RabbitMQ and Redis
(``WECLAW_MQ_AMQP_URL``, ``WECLAW_MQ_REDIS_URL``), DBOS on the PostgreSQL at
``--postgres`` (a database of its own, named for this run and dropped at the end).

Each round runs one task (weclaw_mq) and one workflow (DBOS) of ``--steps`` steps whose
function does no work (it returns its argument), so what is timed is the memoization alone:

- **fresh**: the first run, each step called and its result recorded (weclaw_mq: one Redis
  write a step; DBOS: its checkpoint in PostgreSQL);
- **replayed**: a second run over the same records, each step answered from them without a
  call (weclaw_mq: the task's ``Retry``; DBOS: ``fork_workflow`` from after the last step,
  which copies the checkpoints and runs the workflow again over them, the read path of a
  recovery).

Timed inside the handler / workflow body with ``perf_counter`` around the loop of steps, one
task or workflow at a time; the figures are per step (us), median and range over the rounds.
Each run also counts the step function's calls: a replay that called it is an error (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from weclaw_mq import App, Context, Retry, Settings, TaskStatus, Worker
from weclaw_mq.contract.naming import steps_key, stream_key, task_keys
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.wire.topology import queue_declarations

RESULT_TIMEOUT_S = 120.0
# The streamed reply: 10 chunks, the first attempt breaking off after 6 (at 60 %, as in
# tests/integration/test_steps.py for weclaw_mq's ctx.emitted()).
STREAM_CHUNKS = 10
STREAM_BREAK_AT = 6


@dataclass
class Figures:
    """Per-step microseconds, one value per round."""

    fresh_us: list[float] = field(default_factory=list)
    replay_us: list[float] = field(default_factory=list)
    calls_in_replays: int = 0
    # A streamed reply of STREAM_CHUNKS chunks whose first attempt broke off: what its reader got.
    stream_read: list[str] = field(default_factory=list)


# --- weclaw_mq -------------------------------------------------------------------------------

# The step function's calls, by task id (the handler runs in this process).
_weclaw_calls: dict[str, int] = {}
_weclaw_fresh_ns: dict[str, int] = {}


async def weclaw_rounds(steps: int, rounds: int) -> Figures:
    settings = Settings()
    queue = f"bench-steps-{uuid.uuid4().hex[:10]}"
    app = App("bench-steps", settings=settings)
    fast = RetryPolicy(max_retries=2, delay_s=0.01, max_delay_s=0.01)

    @app.handler(queue, retry=fast)
    async def agent(task: dict[str, int], ctx: Context) -> dict[str, int]:
        def echo(i: int) -> int:
            _weclaw_calls[ctx.task_id] = _weclaw_calls.get(ctx.task_id, 0) + 1
            return i

        calls_before = _weclaw_calls.get(ctx.task_id, 0)
        started = time.perf_counter_ns()
        for i in range(task["steps"]):
            await ctx.step("echo", echo, i)
        spent = time.perf_counter_ns() - started
        if ctx.attempt == 1:
            _weclaw_fresh_ns[ctx.task_id] = spent
            raise Retry("the benchmark's replay", after_s=0.01)
        return {
            "fresh_ns": _weclaw_fresh_ns[ctx.task_id],
            "replay_ns": spent,
            "calls_in_replay": _weclaw_calls.get(ctx.task_id, 0) - calls_before,
        }

    figures = Figures()
    task_ids: list[str] = []
    await app.declare()
    worker = Worker(app, concurrency=1, shutdown_grace_s=5)
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.ready.wait(), timeout=30)
        for _ in range(rounds):
            task_id = await app.publish(queue, {"steps": steps})
            task_ids.append(task_id)
            state = await app.result(task_id, queue=queue, timeout_s=RESULT_TIMEOUT_S)
            if state.status is not TaskStatus.SUCCEEDED:
                raise RuntimeError(f"task {task_id} ended {state.status.value}: {state.error}")
            figures.fresh_us.append(state.result["fresh_ns"] / steps / 1e3)
            figures.replay_us.append(state.result["replay_ns"] / steps / 1e3)
            figures.calls_in_replays += state.result["calls_in_replay"]
    finally:
        worker.stop()
        await running
        await weclaw_cleanup(app, settings.redis_url_plain(), queue, task_ids)
        await app.close()
    return figures


async def weclaw_cleanup(app: App, redis_url: str, queue: str, task_ids: list[str]) -> None:
    """Delete the run's queues and every Redis key its tasks wrote."""
    conn = await app.broker.connect(name="bench-steps-cleanup")
    try:
        for name, _ in queue_declarations(app.handlers[queue].queue_spec()):
            channel = await conn.channel()
            await channel.queue_delete(name)
            await channel.close()
    finally:
        await conn.close()
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [
            key
            for task_id in task_ids
            for key in (*task_keys(queue, task_id), stream_key(task_id), steps_key(queue, task_id))
        ]
        if keys:
            await client.delete(*set(keys))
    finally:
        await client.aclose()


# --- DBOS ------------------------------------------------------------------------------------


def dbos_rounds(steps: int, rounds: int, postgres: str, synchronous_commit: str) -> Figures:
    # Imported here: DBOS is in benchmarks/.venv only, and its import registers global state.
    import sqlalchemy as sa
    from dbos import DBOS, DBOSConfig, SetWorkflowID

    database = f"weclaw_bench_dbos_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(f"{postgres}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        # Made here (DBOS makes it when missing) so that its commits' flush can be chosen.
        conn.execute(sa.text(f'CREATE DATABASE "{database}"'))
        conn.execute(
            sa.text(f'ALTER DATABASE "{database}" SET synchronous_commit = {synchronous_commit}')
        )
    config: DBOSConfig = {
        "name": "weclaw-bench-steps",
        "system_database_url": f"{postgres}/{database}",
        "log_level": "ERROR",  # the stream check's first attempt fails on purpose
    }
    calls = {"n": 0}

    @DBOS.step()
    def echo(i: int) -> int:
        calls["n"] += 1
        return i

    @DBOS.workflow()
    def agent(n: int) -> dict[str, int]:
        calls_before = calls["n"]
        started = time.perf_counter_ns()
        for i in range(n):
            echo(i)
        return {"ns": time.perf_counter_ns() - started, "calls": calls["n"] - calls_before}

    attempts = {"n": 0}

    # The streaming pattern of DBOS's own docs (docs.dbos.dev/ai/streaming): the model call
    # is a step that writes each token to the workflow's stream; a failed attempt is retried.
    @DBOS.step(retries_allowed=True, max_attempts=2, interval_seconds=0.01)
    def stream_completion(key: str) -> str:
        attempts["n"] += 1
        for i in range(STREAM_CHUNKS):
            if attempts["n"] == 1 and i == STREAM_BREAK_AT:
                raise ConnectionError("the model's stream broke off at 60 %")
            DBOS.write_stream(key, f"c{i}")
        return "done"

    @DBOS.workflow()
    def chat(key: str) -> str:
        answer = stream_completion(key)
        DBOS.close_stream(key)
        return answer

    figures = Figures()
    DBOS(config=config)
    try:
        DBOS.launch()
        if synchronous_commit == "on":
            workflow_id = str(uuid.uuid4())
            with SetWorkflowID(workflow_id):
                chat("tokens")
            figures.stream_read = list(DBOS.read_stream(workflow_id, "tokens"))
        for _ in range(rounds):
            workflow_id = str(uuid.uuid4())
            with SetWorkflowID(workflow_id):
                fresh = agent(steps)
            # Step ids count from 1; forking at steps + 1 copies all of them and runs again.
            replay = DBOS.fork_workflow(workflow_id, steps + 1).get_result()
            figures.fresh_us.append(fresh["ns"] / steps / 1e3)
            figures.replay_us.append(replay["ns"] / steps / 1e3)
            figures.calls_in_replays += replay["calls"]
    finally:
        DBOS.destroy(destroy_registry=True)
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()
    return figures


def servers(postgres: str) -> str:
    """How durable each store's writes are here: the figures differ by it, so print it."""
    import redis
    import sqlalchemy as sa

    client = redis.Redis.from_url(Settings().redis_url_plain())
    try:
        aof = client.config_get("appendonly")["appendonly"]
        fsync = client.config_get("appendfsync")["appendfsync"]
    finally:
        client.close()
    engine = sa.create_engine(f"{postgres}/postgres")
    with engine.connect() as conn:
        commit = conn.execute(sa.text("SHOW synchronous_commit")).scalar()
    engine.dispose()
    return (
        f"servers: Redis appendonly {aof} (appendfsync {fsync}); "
        f"PostgreSQL synchronous_commit {commit} (each commit flushed to disk when on)"
    )


# --- report ----------------------------------------------------------------------------------


def row(name: str, values: list[float]) -> str:
    if not values:
        return f"| {name} | - | - | NO DATA |"
    return (
        f"| {name} | {statistics.median(values):.1f} | "
        f"{min(values):.1f} - {max(values):.1f} | {len(values)} rounds |"
    )


def report(results: dict[str, Figures], steps: int) -> int:
    print(f"memoized steps: {steps} no-op steps a run, per-step time inside the run (us)")
    print("| measure | median | min - max | over |")
    print("|---|---|---|---|")
    status = 0
    for name, f in results.items():
        print(row(f"{name}: fresh (called + recorded)", f.fresh_us))
        print(row(f"{name}: replayed (from the records)", f.replay_us))
        if not f.fresh_us or not f.replay_us:
            status = 1
        if f.stream_read:
            print(
                f"{name}: a {STREAM_CHUNKS}-chunk streamed step retried after "
                f"{STREAM_BREAK_AT} chunks: its reader got {len(f.stream_read)} values: "
                + " ".join(f.stream_read)
            )
        if f.calls_in_replays:
            print(f"ERROR: {name}'s replays called the step function {f.calls_in_replays} times")
            status = 1
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks.contenders.durable_steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=200, help="steps per run")
    p.add_argument("--rounds", type=int, default=5, help="runs of each")
    p.add_argument(
        "--postgres",
        default="postgresql://postgres@localhost:5432",
        help="PostgreSQL server for DBOS (a database of its own is made and dropped)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny counts (a few seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds = 20, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(servers(args.postgres))
    results = {
        "weclaw_mq ctx.step (Redis)": asyncio.run(weclaw_rounds(args.steps, args.rounds)),
        "DBOS @DBOS.step (PostgreSQL)": dbos_rounds(args.steps, args.rounds, args.postgres, "on"),
        "DBOS @DBOS.step (PostgreSQL, synchronous_commit off)": dbos_rounds(
            args.steps, args.rounds, args.postgres, "off"
        ),
    }
    return report(results, args.steps)


if __name__ == "__main__":
    sys.exit(main())

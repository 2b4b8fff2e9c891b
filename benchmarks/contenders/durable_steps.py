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
DBOS runs twice: with PostgreSQL's ``synchronous_commit`` on (each checkpoint flushed to disk,
PostgreSQL's default) and off (closer to a Redis without fsync); the servers' settings are
printed first, as the figures depend on them.

Then two DBOS behaviours, printed as they happen:

- **a streamed reply retried mid-way**: DBOS's documented pattern (a step that writes each
  token with ``DBOS.write_stream``), its first attempt failing after 6 of 10 chunks; the
  values its reader gets. (weclaw_mq's ``ctx.emitted()`` case is enforced by
  tests/integration/test_steps.py: 20 chunks once each, after a retry and after a kill -9.)
- **kill -9 of the process running a workflow**: executor ``a`` runs a 50-step workflow
  (0.2 s a step) and is SIGKILLed after its 3rd step; another DBOS process already running
  (executor ``b``) is watched for ``--recovery-wait-s``; then ``a`` is started again and
  timed to its launch and to the workflow's next checkpointed step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

from ..infra import bench_queue_name

RESULT_TIMEOUT_S = 120.0
# The streamed reply: 10 chunks, the first attempt breaking off after 6 (at 60 %, as in
# tests/integration/test_steps.py for weclaw_mq's ctx.emitted()).
STREAM_CHUNKS = 10
STREAM_BREAK_AT = 6


@dataclass
class Figures:
    """Per-step microseconds, one value per round, the two sides' rounds alternated."""

    weclaw_fresh_us: list[float] = field(default_factory=list)
    weclaw_replay_us: list[float] = field(default_factory=list)
    dbos_fresh_us: list[float] = field(default_factory=list)
    dbos_replay_us: list[float] = field(default_factory=list)
    calls_in_replays: dict[str, int] = field(default_factory=dict)
    # A streamed reply of STREAM_CHUNKS chunks whose first attempt broke off: what its reader got.
    stream_read: list[str] = field(default_factory=list)


# --- weclaw_mq -------------------------------------------------------------------------------

# The step function's calls and the first attempt's time, by task id (the handler runs here).
_weclaw_calls: dict[str, int] = {}
_weclaw_fresh_ns: dict[str, int] = {}


class WeclawSide:
    """An App with one handler of N steps and a Worker, on a queue named for this run."""

    def __init__(self) -> None:
        self.settings = Settings()
        self.queue = bench_queue_name("steps")
        self.app = App("bench-steps", settings=self.settings)
        self.task_ids: list[str] = []
        fast = RetryPolicy(max_retries=2, delay_s=0.01, max_delay_s=0.01)

        @self.app.handler(self.queue, retry=fast)
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

    async def start(self) -> None:
        await self.app.declare()
        self.worker = Worker(self.app, concurrency=1, shutdown_grace_s=5)
        self.running = asyncio.create_task(self.worker.run())
        await asyncio.wait_for(self.worker.ready.wait(), timeout=30)

    async def one_round(self, steps: int, figures: Figures) -> None:
        """One task: its steps fresh on attempt 1, replayed on attempt 2 (a Retry)."""
        task_id = await self.app.publish(self.queue, {"steps": steps})
        self.task_ids.append(task_id)
        state = await self.app.result(task_id, queue=self.queue, timeout_s=RESULT_TIMEOUT_S)
        if state.status is not TaskStatus.SUCCEEDED:
            raise RuntimeError(f"task {task_id} ended {state.status.value}: {state.error}")
        figures.weclaw_fresh_us.append(state.result["fresh_ns"] / steps / 1e3)
        figures.weclaw_replay_us.append(state.result["replay_ns"] / steps / 1e3)
        calls = figures.calls_in_replays.get("weclaw_mq", 0) + state.result["calls_in_replay"]
        figures.calls_in_replays["weclaw_mq"] = calls

    async def close(self) -> None:
        """Stop the worker; delete the run's queues and every Redis key its tasks wrote."""
        if hasattr(self, "worker"):
            self.worker.stop()
            await self.running
        conn = await self.app.broker.connect(name="bench-steps-cleanup")
        try:
            for name, _ in queue_declarations(self.app.handlers[self.queue].queue_spec()):
                channel = await conn.channel()
                await channel.queue_delete(name)
                await channel.close()
        finally:
            await conn.close()
        client = aioredis.Redis.from_url(self.settings.redis_url_plain())
        try:
            keys = [
                key
                for task_id in self.task_ids
                for key in (
                    *task_keys(self.queue, task_id),
                    stream_key(task_id),
                    steps_key(self.queue, task_id),
                )
            ]
            if keys:
                await client.delete(*set(keys))
        finally:
            await client.aclose()
        await self.app.close()


# --- DBOS ------------------------------------------------------------------------------------


class DbosSide:
    """DBOS launched on a database of its own, with its commits' flush chosen."""

    def __init__(self, postgres: str, synchronous_commit: str) -> None:
        # Imported here: DBOS is in benchmarks/.venv only, and its import sets up global state.
        import sqlalchemy as sa
        from dbos import DBOS, DBOSConfig, SetWorkflowID

        self.sa, self.DBOS, self.SetWorkflowID = sa, DBOS, SetWorkflowID
        self.database = f"weclaw_bench_dbos_{uuid.uuid4().hex[:10]}"
        self.admin = sa.create_engine(f"{postgres}/postgres", isolation_level="AUTOCOMMIT")
        with self.admin.connect() as conn:
            # Made here (DBOS makes it when missing) so that its commits' flush can be chosen.
            conn.execute(sa.text(f'CREATE DATABASE "{self.database}"'))
            flush = f"SET synchronous_commit = {synchronous_commit}"
            conn.execute(sa.text(f'ALTER DATABASE "{self.database}" {flush}'))
        config: DBOSConfig = {
            "name": "weclaw-bench-steps",
            "system_database_url": f"{postgres}/{self.database}",
            "log_level": "ERROR",  # the stream check's first attempt fails on purpose
        }
        calls = self.calls = {"n": 0}

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

        # The streaming pattern of DBOS's own docs (docs.dbos.dev/ai/streaming): the model
        # call is a step that writes each token to the workflow's stream; a failed attempt is
        # retried.
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

        self.agent, self.chat = agent, chat
        DBOS(config=config)
        DBOS.launch()

    def one_round(self, steps: int, figures: Figures) -> None:
        """One workflow fresh, then forked after its last step: every step replayed."""
        workflow_id = str(uuid.uuid4())
        with self.SetWorkflowID(workflow_id):
            fresh = self.agent(steps)
        # Step ids count from 1; forking at steps + 1 copies all of them and runs again.
        replay = self.DBOS.fork_workflow(workflow_id, steps + 1).get_result()
        figures.dbos_fresh_us.append(fresh["ns"] / steps / 1e3)
        figures.dbos_replay_us.append(replay["ns"] / steps / 1e3)
        figures.calls_in_replays["DBOS"] = figures.calls_in_replays.get("DBOS", 0) + replay["calls"]

    def stream_check(self, figures: Figures) -> None:
        workflow_id = str(uuid.uuid4())
        with self.SetWorkflowID(workflow_id):
            self.chat("tokens")
        figures.stream_read = list(self.DBOS.read_stream(workflow_id, "tokens"))

    def close(self) -> None:
        self.DBOS.destroy(destroy_registry=True)
        with self.admin.connect() as conn:
            conn.execute(self.sa.text(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)'))
        self.admin.dispose()


async def measure(steps: int, rounds: int, postgres: str) -> dict[str, Figures]:
    """Both sides' rounds alternated, so that both see the same machine load."""
    results: dict[str, Figures] = {}
    weclaw = WeclawSide()
    try:
        await weclaw.start()
        for commit in ("on", "off"):
            figures = results[commit] = Figures()
            dbos = await asyncio.to_thread(DbosSide, postgres, commit)
            try:
                if commit == "on":
                    await asyncio.to_thread(dbos.stream_check, figures)
                for _ in range(rounds):
                    await weclaw.one_round(steps, figures)
                    await asyncio.to_thread(dbos.one_round, steps, figures)
            finally:
                await asyncio.to_thread(dbos.close)
    finally:
        await weclaw.close()
    return results


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
        f"PostgreSQL synchronous_commit {commit} (each commit flushed to disk when on); "
        f"{load()}"
    )


def load() -> str:
    """The machine's load: other work on it slows both sides."""
    one, five, _ = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {one:.1f} (1 min), {five:.1f} (5 min)"


# --- DBOS: a killed process's workflow ---------------------------------------------------------

RECOVERY_STEP_S = 0.2
RECOVERY_STEPS = 50
RECOVERY_KILL_AT = 3


def dbos_child(url: str, executor_id: str, workflow_id: str) -> None:
    """One DBOS process (``--dbos-child``): launches, and starts the long workflow if asked."""
    from dbos import DBOS, SetWorkflowID

    DBOS(
        config={
            "name": "weclaw-bench-recovery",
            "system_database_url": url,
            "executor_id": executor_id,
            # One version for every process, so that any of them may recover the workflow.
            "application_version": "bench-1",
            "log_level": "ERROR",
        }
    )

    @DBOS.step()
    def tick(i: int) -> int:
        time.sleep(RECOVERY_STEP_S)  # a model call
        return i

    @DBOS.workflow()
    def long_agent(n: int) -> int:
        for i in range(n):
            tick(i)
        return n

    DBOS.launch()
    print("launched", flush=True)
    if workflow_id != "-":
        with SetWorkflowID(workflow_id):
            DBOS.start_workflow(long_agent, RECOVERY_STEPS)
    while True:
        time.sleep(1)


@dataclass
class Recovery:
    killed_at_step: int = 0
    other_executor_wait_s: float = 0.0
    steps_under_other_executor: int = 0
    restart_launch_s: float = 0.0
    restart_first_step_s: float = 0.0


def dbos_recovery(postgres: str, wait_s: float) -> Recovery:
    """kill -9 the process running a workflow; what another live process, then a restart, do.

    A: executor "a" starts the workflow (50 steps of 0.2 s) and is SIGKILLed after its 3rd
    step is checkpointed. B: executor "b", already running, is watched for ``wait_s``.
    C: executor "a" started again; timed from its start to its launch and to the next
    step checkpointed.
    """
    import subprocess

    import sqlalchemy as sa

    database = f"weclaw_bench_dbos_{uuid.uuid4().hex[:10]}"
    url = f"{postgres}/{database}"
    workflow_id = str(uuid.uuid4())
    admin = sa.create_engine(f"{postgres}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{database}"'))
    engine = sa.create_engine(url)
    children: list[subprocess.Popen[str]] = []

    def spawn(executor_id: str, start: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--dbos-child", url, executor_id, start],
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        return child

    def launched(child: subprocess.Popen[str]) -> None:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.strip() != "launched":
            raise RuntimeError(f"a DBOS child did not launch (exit {child.poll()})")

    def steps_done() -> int:
        try:
            with engine.connect() as conn:
                query = "SELECT count(*) FROM dbos.operation_outputs WHERE workflow_uuid = :w"
                return int(conn.execute(sa.text(query), {"w": workflow_id}).scalar() or 0)
        except sa.exc.ProgrammingError:
            return 0  # the schema is not made yet

    def wait_steps(more_than: int, timeout_s: float) -> float:
        started = time.perf_counter()
        while steps_done() <= more_than:
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"no step past {more_than} within {timeout_s} s")
            time.sleep(0.02)
        return time.perf_counter() - started

    result = Recovery()
    try:
        first = spawn("a", workflow_id)
        launched(first)
        wait_steps(RECOVERY_KILL_AT - 1, 60)
        first.kill()  # SIGKILL: no shutdown of any kind
        first.wait()
        result.killed_at_step = steps_done()
        other = spawn("b", "-")
        launched(other)
        time.sleep(wait_s)  # watching for progress that should not come; nothing to await
        result.other_executor_wait_s = wait_s
        result.steps_under_other_executor = steps_done() - result.killed_at_step
        started = time.perf_counter()
        again = spawn("a", "-")
        launched(again)
        result.restart_launch_s = time.perf_counter() - started
        wait_steps(result.killed_at_step + result.steps_under_other_executor, 60)
        result.restart_first_step_s = time.perf_counter() - started
    finally:
        for child in children:
            child.kill()
            child.wait()
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()
    return result


# --- report ----------------------------------------------------------------------------------


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f} - {max(values):.0f})"


def report(results: dict[str, Figures], steps: int) -> int:
    print(
        f"memoized steps: {steps} no-op steps a run, per-step time inside the run (us), "
        "median (min - max) over the rounds; ratio: DBOS / weclaw_mq per round, median"
    )
    columns = ["DBOS synchronous_commit", "rounds", "measure", "weclaw_mq ctx.step"]
    print("| " + " | ".join([*columns, "DBOS @DBOS.step", "ratio"]) + " |")
    print("|---|---|---|---|---|---|")
    status = 0
    for commit, f in results.items():
        pairs = (
            ("fresh (called + recorded)", f.weclaw_fresh_us, f.dbos_fresh_us),
            ("replayed (from the records)", f.weclaw_replay_us, f.dbos_replay_us),
        )
        for name, ours, theirs in pairs:
            if not ours or len(ours) != len(theirs):
                print(f"| {commit} | - | {name} | NO DATA | | |")
                status = 1
                continue
            ratio = statistics.median(d / w for w, d in zip(ours, theirs, strict=True))
            print(
                f"| {commit} | {len(ours)} | {name} | {cell(ours)} | {cell(theirs)} | {ratio:.1f} |"
            )
        for side, calls in f.calls_in_replays.items():
            if calls:
                print(f"ERROR: {side}'s replays called the step function {calls} times")
                status = 1
        if f.stream_read:
            print(
                f"DBOS: a {STREAM_CHUNKS}-chunk streamed step retried after "
                f"{STREAM_BREAK_AT} chunks: its reader got {len(f.stream_read)} values: "
                + " ".join(f.stream_read)
            )
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks.contenders.durable_steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=200, help="steps per run")
    p.add_argument("--rounds", type=int, default=7, help="runs of each, per DBOS setting")
    p.add_argument(
        "--postgres",
        default="postgresql://postgres@localhost:5432",
        help="PostgreSQL server for DBOS (a database of its own is made and dropped)",
    )
    p.add_argument(
        "--recovery-wait-s",
        type=float,
        default=30.0,
        help="how long another live DBOS process is watched after the kill",
    )
    p.add_argument("--smoke", action="store_true", help="tiny counts (a few seconds)")
    p.add_argument(
        "--dbos-child", nargs=3, metavar=("URL", "EXECUTOR", "WORKFLOW"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds, args.recovery_wait_s = 20, 1, 2.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dbos_child:
        dbos_child(*args.dbos_child)
        return 0
    print(servers(args.postgres))
    status = report(asyncio.run(measure(args.steps, args.rounds, args.postgres)), args.steps)
    r = dbos_recovery(args.postgres, args.recovery_wait_s)
    print(
        f"DBOS kill -9: the workflow's process (executor a) killed after step "
        f"{r.killed_at_step} of {RECOVERY_STEPS} ({RECOVERY_STEP_S} s each); another live "
        f"process (executor b) ran {r.steps_under_other_executor} of its steps in "
        f"{r.other_executor_wait_s:.0f} s; executor a restarted: launched in "
        f"{r.restart_launch_s:.2f} s, its next step checkpointed "
        f"{r.restart_first_step_s:.2f} s after its start"
    )
    print(f"at the end: {load()}")
    return status


if __name__ == "__main__":
    sys.exit(main())

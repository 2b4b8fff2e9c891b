"""``make demo``: the whole path of a task, end to end, on the local broker and Redis.

1. ``weclaw-mq declare consumers.demo:app`` declares the demo queue, its delay queues and DLQ.
2. ``weclaw-mq worker consumers.demo:app --concurrency 4`` starts a worker process.
3. ``app.publish`` sends N prompts; each returns once RabbitMQ confirmed it.
4. ``app.result(task_id)`` waits for each task's terminal state in the result store.
5. SIGTERM stops the worker cleanly (it finishes in-flight tasks, exit code 0).

Usage: ``python -m consumers.demo_run [N]`` (N defaults to ``$DEMO_TASKS`` or 10). The queue
is ``$DEMO_QUEUE`` (default ``ai-tasks``); nothing is deleted afterwards: the queues are
yours, and a second run reuses them. Exits non-zero if a task has no terminal result, or the
worker did not stop cleanly.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from consumers.demo import QUEUE, Prompt, app
from weclaw_mq import TaskState, TaskStatus
from weclaw_mq.errors import ResultTimeoutError

APP_PATH = "consumers.demo:app"
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT_TIMEOUT_S = 60.0
WORKER_STOP_TIMEOUT_S = 40.0
WORKER_START_TIMEOUT_S = 30.0
# The worker logs this once its consumers are registered.
CONSUMING_MARK = " consuming "
CONCURRENCY = 4
TERMINAL = (TaskStatus.SUCCEEDED, TaskStatus.DEAD_LETTERED)

PROMPTS = (
    "Write a haiku about message queues",
    "Explain at-least-once delivery to a five-year-old",
    "Draft a polite reply to a customer whose order is late",
    "Summarise the plot of Hamlet in two lines",
    "Suggest three names for a crash-proof task runner",
)


def say(line: str) -> None:
    print(line, flush=True)


def cli_path() -> str:
    """The ``weclaw-mq`` script of this interpreter's environment (the venv), else PATH's."""
    beside = Path(sys.executable).with_name("weclaw-mq")
    if beside.exists():
        return str(beside)
    found = shutil.which("weclaw-mq")
    if found is None:
        raise SystemExit("weclaw-mq is not installed: run 'make install' first")
    return found


async def run_cli(args: Sequence[str]) -> int:
    say(f"$ weclaw-mq {' '.join(args)}")
    proc = await asyncio.create_subprocess_exec(cli_path(), *args, cwd=REPO_ROOT)
    return await proc.wait()


async def start_worker() -> tuple[asyncio.subprocess.Process, asyncio.Task[None], asyncio.Event]:
    # INFO whatever WECLAW_MQ_LOG_LEVEL says: the "consuming" line tells us it is ready.
    args = ("worker", APP_PATH, "--concurrency", str(CONCURRENCY), "--log-level", "INFO")
    say(f"$ weclaw-mq {' '.join(args)} &")
    proc = await asyncio.create_subprocess_exec(
        cli_path(),
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    ready = asyncio.Event()
    return proc, asyncio.create_task(_relay(proc.stdout, ready)), ready


async def _relay(stream: asyncio.StreamReader, ready: asyncio.Event) -> None:
    # Prefixed so the worker's log lines (retries included) stand apart from ours.
    async for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        say("  worker | " + line)
        if CONSUMING_MARK in line:
            ready.set()


async def wait_until_consuming(worker: asyncio.subprocess.Process, ready: asyncio.Event) -> bool:
    """True once the worker consumes; False if it exited or did not get there in time.

    Waiting matters when another worker already serves the queue: our tasks could all be
    done before this one has installed its SIGTERM handler, and the stop would not be clean.
    """
    consuming = asyncio.create_task(ready.wait())
    exited = asyncio.create_task(worker.wait())
    done, _ = await asyncio.wait(
        {consuming, exited}, timeout=WORKER_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    consuming.cancel()
    exited.cancel()
    return consuming in done


async def collect(task_ids: Sequence[str]) -> list[TaskState | BaseException]:
    outcomes = await asyncio.gather(
        *(app.result(t, queue=QUEUE, timeout_s=RESULT_TIMEOUT_S) for t in task_ids),
        return_exceptions=True,
    )
    return list(outcomes)


async def collect_unless_worker_dies(
    task_ids: Sequence[str], worker: asyncio.subprocess.Process
) -> list[TaskState | BaseException] | None:
    """The outcomes, or None if the worker exited first (no point waiting 60 s for it)."""
    results = asyncio.create_task(collect(task_ids))
    exited = asyncio.create_task(worker.wait())
    done, _ = await asyncio.wait({results, exited}, return_when=asyncio.FIRST_COMPLETED)
    if results in done:
        exited.cancel()
        return results.result()
    results.cancel()
    return None


async def stop_worker(worker: asyncio.subprocess.Process) -> int:
    if worker.returncode is not None:
        return worker.returncode
    say("sending SIGTERM to the worker (it finishes in-flight tasks, then exits)")
    worker.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(worker.wait(), WORKER_STOP_TIMEOUT_S)
    except TimeoutError:
        say(f"worker still running {WORKER_STOP_TIMEOUT_S:.0f} s after SIGTERM; killing it")
        worker.kill()
        await worker.wait()
        return -signal.SIGKILL


def describe(outcome: TaskState | BaseException) -> tuple[str, str, str]:
    """(status, attempts, reply or reason) for one table row."""
    if isinstance(outcome, ResultTimeoutError):
        return "NO RESULT", "-", f"nothing terminal within {RESULT_TIMEOUT_S:.0f} s"
    if isinstance(outcome, BaseException):
        return "ERROR", "-", f"{type(outcome).__name__}: {outcome}"
    result: Any = outcome.result
    if outcome.status is TaskStatus.SUCCEEDED and isinstance(result, dict):
        text = str(result.get("reply", result))
    else:
        text = ": ".join(part for part in (outcome.reason, outcome.error) if part)
    return outcome.status.value, str(outcome.attempt), text


def print_table(task_ids: Sequence[str], outcomes: Sequence[TaskState | BaseException]) -> None:
    say("")
    say(f"{'task id':36}  {'status':13}  {'attempts':8}  reply")
    say(f"{'-' * 36}  {'-' * 13}  {'-' * 8}  {'-' * 40}")
    for task_id, outcome in zip(task_ids, outcomes, strict=True):
        status, attempts, text = describe(outcome)
        short = text if len(text) <= 60 else text[:57] + "..."
        say(f"{task_id:36}  {status:13}  {attempts:>8}  {short}")
    say("")


async def main(count: int) -> int:
    say(f"demo: {count} task(s) on queue {QUEUE!r}")
    if await run_cli(["declare", APP_PATH]) != 0:
        say("demo: could not declare the queues; is RabbitMQ running? (see README, Prerequisites)")
        return 1
    worker, relay, ready = await start_worker()
    task_ids: list[str] = []
    outcomes: list[TaskState | BaseException] | None = None
    try:
        if not await wait_until_consuming(worker, ready):
            if worker.returncode is not None:
                say(f"demo: the worker exited with code {worker.returncode} before consuming")
            else:
                say(f"demo: the worker did not consume within {WORKER_START_TIMEOUT_S:.0f} s")
            return 1
        async with app:
            for i in range(count):
                prompt = Prompt(text=PROMPTS[i % len(PROMPTS)], user_id=f"user-{i % 3}")
                task_ids.append(await app.publish(QUEUE, prompt))
            say(f"published {len(task_ids)} task(s), each confirmed by the broker")
            say(f"waiting for their results (up to {RESULT_TIMEOUT_S:.0f} s)")
            outcomes = await collect_unless_worker_dies(task_ids, worker)
    finally:
        worker_code = await stop_worker(worker)
        await relay
    if outcomes is None:
        say(f"demo: the worker exited with code {worker_code} before every task finished")
        return 1

    print_table(task_ids, outcomes)
    states = [o for o in outcomes if isinstance(o, TaskState)]
    succeeded = sum(s.status is TaskStatus.SUCCEEDED for s in states)
    dead = sum(s.status is TaskStatus.DEAD_LETTERED for s in states)
    missing = len(task_ids) - succeeded - dead
    say(f"worker exited with code {worker_code}")
    say(
        f"summary: {len(task_ids)} published, {succeeded} succeeded, {dead} dead-lettered"
        + (f", {missing} without a terminal result" if missing else "")
    )
    if dead:
        say(f"dead-lettered tasks wait in {QUEUE}.dlq with their reason in the headers")
    return 0 if missing == 0 and worker_code == 0 else 1


def parse_count(argv: Sequence[str]) -> int:
    raw = argv[1] if len(argv) > 1 else os.environ.get("DEMO_TASKS", "10")
    try:
        count = int(raw)
    except ValueError:
        raise SystemExit(
            f"usage: python -m consumers.demo_run [N]; N={raw!r} is no number"
        ) from None
    if count < 1:
        raise SystemExit("N must be at least 1")
    return count


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_count(sys.argv))))

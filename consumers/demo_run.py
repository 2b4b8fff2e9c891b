"""``make demo``: the whole path of a task, end to end, on the local broker and Redis.

1. ``weclaw-mq declare consumers.demo:app`` declares the demo queue, its delay queues and DLQ.
2. ``weclaw-mq worker consumers.demo:app --concurrency 4`` starts a worker process.
3. One reply streams (``app.stream(task_id)``); after a few words the worker is killed with
   SIGKILL and a new one started. The broker gives the task to the new worker, whose run
   reads what the dead run streamed (``ctx.emitted()``) and continues the reply from there:
   the reader's line goes on where it stopped. The demo checks that what it read is exactly
   the stored reply: complete, no word twice, and that the new run continued it.
4. ``app.publish`` sends N prompts; each returns once RabbitMQ confirmed it.
5. ``app.result(task_id)`` waits for each task's terminal state in the result store.
6. SIGTERM stops the worker cleanly (it finishes in-flight tasks, exit code 0).

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
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consumers.demo import QUEUE, Prompt, app, reply_to
from weclaw_mq import StreamEvent, TaskState, TaskStatus
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
# The crash scene: the worker is killed once this many words of the reply were read.
SCENE_PROMPT = "Explain why a worker should ack a task only after its result is stored"
KILL_AFTER_WORDS = 8
SCENE_TIMEOUT_S = 60.0
DEMO_GUARD_LEASE_S = 2.0

PROMPTS = (
    "Write a haiku about message queues",
    "Explain at-least-once delivery to a five-year-old",
    "Draft a polite reply to a customer whose order is late",
    "Summarise the plot of Hamlet in two lines",
    "Suggest three names for a crash-proof task runner",
)


# True while the streamed reply's line is open: the next whole line starts on a new one.
_mid_line = [False]


def say(line: str) -> None:
    if _mid_line[0]:
        print(flush=True)
        _mid_line[0] = False
    print(line, flush=True)


def say_more(text: str) -> None:
    """Continue the current line (a streamed reply, word by word)."""
    print(text, end="", flush=True)
    _mid_line[0] = True


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


@dataclass
class WorkerProcess:
    """A ``weclaw-mq worker`` child process and the task relaying its log lines to ours."""

    proc: asyncio.subprocess.Process
    # While False the relay drops the log lines (a reply is being printed word by word).
    echo: bool
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    relay: asyncio.Task[None] | None = None


async def start_worker(*, echo: bool = True) -> WorkerProcess:
    # INFO whatever WECLAW_MQ_LOG_LEVEL says: the "consuming" line tells us it is ready.
    args = ("worker", APP_PATH, "--concurrency", str(CONCURRENCY), "--log-level", "INFO")
    say(f"$ weclaw-mq {' '.join(args)} &")
    # A killed worker's claim on its task lapses after the guard lease; the demo's is short
    # so the crash scene recovers in seconds (production's default is 30 s).
    env = {"WECLAW_MQ_GUARD_LEASE_S": str(DEMO_GUARD_LEASE_S), **os.environ}
    proc = await asyncio.create_subprocess_exec(
        cli_path(),
        *args,
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    worker = WorkerProcess(proc, echo)
    worker.relay = asyncio.create_task(_relay(worker))
    return worker


async def _relay(worker: WorkerProcess) -> None:
    # Prefixed so the worker's log lines (retries included) stand apart from ours.
    assert worker.proc.stdout is not None
    async for raw in worker.proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        if worker.echo:
            say("  worker | " + line)
        if CONSUMING_MARK in line:
            worker.ready.set()


async def wait_until_consuming(worker: WorkerProcess) -> bool:
    """True once the worker consumes; False if it exited or did not get there in time.

    Waiting matters when another worker already serves the queue: our tasks could all be
    done before this one has installed its SIGTERM handler, and the stop would not be clean.
    """
    consuming = asyncio.create_task(worker.ready.wait())
    exited = asyncio.create_task(worker.proc.wait())
    done, _ = await asyncio.wait(
        {consuming, exited}, timeout=WORKER_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
    )
    consuming.cancel()
    exited.cancel()
    return consuming in done


async def started_worker() -> WorkerProcess | None:
    """A new worker once it consumes; None (and why, said) if it did not get there."""
    worker = await start_worker()
    if await wait_until_consuming(worker):
        return worker
    if worker.proc.returncode is not None:
        say(f"demo: the worker exited with code {worker.proc.returncode} before consuming")
    else:
        say(f"demo: the worker did not consume within {WORKER_START_TIMEOUT_S:.0f} s")
    await stop_worker(worker)
    return None


async def collect(task_ids: Sequence[str]) -> list[TaskState | BaseException]:
    outcomes = await asyncio.gather(
        *(app.result(t, queue=QUEUE, timeout_s=RESULT_TIMEOUT_S) for t in task_ids),
        return_exceptions=True,
    )
    return list(outcomes)


async def collect_unless_worker_dies(
    task_ids: Sequence[str], worker: WorkerProcess
) -> list[TaskState | BaseException] | None:
    """The outcomes, or None if the worker exited first (no point waiting 60 s for it)."""
    results = asyncio.create_task(collect(task_ids))
    exited = asyncio.create_task(worker.proc.wait())
    done, _ = await asyncio.wait({results, exited}, return_when=asyncio.FIRST_COMPLETED)
    if results in done:
        exited.cancel()
        return results.result()
    results.cancel()
    return None


async def stop_worker(worker: WorkerProcess) -> int:
    proc = worker.proc
    if proc.returncode is None:
        say("sending SIGTERM to the worker (it finishes in-flight tasks, then exits)")
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), WORKER_STOP_TIMEOUT_S)
        except TimeoutError:
            say(f"worker still running {WORKER_STOP_TIMEOUT_S:.0f} s after SIGTERM; killing it")
            proc.kill()
            await proc.wait()
    if worker.relay is not None:
        await worker.relay
    assert proc.returncode is not None
    return proc.returncode


@dataclass
class Reading:
    """What a reader of one task's stream shows: the words after the last "attempt" marker
    (a run that continues the text writes none, so its words follow the earlier ones)."""

    words: list[str] = field(default_factory=list)
    runs: int = 0
    discarded: int = 0
    final: StreamEvent | None = None

    def apply(self, event: StreamEvent) -> None:
        if event.kind == "attempt":
            # A run that starts afresh: the words of the run before it are thrown away.
            self.runs += 1
            if self.words:
                say(f"[attempt] a new run starts; the {len(self.words)} words above are discarded")
                self.discarded += len(self.words)
            say_more("[attempt] ")
            self.words = []
        elif event.kind == "chunk":
            self.words.append(str(event.data))
            say_more(str(event.data))
        elif event.kind == "final":
            self.final = event


async def crash_scene(workers: list[WorkerProcess]) -> bool:
    """Stream one reply, SIGKILL its worker after ``KILL_AFTER_WORDS`` words, start another
    (appended to ``workers``); True if what was read is exactly the stored reply."""
    say("")
    say(f"-- one reply, streamed; its worker is killed with SIGKILL after {KILL_AFTER_WORDS} words")
    task_id = await app.publish(QUEUE, Prompt(text=SCENE_PROMPT, user_id="viewer"))
    say(f"published task {task_id}; reading app.stream(task_id) (worker logs hidden meanwhile)")
    workers[-1].echo = False
    reading = Reading()
    replacement: asyncio.Task[None] | None = None
    events = app.stream(task_id)
    try:
        async with asyncio.timeout(SCENE_TIMEOUT_S):
            async for event in events:
                reading.apply(event)
                if reading.final is not None:
                    break
                if replacement is None and len(reading.words) == KILL_AFTER_WORDS:
                    replacement = asyncio.create_task(kill_and_replace(workers))
    except TimeoutError:
        say(f"demo: the streamed reply did not end within {SCENE_TIMEOUT_S:.0f} s")
    finally:
        await aclose(events)
        if replacement is not None:
            await replacement
        for worker in workers:
            worker.echo = True
    return verdict(reading, SCENE_PROMPT)


async def aclose(events: AsyncIterator[StreamEvent]) -> None:
    # Left by a break, a stream stays open (with its wait on the task's record) until the
    # garbage collector finds it: close it now.
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


async def kill_and_replace(workers: list[WorkerProcess]) -> None:
    """SIGKILL the newest worker, start another (appended to ``workers``) and wait until it
    consumes: the broker gives it the dead worker's unacked task."""
    dead = workers[-1]
    say(f"$ kill -9 {dead.proc.pid}   (the worker dies mid-reply; its task was never acked)")
    dead.proc.kill()
    await dead.proc.wait()
    new = await start_worker(echo=False)
    workers.append(new)
    if not await wait_until_consuming(new):
        say("demo: the new worker did not start consuming")


def verdict(reading: Reading, prompt: str) -> bool:
    final = reading.final
    if final is None:
        return False
    text = "".join(reading.words)
    result = final.result if isinstance(final.result, dict) else {}
    stored = result.get("reply")
    continued = result.get("continued_after_words", 0)
    say(
        f"[final] {final.status}; the last run continued after {continued} words; "
        f"{reading.runs} attempt marker(s), {reading.discarded} words discarded"
    )
    complete = final.status == "succeeded" and text == stored == reply_to(prompt)
    if complete:
        say(f"check: the text read is the stored reply, {len(reading.words)} words, none twice: OK")
    else:
        say(f"check: FAILED: read {text!r}, stored {stored!r}")
    return complete


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
    started = time.monotonic()
    say(f"demo: one streamed reply through a worker crash, then {count} task(s) on {QUEUE!r}")
    if await run_cli(["declare", APP_PATH]) != 0:
        say(
            "demo: could not declare the queues; is RabbitMQ running? "
            "(see docs/operations/local-services.md)"
        )
        return 1
    workers: list[WorkerProcess] = []
    task_ids: list[str] = []
    outcomes: list[TaskState | BaseException] | None = None
    streamed_ok = False
    try:
        first = await started_worker()
        if first is None:
            return 1
        workers.append(first)
        async with app:
            streamed_ok = await crash_scene(workers)
            worker = workers[-1]
            if worker.proc.returncode is not None or not worker.ready.is_set():
                say("demo: no worker is left to run the tasks")
                return 1
            for i in range(count):
                prompt = Prompt(text=PROMPTS[i % len(PROMPTS)], user_id=f"user-{i % 3}")
                task_ids.append(await app.publish(QUEUE, prompt))
            say(f"published {len(task_ids)} task(s), each confirmed by the broker")
            say(f"waiting for their results (up to {RESULT_TIMEOUT_S:.0f} s)")
            outcomes = await collect_unless_worker_dies(task_ids, worker)
    finally:
        # The killed worker is already gone; stop_worker only reaps it.
        codes = [await stop_worker(w) for w in workers]
    worker_code = codes[-1]
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
        + f"; streamed reply through the crash: {'complete' if streamed_ok else 'NOT complete'}"
    )
    if dead:
        say(f"dead-lettered tasks wait in {QUEUE}.dlq with their reason in the headers")
    say(f"demo took {time.monotonic() - started:.0f} s")
    return 0 if missing == 0 and worker_code == 0 and streamed_ok else 1


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

"""The apps the fault drills run, and the in-memory control they are compared with.

``app``: a weclaw_mq worker app, run as ``weclaw-mq worker tests.drills.drill_app:app`` (cwd at
the repository root). Its handler's side effect is one line appended to ``$DRILL_EFFECTS``,
written OUTSIDE the process (O_APPEND, one write per line), so a drill can count effects and
duplicates even after it SIGKILLed the worker or paused the broker under it.

Environment of ``app``:
    DRILL_QUEUE     the handler's queue (required)
    DRILL_EFFECTS   the effects file (required)
    DRILL_SLEEP_S   how long each handler call takes (default 0)
The ``WECLAW_MQ_*`` settings apply as in any app.

The control, ``python -m tests.drills.drill_app in-memory --tasks N --effects FILE``: the same
handler fed by a plain ``asyncio.Queue`` inside one process, the queue most hand-rolled
pipelines start with. ``--restart`` runs it as the process started again after a crash: it
has no way to know what the dead process still held, so it starts with an empty queue.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from weclaw_mq import App, Context, Settings, WeclawMQError

if TYPE_CHECKING:
    from tests.integration.processes import WorkerProcess

APP_PATH = "tests.drills.drill_app:app"


class Job(BaseModel):
    n: int


def record_effect(effects: Path, task_id: str) -> None:
    # One write() on an O_APPEND file: lines from concurrent handlers and processes never
    # interleave, and the page cache keeps the line even if the process is SIGKILLed next.
    line = f"{task_id} {os.getpid()} {time.time():.6f}\n"
    fd = os.open(effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_effects(effects: Path) -> Counter[str]:
    """How many times each task id's effect happened."""
    if not effects.exists():
        return Counter()
    return Counter(line.split(" ", 1)[0] for line in effects.read_text().splitlines() if line)


def build_app(queue: str, *, settings: Settings, effects: Path, sleep_s: float = 0.0) -> App:
    app = App("drill", settings=settings)

    @app.handler(queue)
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        await asyncio.sleep(sleep_s)
        record_effect(effects, ctx.task_id)
        return {"n": task.n}

    return app


def spawn_worker(
    *,
    queue: str,
    settings: Settings,
    effects: Path,
    log_path: Path,
    concurrency: int = 1,
    sleep_s: float = 0.0,
) -> WorkerProcess:
    """Start ``weclaw-mq worker`` on this app; the caller kills it by pid when done."""
    # Imported here: the worker process itself never needs the test helpers.
    from tests.integration.processes import spawn_cli_worker

    app_env = {"DRILL_QUEUE": queue, "DRILL_EFFECTS": str(effects), "DRILL_SLEEP_S": str(sleep_s)}
    return spawn_cli_worker(
        APP_PATH, settings=settings, app_env=app_env, log_path=log_path, concurrency=concurrency
    )


async def publish_jobs(app: App, queue: str, ids: list[str], *, in_flight: int = 50) -> None:
    """Publish one Job per task id with ``in_flight`` publishes pending at a time."""
    pending = iter(enumerate(ids))

    async def lane() -> None:
        for n, task_id in pending:
            await app.publish(queue, Job(n=n), task_id=task_id)

    await asyncio.gather(*(lane() for _ in range(in_flight)))


# Log lines of the worker the drills watch for.
CONSUMING = " consuming "
LOST = "broker connection lost"
_CANCELLED_AT_STOP = re.compile(r"(\d+) task\(s\) still running after the grace period")
# The drills' workers get a short grace: a clean stop takes well under a second.
GRACE_S = 5.0


async def stop_worker(worker: WorkerProcess) -> tuple[int, int]:
    """SIGTERM, then wait for the exit: (exit code, handler tasks still running when the
    grace period ended). Every task of a drill has run by then, so any such task is stuck."""
    worker.signal(signal.SIGTERM)
    code = await worker.wait_exit(GRACE_S + 20)
    found = _CANCELLED_AT_STOP.search(worker.log())
    return code, int(found.group(1)) if found else 0


def stuck_at_stop(count: int) -> str:
    return (
        f"{count} handler task(s) were still pending at SIGTERM although every task had run "
        f"and the queue was empty; the worker waited out its {GRACE_S} s grace and cancelled "
        "them (seen stuck in message.ack() on a connection that had died: aiormq's "
        "write_queue.put() never returns)"
    )


class Outcomes:
    """What became of each publish: confirmed, raised (and what), or still pending at its
    deadline (a hang: the one outcome the library promises never to produce)."""

    def __init__(self) -> None:
        self.confirmed: set[str] = set()
        self.failed: dict[str, Exception] = {}
        self.hung: set[str] = set()
        self.foreign: dict[str, BaseException] = {}  # raised something not a WeclawMQError
        self.slowest_s = 0.0

    async def publish(self, app: App, queue: str, n: int, task_id: str, limit_s: float) -> None:
        began = time.monotonic()
        try:
            await asyncio.wait_for(app.publish(queue, Job(n=n), task_id=task_id), limit_s)
        except TimeoutError:
            self.hung.add(task_id)
        except WeclawMQError as e:
            self.failed[task_id] = e
        except asyncio.CancelledError as e:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are being cancelled: not an outcome of the publish
            self.foreign[task_id] = e  # a CancelledError the library let out
        except Exception as e:
            self.foreign[task_id] = e
        else:
            self.confirmed.add(task_id)
        self.slowest_s = max(self.slowest_s, time.monotonic() - began)

    def error_kinds(self) -> str:
        kinds = Counter(type(e).__name__ for e in self.failed.values())
        return ", ".join(f"{k} x{v}" for k, v in kinds.most_common()) or "none"

    def summary(self) -> str:
        parts = [f"{self.error_kinds()}"]
        if self.confirmed:
            parts.append(f"{len(self.confirmed)} confirmed")
        if self.hung:
            parts.append(f"{len(self.hung)} still pending after the drill's limit")
        return f"{'; '.join(parts)}; slowest {self.slowest_s:.1f} s"


# -- the in-memory control --------------------------------------------------------------------


async def run_in_memory(*, tasks: int, effects: Path, sleep_s: float, restart: bool) -> int:
    """Feed ``tasks`` jobs through an asyncio.Queue to one consumer; returns how many ran."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    if not restart:
        # "Publishing": the producer is done once the task sits in memory.
        for n in range(tasks):
            queue.put_nowait(f"inmem-{n:05d}")
    done = 0

    async def consume() -> None:
        nonlocal done
        while True:
            task_id = await queue.get()
            await asyncio.sleep(sleep_s)
            record_effect(effects, task_id)
            done += 1
            queue.task_done()

    consumer = asyncio.create_task(consume())
    await queue.join()
    consumer.cancel()
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.drills.drill_app")
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("in-memory", help="the asyncio.Queue control")
    mem.add_argument("--tasks", type=int, default=1000)
    mem.add_argument("--effects", type=Path, required=True)
    mem.add_argument("--sleep-s", type=float, default=0.005)
    mem.add_argument("--restart", action="store_true", help="start as after a crash")
    args = parser.parse_args(argv)
    print("in-memory consumer running", flush=True)
    done = asyncio.run(
        run_in_memory(
            tasks=args.tasks, effects=args.effects, sleep_s=args.sleep_s, restart=args.restart
        )
    )
    print(f"in-memory queue drained: {done} task(s) ran", flush=True)
    return 0


def _app_from_env() -> App:
    queue, effects = required_env(__name__, "DRILL_QUEUE", "DRILL_EFFECTS")
    return build_app(
        queue,
        settings=Settings(),
        effects=Path(effects),
        sleep_s=float(os.environ.get("DRILL_SLEEP_S", "0")),
    )


# Built on first access rather than at import, so drills can import the helpers without the
# worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)


if __name__ == "__main__":
    sys.exit(main())

"""weclaw_mq as ``weclaw-mq worker APP --processes N`` runs it: the supervisor and N children.

The contender process starts the real CLI (``python -m weclaw_mq.cli worker
benchmarks.contenders.weclaw_processes:app --processes N --concurrency C``) on "go". Each
worker child imports this module as its app: the same handler and settings as the one-process
``weclaw`` contender (guard + results when ``guard``), and the same delivery and ack hooks,
which here count into a slot of its own, a small file mapped in memory (``SLOTS_ENV`` names
the folder): acks, first delivery and last ack (CLOCK_MONOTONIC, shared by all processes),
and CPU time. The contender sums the slots until every message is acked; the window runs
from the first delivery in any child to the last ack in any child, and CPU per message is the
children's CPU over that window, summed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import mmap
import os
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..common import ChildConfig, emit, expect, now_ns, stdin_lines
from .aio_hooks import track

SLOTS_ENV = "WECLAW_BENCH_SLOTS"
CONFIG_ENV = "WECLAW_BENCH_CONFIG"
GO_FILE = "go"
# acked, holds a delivery (1/0), last ack ns, CPU s when the gate opened, CPU s at last ack
SLOT = struct.Struct("<qqqdd")


class Slot:
    """This child's counters, in a file the contender reads while the child writes it.

    Handlers wait at a gate until the contender creates the go file: every child is then
    consuming (it holds a delivery) when the clock starts, as in the one-process case where
    the worker is connected before "go".
    """

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._go = folder / GO_FILE
        # Made in the child that writes it: the app is loaded once, in the supervisor, and
        # its children are forked from there (cli.supervisor).
        self._map: mmap.mmap | None = None
        self.acked = self.holding = self.last_ns = 0
        self.first_cpu = self.last_cpu = 0.0
        self._gate: asyncio.Event | None = None

    def delivered(self) -> None:
        if not self.holding:
            self.holding = 1
            self._write()

    async def gate(self) -> None:
        if self._gate is None:
            self._gate = asyncio.Event()
            asyncio.get_running_loop().create_task(self._watch())
        await self._gate.wait()

    async def _watch(self) -> None:
        assert self._gate is not None
        # Another process's signal: a file, polled (an asyncio.Event cannot cross processes).
        while not self._go.exists():  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        self.first_cpu = time.process_time()
        self._gate.set()

    def acked_one(self) -> None:
        self.acked += 1
        self.last_ns, self.last_cpu = now_ns(), time.process_time()
        self._write()

    def _write(self) -> None:
        if self._map is None:
            path = self._folder / f"{os.getpid()}.slot"
            path.write_bytes(b"\0" * SLOT.size)
            with path.open("r+b") as file:
                self._map = mmap.mmap(file.fileno(), SLOT.size)
        self._map[:] = SLOT.pack(
            self.acked, self.holding, self.last_ns, self.first_cpu, self.last_cpu
        )


@functools.cache
def _child_app() -> Any:
    """The app a worker child loads: the one-process contender's, with the slot hooks."""
    import weclaw_mq.worker.incoming  # noqa: F401  # imported before track(): its messages count

    from .weclaw import build_app

    cfg = ChildConfig(**json.loads(os.environ[CONFIG_ENV]))
    slot = Slot(Path(os.environ[SLOTS_ENV]))
    track(slot)
    app = build_app(cfg)

    @app.handler(cfg.queue, idempotent=cfg.guard)
    async def handle(task: dict[str, Any]) -> None:
        await slot.gate()

    return app


def read_slots(folder: Path) -> list[tuple[int, int, int, float, float]]:
    slots = []
    for path in folder.glob("*.slot"):
        data = path.read_bytes()
        if len(data) == SLOT.size:
            slots.append(SLOT.unpack(data))
    return slots


async def consume(cfg: ChildConfig) -> None:
    reader = await stdin_lines()
    processes = int(cfg.extra["processes"])
    with tempfile.TemporaryDirectory(prefix="weclaw-bench-slots-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, SLOTS_ENV: tmp, CONFIG_ENV: cfg.to_arg()}
        supervisor = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "weclaw_mq.cli",
            "worker",
            "benchmarks.contenders.weclaw_processes:app",
            "--processes",
            str(processes),
            "--concurrency",
            str(cfg.concurrency),
            "--log-level",
            "WARNING",
            env=env,
            start_new_session=True,  # our Ctrl-C is the orchestrator's to give
        )
        # Its own session, so a SIGKILL of this process would not reach it: the orchestrator
        # kills this group too when it gives up on us (infra.Child.kill).
        emit("spawned", process_groups=[supervisor.pid])
        try:
            # Ready once every child holds a delivery (the orchestrator fills meanwhile).
            while sum(s[1] for s in read_slots(folder)) < processes:
                if supervisor.returncode is not None:
                    raise SystemExit(f"the supervisor exited with {supervisor.returncode}")
                await asyncio.sleep(0.01)
            emit("ready", redis_round_trips=2 if cfg.guard else 0)
            await expect(reader, "go")
            started = now_ns()
            (folder / GO_FILE).touch()
            slots = read_slots(folder)
            while sum(s[0] for s in slots) < cfg.count:
                if supervisor.returncode is not None:
                    raise SystemExit(f"the supervisor exited with {supervisor.returncode}")
                await asyncio.sleep(0.005)
                slots = read_slots(folder)
            acked = sum(s[0] for s in slots)
            elapsed_s = (max(s[2] for s in slots) - started) / 1e9
            cpu_s = sum(s[4] - s[3] for s in slots if s[0])
            emit(
                "done",
                count=acked,
                elapsed_s=elapsed_s,
                rate=acked / elapsed_s if elapsed_s > 0 else 0.0,
                cpu_us=cpu_s / acked * 1e6,
            )
            await expect(reader, "stop")
        finally:
            if supervisor.returncode is None:
                supervisor.send_signal(signal.SIGTERM)  # a drain of every child
                try:
                    await asyncio.wait_for(supervisor.wait(), 30)
                except TimeoutError:
                    os.killpg(supervisor.pid, signal.SIGKILL)
                    await supervisor.wait()


def main() -> None:
    asyncio.run(consume(ChildConfig.from_argv()))


def __getattr__(name: str) -> Any:
    # ``app``: built when a worker child asks for it, never when the contender imports this.
    if name == "app":
        return _child_app()
    raise AttributeError(name)


if __name__ == "__main__":
    main()

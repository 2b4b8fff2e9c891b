"""Dramatiq 2 (``RabbitmqBroker``, pika, worker threads) on the same broker, in two modes.

One process (``processes`` absent): worker threads = prefetch = concurrency, like every
other contender at that concurrency.

Several processes (``extra["processes"]``, ``extra["threads"]``): what Dramatiq's docs and
CLI recommend, ``dramatiq`` with its defaults: one worker process per CPU, 8 threads each,
prefetch twice the threads, processes forked from a parent that has imported Dramatiq (the
CLI's start method before Python 3.14). This runs the Worker API in each forked child, as
the CLI does, and adds the bench's hooks. "First delivery" is the first in any process,
"last ack" the one that reaches the count in any process; CPU per message sums the worker
processes' CPU, each from its own first delivery to the last ack.

Dramatiq declares its own queues (``Q``, ``Q.DQ`` delay, ``Q.XQ`` dead letters); a subclass
adds ``x-queue-type: quorum`` to the arguments it builds for ``Q`` and ``Q.DQ`` so the work
queue is quorum like everyone else's (``Q.XQ`` stays classic: nothing reaches it here).
Dramatiq acks after the actor returned; its actors are sync.

Every worker process is stopped on every exit path: asked to stop, then killed after a
bound; and each asks the kernel to kill it if this parent dies (``PR_SET_PDEATHSIG``), so
even a SIGKILL of the parent by the orchestrator leaves none behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import ForkProcess
from multiprocessing.synchronize import Event, Lock, Semaphore
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Middleware

from ..common import ChildConfig, Tracker, emit, now_ns

ACTOR_NAME = "bench_noop"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0  # per worker process, before it is killed
PR_SET_PDEATHSIG = 1


class QuorumRabbitmqBroker(RabbitmqBroker):
    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call]
        arguments["x-queue-type"] = "quorum"
        return arguments


class Hooks(Middleware):
    """First delivery (a worker thread picks the message up) and every ack, under a lock:
    worker threads ack concurrently."""

    def __init__(self, delivered: Callable[[], None], acked: Callable[[], None]) -> None:
        self.delivered = delivered
        self.acked = acked
        self.first_seen = False
        self.lock = threading.Lock()

    def before_process_message(self, broker: Any, message: Any) -> None:
        if not self.first_seen:
            with self.lock:
                if not self.first_seen:
                    self.first_seen = True
                    self.delivered()

    def after_ack(self, broker: Any, message: Any) -> None:
        with self.lock:
            self.acked()


def build_broker(cfg: ChildConfig, hooks: Hooks) -> QuorumRabbitmqBroker:
    broker = QuorumRabbitmqBroker(url=cfg.amqp_url)
    broker.add_middleware(hooks)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=cfg.queue, actor_name=ACTOR_NAME, broker=broker)
    def bench_noop(task: dict[str, Any]) -> None:
        return None

    broker.declare_queue(cfg.queue, ensure=True)  # before "ready": the orchestrator fills it
    return broker


def expect(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"expected {word!r} from the orchestrator, got {line!r}")


def one_process(cfg: ChildConfig) -> None:
    done = threading.Event()
    tracker = Tracker(cfg.count, done.set)
    broker = build_broker(cfg, Hooks(tracker.delivered, tracker.acked_one))
    worker = dramatiq.Worker(broker, worker_threads=cfg.concurrency)
    worker.queue_prefetch = cfg.concurrency
    emit("ready")
    expect("go")
    worker.start()
    if not done.wait(timeout=cfg.extra.get("timeout_s", 600)):
        raise SystemExit("dramatiq: timed out before the last ack")
    emit("done", **tracker.result())
    expect("stop")
    worker.stop()
    broker.close()


@dataclass
class Shared:
    """What the worker processes share with the parent (fork: inherited, not pickled)."""

    target: int
    lock: Lock  # guards the three counters below (shared memory, no lock of their own)
    acked: Any  # ctypes c_longlong
    first_ns: Any
    last_ns: Any
    cpu_s: Any  # ctypes double array: per worker process, CPU from its first delivery to done
    ready: Semaphore  # released once by each worker process when it can start
    reported: Semaphore  # released once by each after writing its CPU
    go: Event
    done: Event
    stop: Event


def _die_with(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux), then check the
    parent did not die before that was in place."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def worker_process(cfg: ChildConfig, shared: Shared, index: int, parent_pid: int) -> None:
    _die_with(parent_pid)
    cpu_at_first = [0.0]

    def delivered() -> None:
        cpu_at_first[0] = time.process_time()
        with shared.lock:
            if not shared.first_ns.value:
                shared.first_ns.value = now_ns()

    def acked() -> None:
        with shared.lock:
            shared.acked.value += 1
            if shared.acked.value == shared.target:
                shared.last_ns.value = now_ns()
                shared.done.set()

    hooks = Hooks(delivered, acked)
    broker = build_broker(cfg, hooks)
    worker = dramatiq.Worker(broker, worker_threads=cfg.extra["threads"])  # default prefetch
    shared.ready.release()
    shared.go.wait()
    worker.start()
    shared.done.wait()
    shared.cpu_s[index] = time.process_time() - cpu_at_first[0] if hooks.first_seen else 0.0
    shared.reported.release()
    shared.stop.wait()
    worker.stop(timeout=int(STOP_TIMEOUT_S * 1000))
    broker.close()


def _acquire_all(sem: Semaphore, n: int, procs: list[ForkProcess], timeout_s: float) -> None:
    """``n`` releases of ``sem`` within ``timeout_s``; SystemExit if a process died first."""
    deadline = time.monotonic() + timeout_s
    for _ in range(n):
        while not sem.acquire(timeout=0.5):
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                codes = ", ".join(f"pid {p.pid}: {p.exitcode}" for p in dead)
                raise SystemExit(f"dramatiq: a worker process exited ({codes})")
            if time.monotonic() > deadline:
                raise SystemExit(f"dramatiq: worker processes not there within {timeout_s:.0f} s")


def _stop_all(procs: list[ForkProcess]) -> None:
    """Every worker process ends here: joined within a bound, else killed."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def several_processes(cfg: ChildConfig) -> None:
    ctx = multiprocessing.get_context("fork")
    n = int(cfg.extra["processes"])
    shared = Shared(
        target=cfg.count,
        lock=ctx.Lock(),
        acked=ctx.Value("q", 0, lock=False),
        first_ns=ctx.Value("q", 0, lock=False),
        last_ns=ctx.Value("q", 0, lock=False),
        cpu_s=ctx.Array("d", n, lock=False),
        ready=ctx.Semaphore(0),
        reported=ctx.Semaphore(0),
        go=ctx.Event(),
        done=ctx.Event(),
        stop=ctx.Event(),
    )
    procs: list[ForkProcess] = []
    try:
        for i in range(n):
            p = ctx.Process(
                target=worker_process, args=(cfg, shared, i, os.getpid()), name=f"dramatiq-{i}"
            )
            p.start()
            procs.append(p)
        _acquire_all(shared.ready, n, procs, READY_TIMEOUT_S)
        emit("ready", worker_pids=[p.pid for p in procs])
        expect("go")
        shared.go.set()
        _acquire_all(shared.reported, n, procs, float(cfg.extra.get("timeout_s", 600)))
        with shared.lock:
            elapsed_s = (shared.last_ns.value - shared.first_ns.value) / 1e9
            count = shared.acked.value
        cpu_s = sum(shared.cpu_s)
        emit(
            "done",
            count=count,
            elapsed_s=elapsed_s,
            rate=count / elapsed_s if elapsed_s > 0 else 0.0,
            cpu_us=cpu_s / count * 1e6 if count else 0.0,
            processes=n,
        )
        expect("stop")
    finally:
        # Whatever happened, no worker process may wait for ever: release every wait.
        shared.stop.set()
        shared.done.set()
        shared.go.set()
        with contextlib.suppress(Exception):
            _stop_all(procs)


def main() -> None:
    cfg = ChildConfig.from_argv()
    if cfg.extra.get("processes"):
        several_processes(cfg)
    else:
        one_process(cfg)


if __name__ == "__main__":
    main()

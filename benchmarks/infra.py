"""The orchestrator's side of the broker, Redis and the contender processes.

Every queue gets a unique name, is registered before it is declared, and is deleted after
its run and again at exit (also after a failure or Ctrl-C); Redis keys the same, by the
run's unique prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import aio_pika
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel, AbstractConnection

from weclaw_mq import App, Settings
from weclaw_mq.contract import headers as wh
from weclaw_mq.wire.topology import QueueSpec, declare, queue_declarations, work_queue_arguments

from .common import PROFILE_ENV, PROTOCOL_PREFIX, ChildConfig, encode, make_payload
from .machine_cpu import CpuWindow

ROOT = Path(__file__).resolve().parent.parent
FILL_CHUNK = 1000
DRAMATIQ_SUFFIXES = (".DQ", ".XQ")


# A smoke test sets this to a tag of its own: every queue its run names carries the tag, so
# the test finds what its run left behind while another run shares the broker.
RUN_TAG_ENV = "WECLAW_BENCH_RUN_TAG"


def bench_queue_name(kind: str, *parts: str) -> str:
    """``bench-<kind>-[<run tag>-]<parts>-<random>``: a fresh queue name for one benchmark."""
    tag = os.environ.get(RUN_TAG_ENV)
    return "-".join(["bench", kind, *([tag] if tag else []), *parts, uuid.uuid4().hex[:8]])


def weclaw_spec(queue: str) -> QueueSpec:
    """The queue spec of a default weclaw_mq handler on ``queue``, built through a real
    ``App`` so it matches what the worker declares exactly."""
    app = App("bench-topology", settings=Settings(_env_file=None))  # type: ignore[call-arg]

    async def noop(task: Any) -> None:
        return None

    app.handler(queue)(noop)
    return app.handlers[queue].queue_spec()


def task_message(body: bytes, task_id: str) -> aio_pika.Message:
    """A task as weclaw_mq sends it: id, JSON, persistent, timestamp, trace and attempt."""
    return aio_pika.Message(
        body,
        message_id=task_id,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=datetime.now(UTC),
        headers={wh.TRACE_ID: uuid.uuid4().hex, wh.ATTEMPT: 1},
    )


def dramatiq_body(queue: str, seq: int, task_id: str) -> bytes:
    """Dramatiq's own message format (what ``actor.send`` would publish), padded to 1 KiB."""
    fields: dict[str, Any] = {
        "queue_name": queue,
        "actor_name": "bench_noop",
        "args": [{"seq": seq, "sent_ns": 0, "pad": ""}],
        "kwargs": {},
        "options": {},
        "message_id": task_id,
        "message_timestamp": int(datetime.now(UTC).timestamp() * 1000),
    }
    fields["args"][0]["pad"] = "x" * max(0, 1024 - len(encode(fields)))
    return encode(fields)


async def delete_app_queues(amqp_url: str, app: App) -> None:
    """Delete every queue of ``app``'s handlers (a benchmark's own, uniquely named ones)."""
    conn = await aio_pika.connect(amqp_url)
    try:
        for spec in app.handlers.values():
            for name, _ in queue_declarations(spec.queue_spec()):
                channel = await conn.channel()
                await channel.queue_delete(name)
                await channel.close()
    finally:
        await conn.close()


class Infra:
    """One long-lived connection for declaring, filling and deleting; one Redis client."""

    def __init__(self, amqp_url: str, redis_url: str, run_id: str) -> None:
        self.amqp_url = amqp_url
        self.redis_url = redis_url
        self.run_id = run_id
        self.queues: set[str] = set()  # every base name ever handed out, for the final sweep
        self._conn: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self.redis: aioredis.Redis = aioredis.Redis.from_url(redis_url, socket_timeout=10)

    async def open(self) -> None:
        self._conn = await aio_pika.connect(
            self.amqp_url, client_properties={"connection_name": f"{self.run_id}-orchestrator"}
        )
        await self.redis.ping()

    async def channel(self) -> AbstractChannel:
        """A confirming channel, reopened if a broker error closed it."""
        assert self._conn is not None
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._conn.channel(publisher_confirms=True)
        return self._channel

    def server_version(self) -> str:
        assert self._conn is not None
        transport: Any = self._conn.transport
        props = getattr(getattr(transport, "connection", transport), "server_properties", {})
        version = props.get("version", "?")
        return version.decode() if isinstance(version, bytes) else str(version)

    def new_queue(self, *parts: object) -> str:
        name = "-".join([self.run_id, *(str(p) for p in parts)])
        self.queues.add(name)
        return name

    async def declare_weclaw(self, queue: str) -> dict[str, object]:
        """Declare ``queue`` as a weclaw_mq handler queue; returns its work queue arguments."""
        spec = weclaw_spec(queue)
        await declare(await self.channel(), [spec])
        return work_queue_arguments(spec)

    async def fill(self, queue: str, count: int, *, dramatiq: bool = False) -> None:
        """Pipelined confirmed publishes (chunks of ``FILL_CHUNK`` in flight), before timing."""
        exchange = (await self.channel()).default_exchange
        for first in range(0, count, FILL_CHUNK):
            messages = []
            for seq in range(first, min(first + FILL_CHUNK, count)):
                task_id = f"{queue}-{seq}"
                body = dramatiq_body(queue, seq, task_id) if dramatiq else encode(make_payload(seq))
                messages.append(task_message(body, task_id))
            await asyncio.gather(
                *(exchange.publish(m, routing_key=queue, mandatory=True) for m in messages)
            )

    async def publish_raw(self, queue: str, payload: dict[str, Any], task_id: str) -> None:
        exchange = (await self.channel()).default_exchange
        await exchange.publish(
            task_message(encode(payload), task_id), routing_key=queue, mandatory=True
        )

    async def delete(self, queue: str) -> None:
        """Every queue derived from ``queue`` by weclaw_mq or Dramatiq, and its Redis keys."""
        names = [n for n, _ in queue_declarations(weclaw_spec(queue))]
        names += [queue + s for s in DRAMATIQ_SUFFIXES]
        for name in names:
            try:
                await (await self.channel()).queue_delete(name)
            except Exception as e:  # keep deleting the others; the final sweep retries
                print(f"bench: could not delete queue {name}: {e}", file=sys.stderr)
        for attempt in range(3):
            try:
                await self.delete_keys(f"*{queue}*")
                return
            except Exception as e:  # e.g. Redis restarted under us; the final sweep retries
                print(f"bench: could not delete Redis keys of {queue}: {e}", file=sys.stderr)
                await asyncio.sleep(1 + attempt)

    async def delete_keys(self, pattern: str) -> int:
        deleted = 0
        batch: list[bytes] = []
        async for key in self.redis.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += await self.redis.unlink(*batch)
                batch.clear()
        if batch:
            deleted += await self.redis.unlink(*batch)
        return deleted

    async def close(self) -> None:
        """The final sweep: every queue this run named, every key with the run's prefix."""
        with contextlib.suppress(Exception):
            for queue in sorted(self.queues):
                await self.delete(queue)
        with contextlib.suppress(Exception):
            await self.delete_keys(f"*{self.run_id}*")
        with contextlib.suppress(Exception):
            if self._conn is not None:
                await self._conn.close()
        with contextlib.suppress(Exception):
            await self.redis.aclose()


class ContenderFailed(Exception):
    pass


@dataclass
class Child:
    """One contender process and the protocol lines it printed."""

    proc: asyncio.subprocess.Process
    stderr: IO[bytes]
    events: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait_for(self, event: str, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                while event not in self.events:
                    line = await self.proc.stdout.readline()
                    if not line:
                        await self.proc.wait()
                        raise ContenderFailed(
                            f"exited ({self.proc.returncode}) before '{event}': {self.tail()}"
                        )
                    text = line.decode(errors="replace").rstrip()
                    if text.startswith(PROTOCOL_PREFIX):
                        data = json.loads(text[len(PROTOCOL_PREFIX) :])
                        self.events[data["event"]] = data
        except TimeoutError:
            raise ContenderFailed(f"no '{event}' within {timeout_s:.0f} s: {self.tail()}") from None
        return self.events[event]

    async def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word.encode() + b"\n")
        await self.proc.stdin.drain()

    def rss_mib(self) -> float:
        """VmRSS of the process from /proc (which counts in KiB), in MiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise ContenderFailed("no VmRSS in /proc status")

    def tail(self, chars: int = 600) -> str:
        self.stderr.seek(0)
        text = self.stderr.read().decode(errors="replace").strip()
        return text[-chars:] if text else "(no stderr)"

    async def finish(self) -> None:
        """Ask it to stop; kill it (by its pid) if it does not exit in time."""
        with contextlib.suppress(Exception):
            await self.send("stop")
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.kill()
            await self.proc.wait()
        self.stderr.close()

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        # Process groups the contender started in sessions of their own (the --processes
        # supervisor and its children), as it announced them: they would outlive it.
        for group in self.events.get("spawned", {}).get("process_groups", []):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)


class Children:
    """Starts contender processes and remembers them, so none outlives the orchestrator."""

    def __init__(self, profile_dir: Path | None) -> None:
        self.live: dict[int, Child] = {}
        self.profile_dir = profile_dir
        # Set by costs.explain_misses: the next weclaw runs go under cProfile, into this folder.
        self.cprofile_dir: Path | None = None
        # Processes a contender started itself (Dramatiq's worker processes), as it reported
        # them: the contender stops them; the JSON lists them so a test can check it did.
        self.worker_pids: list[int] = []
        # Set by the orchestrator: the broker's, Redis's and the machine's CPU over each
        # go -> done window (benchmarks.machine_cpu), merged into the done event.
        self.cpu_window: CpuWindow | None = None

    async def start(self, module: str, cfg: ChildConfig, label: str) -> Child:
        args = ["-m", f"benchmarks.contenders.{module}", cfg.to_arg()]
        env = None
        if self.cprofile_dir is not None and module == "weclaw":
            # The contender profiles its measured window only (go -> done), not its start.
            self.cprofile_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, PROFILE_ENV: str(self.cprofile_dir / f"{label}.prof")}
        elif self.profile_dir is not None and module == "weclaw":
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            out = self.profile_dir / f"{label}.txt"
            args = ["-m", "pyinstrument", "-r", "text", "-o", str(out), *args]
        stderr = tempfile.TemporaryFile()  # noqa: SIM115  # closed by Child.finish
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            cwd=ROOT,
            env=env,
        )
        child = Child(proc, stderr)
        self.live[child.pid] = child
        return child

    async def run(
        self,
        module: str,
        cfg: ChildConfig,
        label: str,
        *,
        before_go: Callable[[], Awaitable[None]] | None = None,
        after_go: Callable[[Child], Awaitable[None]] | None = None,
        fill_while_starting: bool = True,
        done_timeout_s: float = 120.0,
        idle_rss_after_s: float | None = None,
    ) -> dict[str, Any]:
        """ready -> (fill) -> go -> done [-> idle RSS] -> stop. Returns the done event."""
        child = await self.start(module, cfg, label)
        try:
            if before_go is not None and fill_while_starting:
                # The queue already exists: fill it while the child imports and connects.
                await asyncio.gather(child.wait_for("ready", 90), before_go())
            else:
                await child.wait_for("ready", 90)
                if before_go is not None:
                    await before_go()
            self.worker_pids += child.events["ready"].get("worker_pids", [])
            if self.cpu_window is not None:
                self.cpu_window.start()
            await child.send("go")
            if after_go is not None:
                await after_go(child)
            done = dict(await child.wait_for("done", done_timeout_s))
            if self.cpu_window is not None:
                done.update(self.cpu_window.stop())
            done.update({k: v for k, v in child.events["ready"].items() if k != "event"})
            if idle_rss_after_s is not None:
                await asyncio.sleep(idle_rss_after_s)
                done["rss_mib"] = child.rss_mib()
            return done
        except BaseException:
            child.kill()
            raise
        finally:
            await child.finish()
            self.live.pop(child.pid, None)

    def kill_all(self) -> None:
        for child in list(self.live.values()):
            child.kill()


def machine_info() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 1024 / 1024
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_gib, 1),
        "cpu": cpu,
        "kernel": platform.release(),
        "loadavg_start": list(os.getloadavg()),
    }


def package_versions(names: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


async def forget_task_index(redis_url: str, queue: str) -> None:
    """The task index entries and timelines of ``queue``'s tasks (a run's own queue): what
    a benchmark with the index on (the default) leaves in the shared Redis."""
    from weclaw_mq.contract.naming import (
        TASK_INDEX_KEY,
        TASK_INDEX_QUEUES_KEY,
        index_entry,
        task_index_queue_key,
        task_index_status_key,
        timeline_key,
    )
    from weclaw_mq.state.task_index import SPARSE_STATUSES

    client = aioredis.Redis.from_url(redis_url)
    try:
        indexed = task_index_queue_key(queue)
        members = await client.zrange(indexed, 0, -1)
        for start in range(0, len(members), 1000):
            chunk = members[start : start + 1000]
            await client.zrem(TASK_INDEX_KEY, *chunk)
            for status in SPARSE_STATUSES:
                await client.zrem(task_index_status_key(status.value), *chunk)
            await client.delete(*(timeline_key(index_entry(m.decode())[1]) for m in chunk))
        await client.delete(indexed)
        await client.srem(TASK_INDEX_QUEUES_KEY, indexed)
    finally:
        await client.aclose()


async def forget_queue_keys(redis_url: str, queue: str) -> None:
    """Every Redis key a benchmark's run on ``queue`` (its own) leaves: its tasks' guard
    keys, records, latest pointers and index entries, and its fair-share book."""
    from weclaw_mq.contract.naming import (
        GUARD_KEY_PREFIX,
        STATE_KEY_PREFIX,
        fair_key,
        latest_key,
        queue_key_pattern,
    )

    await forget_task_index(redis_url, queue)
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys: list[bytes] = []
        for prefix in (GUARD_KEY_PREFIX, STATE_KEY_PREFIX):
            pattern = queue_key_pattern(prefix, queue)
            keys += [k async for k in client.scan_iter(match=pattern, count=1000)]
        task_ids = {k.rsplit(b":{", 1)[1].removesuffix(b"}").decode() for k in keys}
        keys += [latest_key(t).encode() for t in task_ids]
        keys += [k async for k in client.scan_iter(match=f"{fair_key(queue)}*", count=1000)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
    finally:
        await client.aclose()

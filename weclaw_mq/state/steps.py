"""Memoized steps (``ctx.step``): what each step of a task returned, kept beside its record.

A step is recorded per (queue, task id, name, occurrence): the occurrence counts the calls
with that name in one run (1, 2, ...), so a handler that calls ``ctx.step("call", ...)`` in a
loop records each call apart, and a later attempt of the task (a retry, a redelivery after a
crash) replays them in the same order without calling again.

In Redis a task's steps in queue Q are one hash (``naming.steps_key``, hash-tagged on the
task id like its other keys: one slot on a Redis Cluster), one field per step and occurrence,
its value the record's JSON. Every write of the task's record renews the hash's TTL
(``state.redis.RECORD_WRITE_LUA``), and a step's own write sets it, so the steps live as long
as the record and expire with it. An attempt reads all of them once, at its first step
(``StepMemo``: one round trip), then serves replays from memory; each fresh step is one write.

A step is at-least-once: a call that finished but whose record was not written (the worker
died in between, or Redis failed) runs again on the next attempt. ``step_key`` names the step
stably across attempts, for a provider's own idempotency key.

A fresh step's model calls (``ctx.usage`` inside it) are billed as its record is written:
``step_billing``, set by the LLM middleware for its run (``llm.calls``), writes them to the
cost ledger first, then the record goes. A kill between the two repeats the call, which the
provider bills again too; a kill before the record costs nothing twice; a replay bills none.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from weclaw_mq.contract.message import strict_json
from weclaw_mq.contract.naming import steps_key
from weclaw_mq.errors import StepError
from weclaw_mq.state.outages import answered

if TYPE_CHECKING:
    from weclaw_mq.state.pipelining import AutoPipeline

# Model calls reported inside a step (``ctx.usage``): (model, input tokens, output tokens).
Usage = tuple[str, int, int]

# Bills a fresh step's model calls, awaited before its record is written; it never raises
# (a bill that could not be written is left to the attempt's end).
StepBilling = Callable[[Sequence[Usage]], Awaitable[None]]
# Set for a run by the middleware that keeps the cost ledger (``llm.calls``), in the delivery's
# task before the handler starts: the handler's steps (and its threads) inherit it.
step_billing: ContextVar[StepBilling | None] = ContextVar("weclaw_mq_step_billing", default=None)


@dataclass(frozen=True)
class StepRecord:
    """One recorded step, as ``App.steps`` answers it.

    Attributes:
        name: The step's name (``ctx.step(name, ...)``).
        occurrence: Which call with that name in the run it is (1 = the first).
        result: What the step returned, as JSON data.
        duration_s: How long the call took.
        at: When it was recorded (ISO 8601, the worker's clock).
        attempt: The attempt that ran it.
        usage: The model calls reported inside it (``ctx.usage``): (model, input tokens,
            output tokens) each. A replay reports none again.
        seq: Its place among the steps its run called (0 = the first): the order of steps
            recorded in the same instant.
    """

    name: str
    occurrence: int
    result: Any
    duration_s: float
    at: str
    attempt: int
    usage: tuple[Usage, ...] = ()
    seq: int = 0

    @property
    def field(self) -> str:
        return step_field(self.name, self.occurrence)

    @property
    def input_tokens(self) -> int:
        return sum(u[1] for u in self.usage)

    @property
    def output_tokens(self) -> int:
        return sum(u[2] for u in self.usage)

    @property
    def models(self) -> list[str]:
        """The models called inside the step, each once, in order."""
        return list(dict.fromkeys(u[0] for u in self.usage))

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON data (``weclaw-mq status``, the console)."""
        return {
            "name": self.name,
            "occurrence": self.occurrence,
            "attempt": self.attempt,
            "at": self.at,
            "duration_s": round(self.duration_s, 6),
            "usage": [
                {"model": m, "input_tokens": i, "output_tokens": o} for m, i, o in self.usage
            ],
            "result": self.result,
        }


def step_field(name: str, occurrence: int) -> str:
    """The hash field of a step: the occurrence first, so ``1:a:b`` can only be ("a:b", 1)."""
    return f"{occurrence}:{name}"


def step_key(task_id: str, queue: str, name: str, occurrence: int) -> str:
    """A step's stable idempotency key: the same on every attempt of the task."""
    return f"{task_id}:{queue}:{name}:{occurrence}"


def encode(record: StepRecord, result_json: bytes) -> bytes:
    """The stored JSON of ``record`` (its result already encoded, and measured)."""
    head = json.dumps(
        {
            "name": record.name,
            "n": record.occurrence,
            "seq": record.seq,
            "duration_s": round(record.duration_s, 6),
            "at": record.at,
            "attempt": record.attempt,
            "usage": [list(u) for u in record.usage],
        },
        separators=(",", ":"),
    ).encode()
    return head[:-1] + b',"result":' + result_json + b"}"


def decode(raw: bytes | str) -> StepRecord:
    data = json.loads(raw)
    return StepRecord(
        name=data["name"],
        occurrence=int(data["n"]),
        result=data.get("result"),
        duration_s=float(data["duration_s"]),
        at=data["at"],
        attempt=int(data["attempt"]),
        usage=tuple((str(m), int(i), int(o)) for m, i, o in data.get("usage", ())),
        seq=int(data.get("seq", 0)),
    )


def made(
    name: str,
    occurrence: int,
    value: Any,
    *,
    duration_s: float,
    attempt: int,
    usage: Sequence[Usage],
    max_bytes: int,
    seq: int = 0,
) -> tuple[StepRecord, bytes]:
    """The record of a step that returned ``value``, and its stored form.

    Raises:
        StepError: ``value`` is not JSON, or its JSON is over ``max_bytes``.
    """
    try:
        result_json = strict_json(value)
    except ValueError as e:
        raise StepError(
            f"step {name!r} returned something that is not JSON ({e}): return JSON data "
            "(a dict, list, str, number, bool or None, or a pydantic model)"
        ) from e
    if len(result_json) > max_bytes:
        raise StepError(
            f"step {name!r} returned {len(result_json)} bytes of JSON, over the limit of "
            f"{max_bytes} (WECLAW_MQ_STEP_MAX_BYTES): return less (an id, a summary) or "
            "raise the limit"
        )
    record = StepRecord(
        name=name,
        occurrence=occurrence,
        result=json.loads(result_json),
        duration_s=duration_s,
        at=datetime.now(UTC).isoformat(timespec="microseconds"),
        attempt=attempt,
        usage=tuple(usage),
        seq=seq,
    )
    return record, encode(record, result_json)


class StepBook(Protocol):
    """Where a store keeps the tasks' steps."""

    async def load(self, queue: str, task_id: str) -> dict[str, bytes]:
        """Every recorded step of the task in ``queue``: its stored JSON by its field
        (``step_field``); {} when none."""
        ...

    async def save(self, queue: str, task_id: str, field: str, body: bytes) -> None:
        """Record one step (its field and stored JSON), kept as long as the task's record."""
        ...


@runtime_checkable
class HasSteps(Protocol):
    """A ``TaskStore`` that keeps memoized steps beside its tasks (the Redis and memory stores)."""

    def step_book(self) -> StepBook:
        """The steps (``state.steps``) beside this task store's tasks.

        Returns:
            The step book.
        """
        ...


def steps_of(raw: Mapping[str, bytes]) -> list[StepRecord]:
    """The stored steps as records, in the order they ran (by when each was recorded)."""
    records = [decode(body) for body in raw.values()]
    return sorted(records, key=lambda r: (r.at, r.seq))


# The whole hash in one call that shares the store's auto-pipeline (a script: the pipeline
# takes scripts and a few reads).
_LOAD = "return redis.call('HGETALL', KEYS[1])"
# One step, and the TTL of the task's records (renewed by each record write after it).
_SAVE = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


class RedisStepBook:
    """``StepBook`` on Redis: one hash per (queue, task id), in the task's slot.

    Args:
        pipe: The store's auto-pipeline (a step's read and write share round trips with the
            other tasks' commands).
        ttl_ms: How long records are kept (``result_ttl_s``).
    """

    def __init__(self, pipe: AutoPipeline, *, ttl_ms: int) -> None:
        # Here, not at the top: the memory store imports this module without redis-py.
        from weclaw_mq.state.pipelining import Script

        self._pipe = pipe
        self._ttl_ms = max(1, ttl_ms)
        self._load = Script.of(_LOAD)
        self._save = Script.of(_SAVE)

    async def load(self, queue: str, task_id: str) -> dict[str, bytes]:
        flat: list[Any] = await answered(
            self._pipe.script(self._load, [steps_key(queue, task_id)], [])
        )
        return {_text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}

    async def save(self, queue: str, task_id: str, field: str, body: bytes) -> None:
        await answered(
            self._pipe.script(self._save, [steps_key(queue, task_id)], [field, body, self._ttl_ms])
        )


class MemoryStepBook:
    """``StepBook`` in one process (the memory store's): kept ``ttl_s`` after the last write.

    Args:
        ttl_s: How long a task's steps are kept after its last step.
        clock: Seconds, monotonic (the memory store's).
    """

    def __init__(self, *, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._steps: dict[tuple[str, str], tuple[float, dict[str, bytes]]] = {}

    async def load(self, queue: str, task_id: str) -> dict[str, bytes]:
        return self._live(queue, task_id)

    async def save(self, queue: str, task_id: str, field: str, body: bytes) -> None:
        steps = self._live(queue, task_id)
        steps[field] = body
        self._steps[(queue, task_id)] = (self._clock() + self._ttl_s, steps)

    def _live(self, queue: str, task_id: str) -> dict[str, bytes]:
        kept = self._steps.get((queue, task_id))
        if kept is None or kept[0] <= self._clock():
            return {}
        return dict(kept[1])


class StepMemo:
    """One attempt's view of its task's steps: read once (lazily, at its first step), then
    served from memory; and how many times each name was called in this run.

    Args:
        book: The store's step book.
        queue: The handler queue.
        task_id: The task's id.
    """

    def __init__(self, book: StepBook, queue: str, task_id: str) -> None:
        self.book = book
        self.queue = queue
        self.task_id = task_id
        self._recorded: dict[str, bytes] | None = None
        self._loading: asyncio.Task[dict[str, bytes]] | None = None
        self._counts: dict[str, int] = {}
        self._called = 0
        # A plain-def handler counts from its thread; its own threads may too.
        self._lock = threading.Lock()

    def next_occurrence(self, name: str) -> tuple[int, int]:
        """The step's occurrence (its calls with ``name`` so far in this run, this one
        included) and its place among all the steps this run called (0 = the first)."""
        with self._lock:
            count = self._counts[name] = self._counts.get(name, 0) + 1
            self._called += 1
            return count, self._called - 1

    async def recorded(self, name: str, occurrence: int) -> StepRecord | None:
        """The step's record from an earlier attempt, or None (it runs)."""
        recorded = self._recorded
        if recorded is None:
            recorded = await self._loaded()
        body = recorded.get(step_field(name, occurrence))
        return decode(body) if body is not None else None

    async def _loaded(self) -> dict[str, bytes]:
        # Concurrent first steps (asyncio.gather) share the one read.
        if self._loading is None:
            self._loading = asyncio.ensure_future(self.book.load(self.queue, self.task_id))
        try:
            recorded = await asyncio.shield(self._loading)
        except BaseException:
            if self._loading.done():
                self._loading = None  # a failed read is tried again at the next step
            raise
        self._recorded = recorded
        return recorded

    async def save(self, record: StepRecord, body: bytes) -> None:
        await self.book.save(self.queue, self.task_id, record.field, body)
        if self._recorded is not None:
            self._recorded[record.field] = body


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

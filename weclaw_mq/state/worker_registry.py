"""The worker registry ``weclaw-mq inspect`` reads: each live worker's record in Redis (its
host, pid, queues, concurrency and the tasks it runs now).

Each worker with a Redis task store writes its record every ``worker_beat_s``, from one
background task (``worker.beat``), never from a delivery's path; the record expires
``BEATS_KEPT`` beats after it was written, so a worker killed without stopping disappears by
itself, and a worker that stops deletes it. Keys (``contract.naming``): an index, a sorted set
of worker ids scored by the Redis time (ms) each record lapses at, and one key per record;
both carry the hash tag ``{workers}``, so on a Redis Cluster one script writes a record with
its index entry and one MGET reads them all (no SCAN across nodes, no command across slots).
Every beat trims the index entries whose records lapsed. Times are Redis's own (``TIME`` in
the scripts), so the hosts' clocks need not agree; the durations in a record (uptime, how
long each task runs) are the worker's own, as of its beat, and a read adds the record's age.

redis-py is not imported here: a worker without Redis never loads it (``registry_of``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from weclaw_mq.contract.naming import WORKER_INDEX_KEY, worker_key
from weclaw_mq.state.outages import is_state_failure, state_unavailable
from weclaw_mq.state.protocol import TaskState, TaskStatus

if TYPE_CHECKING:
    from weclaw_mq.state.pipelining import AutoPipeline
    from weclaw_mq.state.redis_clients import StateClient

# A record lives this many beats: one or two lost beats (a Redis failover, a stalled loop)
# do not make a live worker vanish, and a dead one is gone within three.
BEATS_KEPT = 3
# The most running tasks one record lists (at most the worker's concurrency); the rest are
# counted in ``more``.
LISTED_TASKS_MAX = 100
# The record's layout; a reader skips records of another.
RECORD_VERSION = 1

# Redis's clock in ms, the same on every beat whatever the workers' hosts say.
_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS: the index, the record; ARGV: worker id, record (JSON), TTL (ms).
_BEAT = (
    _NOW_MS
    + """
local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
redis.call('ZADD', KEYS[1], string.format('%d', now + ttl), ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ttl)
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return now
"""
)
# KEYS: the index, the record; ARGV: worker id.
_LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('DEL', KEYS[2])
"""
# KEYS: the index. Redis's time (ms) and the live entries: id, lapse time, id, ...
_LIVE = (
    _NOW_MS
    + """
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%d', now), '+inf',
  'WITHSCORES')
return {string.format('%d', now), live}
"""
)


@dataclass(frozen=True)
class RunningTask:
    """One delivery a worker is processing."""

    task_id: str
    queue: str
    attempt: int
    # Since its handler started; None while it has not (it waits for its claim or a limit).
    running_s: float | None


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker says of itself in the registry; the durations are as of ``last_beat_s``
    ago once read (``WorkerRegistry.read`` ages them to the time of the read)."""

    worker_id: str
    app: str
    host: str
    pid: int
    started_at: str  # ISO 8601, the worker host's clock
    uptime_s: float
    queues: tuple[str, ...]
    concurrency: int
    state: str  # "consuming", "connecting" (no broker session now) or "stopping"
    in_flight: int  # every delivery it processes now
    tasks: tuple[RunningTask, ...]  # the longest-running first, at most LISTED_TASKS_MAX
    more: int  # in flight beyond those listed
    beat_s: float
    ttl_s: float
    last_beat_s: float = 0.0  # how long before the read the record was written
    # Its breakers that are not closed: queue -> "open" or "half_open" (a breaker's state
    # lives in each worker's memory; the console shows it from here).
    breakers: dict[str, str] = dataclasses.field(default_factory=dict)
    # Its plain-def handlers' threads (0 without such handlers) and how many are held by
    # calls past their timeout: all of them, and no plain-def task can start.
    sync_threads: int = 0
    sync_threads_stuck: int = 0

    def to_json(self) -> str:
        document = dataclasses.asdict(self)
        del document["last_beat_s"]  # the reader's to say
        return json.dumps({"v": RECORD_VERSION, **document}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord | None:
        """The record ``to_json`` wrote; None for one of another layout (or not one at all)."""
        try:
            document = json.loads(text)
            if document.pop("v") != RECORD_VERSION:
                return None
            tasks = tuple(RunningTask(**task) for task in document.pop("tasks"))
            queues = tuple(document.pop("queues"))
            # A newer worker's field this reader does not know is left out, not a reason to
            # drop its record (an older worker's record lacks the newer ones: defaults).
            known = {f.name for f in dataclasses.fields(cls)}
            fields = {k: v for k, v in document.items() if k in known}
            return cls(**fields, tasks=tasks, queues=queues)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def aged(self, age_s: float) -> WorkerRecord:
        """This record as of ``age_s`` after it was written."""
        tasks = tuple(
            t if t.running_s is None else dataclasses.replace(t, running_s=t.running_s + age_s)
            for t in self.tasks
        )
        return dataclasses.replace(
            self, uptime_s=self.uptime_s + age_s, tasks=tasks, last_beat_s=age_s
        )


class WorkerRegistry:
    """The registry on one Redis (or Cluster).

    Args:
        client: The redis-py client.
        pipe: The task store's auto-pipeline, for a worker's beats: they share its round
            trips and connection (no connection of their own). Without it, commands go on
            ``client`` directly (``weclaw-mq inspect``, tests).
    """

    def __init__(self, client: StateClient, pipe: AutoPipeline | None = None) -> None:
        self._client = client
        self._pipe = pipe
        self._live = client.register_script(_LIVE)
        if pipe is not None:
            from weclaw_mq.state.pipelining import Script  # redis-py is loaded: there is a pipe

            self._beat_script, self._leave_script = Script.of(_BEAT), Script.of(_LEAVE)
        self._beat = client.register_script(_BEAT)
        self._leave = client.register_script(_LEAVE)

    async def beat(self, record: WorkerRecord, ttl_s: float) -> None:
        """Write ``record``, to lapse ``ttl_s`` from now, and trim lapsed index entries."""
        keys = [WORKER_INDEX_KEY, worker_key(record.worker_id)]
        args: list[Any] = [record.worker_id, record.to_json(), max(1, int(ttl_s * 1000))]
        if self._pipe is not None:
            await self._pipe.script(self._beat_script, keys, args)
        else:
            await self._beat(keys=keys, args=args)

    async def leave(self, worker_id: str) -> None:
        """Delete the record of ``worker_id`` (it stopped) and its index entry."""
        keys, args = [WORKER_INDEX_KEY, worker_key(worker_id)], [worker_id]
        if self._pipe is not None:
            await self._pipe.script(self._leave_script, keys, args)
        else:
            await self._leave(keys=keys, args=args)

    async def read(self) -> list[WorkerRecord]:
        """Every live worker's record, aged to now (by Redis's clock), by host and pid.

        Raises:
            StateUnavailableError: Redis does not answer (``StateCommandError``: it refuses).
        """
        try:
            now_raw, live = await self._live(keys=[WORKER_INDEX_KEY], args=[])
            lapses = {_text(w): float(s) for w, s in zip(live[::2], live[1::2], strict=True)}
            texts = await self._client.mget([worker_key(w) for w in lapses]) if lapses else []
        except Exception as e:
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise
        now_ms = float(now_raw)
        records = []
        for (worker_id, lapse_ms), text in zip(lapses.items(), texts, strict=True):
            record = WorkerRecord.from_json(text) if text is not None else None
            if record is None or record.worker_id != worker_id:
                continue  # lapsed between the two reads, or not a record we can read
            written_ms = lapse_ms - record.ttl_s * 1000
            records.append(record.aged(max(0.0, (now_ms - written_ms) / 1000)))
        return sorted(records, key=lambda r: (r.host, r.pid, r.worker_id))


def runs(workers: Sequence[WorkerRecord], task_id: str, queue: str) -> bool | None:
    """Is the task in flight at one of the live ``workers``? True when one lists it, False
    when none does, None when it cannot tell (a live worker of ``queue`` lists only part of
    its tasks)."""
    unlisted = False
    for worker in workers:
        if any(t.task_id == task_id and t.queue == queue for t in worker.tasks):
            return True
        unlisted = unlisted or (worker.more > 0 and queue in worker.queues)
    return None if unlisted else False


def last_beat(
    workers: Sequence[WorkerRecord], task_id: str, queue: str, now: datetime
) -> datetime | None:
    """When the live worker that lists the task in flight last beat, None when none does."""
    for worker in workers:
        if any(t.task_id == task_id and t.queue == queue for t in worker.tasks):
            return now - timedelta(seconds=worker.last_beat_s)
    return None


def worker_gone(
    workers: Sequence[WorkerRecord], state: TaskState, beat_s: float, now: datetime
) -> bool:
    """Is ``state``, a ``running`` record, run by no live worker? Judged only once the record
    is older than a worker's registry record lives (``beat_s``, or the longest beat of the
    live ``workers``), so a worker that started the task since its last beat is not taken
    for gone."""
    if state.status is not TaskStatus.RUNNING:
        return False
    longest_beat_s = max([beat_s, *(w.beat_s for w in workers)])
    if (now - state.updated_at).total_seconds() <= longest_beat_s * (BEATS_KEPT + 1):
        return False
    return runs(workers, state.task_id, state.queue) is False


def registry_of(store: object) -> WorkerRegistry | None:
    """The registry in ``store``'s Redis, sharing its auto-pipeline; None for a store that is
    not the Redis one (no Redis, no registry). Asked without importing redis-py: a
    ``RedisTaskStore`` exists only once its module was loaded."""
    module = sys.modules.get("weclaw_mq.state.redis")
    if module is None or not isinstance(store, module.RedisTaskStore):
        return None
    registry: WorkerRegistry = store.worker_registry()
    return registry


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

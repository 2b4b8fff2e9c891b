"""``ctx.emit``: one handler run's partial output, written to its stream in the background.

``emit`` checks the chunk and queues it; one writer task per run sends everything queued in
one round trip, then whatever came meanwhile, and so on: the handler does not wait for Redis
(the benchmark bounds its cost), and a reader sees a chunk one round trip after its emit.
What is queued or being written is bounded (``MAX_IN_FLIGHT_BYTES`` of entries per run):
past it, ``emit`` waits until the writer's round trip frees room, so a handler that emits
faster than Redis takes it is slowed to Redis's pace instead of filling the worker's memory.
The first chunk of a run is preceded by an "attempt" marker, so a reader drops the partial
text of an earlier run that failed or whose worker died; unless the run read that text first
(``ctx.emitted()``, ``emitted_chunks``) to continue it: then its chunks follow the earlier
ones with no marker, and a reader's text goes on with no gap and no duplicate.

A write that fails is not retried (a retry after a timeout could write a chunk twice): the
next ``emit`` raises, and so does the run's end (``drain``), which fails the attempt; the
retried attempt streams afresh under its own marker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from weclaw_mq.errors import StreamLimitError, StreamWriteError
from weclaw_mq.streaming.events import (
    ATTEMPT,
    CHUNK,
    FINAL,
    FIRST_ID,
    Entry,
    attempt_entry,
    chunk_entry,
    encode_data,
)
from weclaw_mq.streaming.protocol import READ_BATCH, StreamStore

# Entry bytes (queued or being written) per run past which emit waits: a few round trips'
# worth, so a handler streaming at full speed keeps the writer busy without waiting on it.
MAX_IN_FLIGHT_BYTES = 1024 * 1024


class Emitter:
    def __init__(
        self,
        streams: Callable[[], StreamStore],
        *,
        task_id: str,
        attempt: int,
        session_id: str | None,
        max_chunk_bytes: int,
        max_chunks: int,
        max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES,
    ) -> None:
        # A factory: a handler that never emits never opens the stream store.
        self._streams = streams
        self._task_id = task_id
        self._attempt = attempt
        self._session_id = session_id
        self._max_chunk_bytes = max_chunk_bytes
        self._max_chunks = max_chunks
        self._max_in_flight = max_in_flight_bytes
        self._count = 0
        self._queued: list[Entry] = []
        self._in_flight = 0  # bytes of the entries queued or being written
        self._written = asyncio.Event()  # set (and replaced) after each round trip
        self._writer: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self._closed = False
        # The run continues the text an earlier run left (``continue_text``): no marker.
        self._continues = False

    async def emit(self, chunk: Any) -> None:
        self._raise_if_unwritable()
        data = encode_data(chunk)
        if len(data) > self._max_chunk_bytes:
            raise StreamLimitError(
                f"a chunk of {len(data)} bytes (as JSON) is over the limit of "
                f"{self._max_chunk_bytes} (WECLAW_MQ_STREAM_MAX_CHUNK_BYTES)"
            )
        entry = chunk_entry(self._task_id, self._attempt, data)
        # A chunk larger than the bound goes alone, once nothing else is in flight.
        while self._in_flight and self._in_flight + len(entry.body) > self._max_in_flight:
            await self._written.wait()
            self._raise_if_unwritable()
        if self._count >= self._max_chunks:
            raise StreamLimitError(
                f"a run may emit at most {self._max_chunks} chunks (WECLAW_MQ_STREAM_MAX_CHUNKS)"
            )
        if self._count == 0 and not self._continues:
            self._queue(attempt_entry(self._task_id, self._attempt))
        self._count += 1
        self._queue(entry)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write())

    def continue_text(self) -> None:
        """This run goes on with the text an earlier run left (it read it first): its first
        chunk is written without an "attempt" marker, so readers keep that text. Nothing
        changes once the run has emitted (its own marker is written already)."""
        if self._count == 0:
            self._continues = True

    def _queue(self, entry: Entry) -> None:
        self._queued.append(entry)
        self._in_flight += len(entry.body)

    async def _write(self) -> None:
        try:
            streams = self._streams()
            while self._queued:
                batch, self._queued = self._queued, []
                await streams.write(self._task_id, batch, session_id=self._session_id)
                self._in_flight -= sum(len(entry.body) for entry in batch)
                self._wake()
        except Exception as e:  # kept for the handler's next emit and for drain
            self._failed = e
        finally:
            self._writer = None
            self._wake()  # an emit waiting for room sees the failure, or writes anew

    def _wake(self) -> None:
        self._written.set()
        self._written = asyncio.Event()

    def _raise_if_unwritable(self) -> None:
        if self._closed:
            raise StreamWriteError("ctx.emit after the handler's run ended: nothing is written")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise StreamWriteError(
                f"the task's stream could not be written ({type(self._failed).__name__}: "
                f"{self._failed})"
            ) from self._failed

    async def drain(self) -> None:
        """Wait until every emitted chunk is written (before the result is stored: the
        stream's final event must come after its last chunk); raise if a write failed."""
        self._closed = True
        writer = self._writer
        if writer is not None:
            await asyncio.shield(writer)
        self._raise_if_failed()

    async def wind_down(self, timeout_s: float) -> None:
        """The run failed: write what it emitted if that takes at most ``timeout_s`` (a
        failed write is only logged by its absence: the attempt failed anyway)."""
        self._closed = True
        writer = self._writer
        if writer is not None:
            await asyncio.wait({writer}, timeout=timeout_s)

    def close(self) -> None:
        """The run ended without ``drain`` (it failed): stop writing what is still queued."""
        self._closed = True
        self._queued = []
        self._in_flight = 0
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.cancel()

    @property
    def emitted(self) -> int:
        return self._count

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of entries emitted but not yet written (at most ``max_in_flight_bytes``,
        or one chunk larger than that alone)."""
        return self._in_flight


async def emitted_chunks(streams: StreamStore, task_id: str) -> list[Any]:
    """The chunks a reader of the task's stream holds as its text now: those after the last
    "attempt" marker, [] when there is none or a "final" came after it (the task ended, and
    a run after that, by a requeue from the DLQ, starts afresh). Read without waiting, in
    batches of ``READ_BATCH``."""
    chunks: list[Any] = []
    after = FIRST_ID
    while True:
        events = await streams.read(task_id, after, 0, count=READ_BATCH)
        for event in events:
            if event.kind == CHUNK:
                chunks.append(event.data)
            elif event.kind in (ATTEMPT, FINAL):
                chunks = []
        if len(events) < READ_BATCH:
            return chunks
        after = events[-1].id

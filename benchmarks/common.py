"""What the orchestrator and every contender process share: the wire protocol, the payload,
the clock and the counters. Standard library only, so importing it adds nothing to a
contender's RSS."""

from __future__ import annotations

import asyncio
import cProfile
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

BODY_BYTES = 1024
PROTOCOL_PREFIX = "BENCH "
# Set by the orchestrator to a file path: the contender runs its measured window (go -> done)
# under cProfile and writes the stats there (costs.py reads them for a missed target).
PROFILE_ENV = "WECLAW_BENCH_PROFILE"
# Every timestamp is CLOCK_MONOTONIC: one clock for the whole machine, so a publisher's
# stamp and a consumer's stamp in another process can be subtracted.
CLOCK = time.CLOCK_MONOTONIC


def now_ns() -> int:
    return time.clock_gettime_ns(CLOCK)


def make_payload(seq: int, sent_ns: int = 0) -> dict[str, Any]:
    """A JSON object that encodes (compact) to exactly ``BODY_BYTES`` bytes."""
    payload: dict[str, Any] = {"seq": seq, "sent_ns": sent_ns, "pad": ""}
    payload["pad"] = "x" * (BODY_BYTES - len(encode(payload)))
    return payload


def encode(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


@dataclass
class ChildConfig:
    """What one contender process is asked to do (passed as JSON in argv[1])."""

    mode: str  # consume | e2e | publish | publish_many
    queue: str
    amqp_url: str
    redis_url: str
    count: int = 0
    concurrency: int = 1
    sleep_s: float = 0.0  # handler body: asyncio.sleep(sleep_s), or nothing when 0
    guard: bool = False  # weclaw: guard + results on; raw: the same Redis calls by hand
    batch: int = 100  # publish_many: messages per call
    extra: dict[str, Any] = field(default_factory=dict)

    def to_arg(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_argv(cls) -> ChildConfig:
        return cls(**json.loads(sys.argv[1]))


def emit(event: str, **data: Any) -> None:
    print(PROTOCOL_PREFIX + json.dumps({"event": event, **data}), flush=True)


async def stdin_lines() -> asyncio.StreamReader:
    """stdin as an asyncio stream: waiting for the parent costs no thread."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def expect(reader: asyncio.StreamReader, word: str) -> None:
    line = (await reader.readline()).decode().strip()
    if line != word:
        raise SystemExit(f"expected {word!r} from the orchestrator, got {line!r}")


class Tracker:
    """First delivery and last ack of a consume run; ``on_done`` fires at the target count.

    Used the same way by every contender (from a delivery hook and an ack hook), so the
    measured window means the same thing for each.
    """

    def __init__(self, target: int, on_done: Callable[[], None]) -> None:
        self.target = target
        self.first_ns = 0
        self.last_ns = 0
        self.first_cpu_s = 0.0
        self.last_cpu_s = 0.0
        self.acked = 0
        self._on_done = on_done

    def delivered(self) -> None:
        if not self.first_ns:
            self.first_ns = now_ns()
            self.first_cpu_s = time.process_time()

    def acked_one(self) -> None:
        self.acked += 1
        if self.acked == self.target:
            self.last_ns = now_ns()
            self.last_cpu_s = time.process_time()
            self._on_done()

    def result(self) -> dict[str, Any]:
        if not self.first_ns:
            # Acks without a counted delivery: the delivery hook missed how this contender
            # builds its messages (aio_hooks.track), and the window would be meaningless.
            raise RuntimeError(
                f"{self.acked} acks but no delivery was counted: the delivery hook "
                "(benchmarks/contenders/aio_hooks.py) does not see this contender's messages"
            )
        elapsed_s = (self.last_ns - self.first_ns) / 1e9
        cpu_s = self.last_cpu_s - self.first_cpu_s
        return {
            "count": self.acked,
            "elapsed_s": elapsed_s,
            "rate": self.acked / elapsed_s if elapsed_s > 0 else 0.0,
            # CPU of this process (all its threads) per message: far less sensitive to a
            # busy machine than msg/s, so it shows a contender's own cost on any machine.
            "cpu_us": cpu_s / self.acked * 1e6 if self.acked else 0.0,
        }


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(latencies_ms, 50),
        "p95_ms": percentile(latencies_ms, 95),
        "p99_ms": percentile(latencies_ms, 99),
        "n": float(len(latencies_ms)),
    }


class WindowProfile:
    """cProfile over the measured window only, when ``PROFILE_ENV`` asks for it."""

    def __init__(self) -> None:
        self._path = os.environ.get(PROFILE_ENV)
        self._profile: cProfile.Profile | None = None

    def start(self) -> None:
        if self._path:
            self._profile = cProfile.Profile()
            self._profile.enable()

    def stop(self) -> None:
        if self._profile is not None and self._path:
            self._profile.disable()
            self._profile.dump_stats(self._path)
            self._profile = None

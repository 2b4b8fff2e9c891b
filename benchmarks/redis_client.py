"""The store's Redis client path in isolation: alone vs auto-pipelined, pure-Python parser vs
hiredis. ``python -m benchmarks.redis_client`` (``make bench-redis-client``, ~20 s).

Against the Redis at ``WECLAW_MQ_REDIS_URL`` (127.0.0.1:6379 by default), with keys of its
own (deleted at the end): the client's CPU per command (process time, so a busy machine
changes it far less than wall time) for
- the claim script (EVALSHA, as a delivery's claim: the guard key and a "running" record),
- a 20 KiB record read (HGET: where a reply parser has the most to do),
each sent alone (one command per round trip, redis-py's plain call) and through
``state.pipelining.AutoPipeline`` with 32 issued per loop iteration. Each variant runs
``--repeats`` times, interleaved; the table shows the median.

The parser: redis-py's own (pure Python), and hiredis when it is installed in this
interpreter (``pip install hiredis``); redis-py picks hiredis by default once it is there, so
both are measured in one process by passing ``parser_class``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from weclaw_mq.state.pipelining import AutoPipeline, Script
from weclaw_mq.state.redis import CLAIM_SCRIPT

RECORD_BYTES = 20 * 1024
BATCH = 32


async def per_command_us(send: Callable[[int], Awaitable[Any]], commands: int, batch: int) -> float:
    started = time.process_time()
    for first in range(0, commands, batch):
        await send(first)
    return (time.process_time() - started) / commands * 1e6


async def measure(url: str, parser: Any, commands: int, prefix: str) -> dict[str, float]:
    client = aioredis.Redis.from_url(url, parser_class=parser)
    claim = Script.of(CLAIM_SCRIPT)
    await client.script_load(claim.text)
    record = f"{prefix}:record"
    await client.hset(record, "state", "x" * RECORD_BYTES)
    pipe = AutoPipeline(client, max_batch=BATCH)

    def claim_args(i: int) -> tuple[list[str], list[Any]]:
        keys = [f"{prefix}:guard:{i % 500}", f"{prefix}:state:{i % 500}", f"{prefix}:latest"]
        return keys, ["running:owner", 60000, "done", "running", '{"status":"running"}', 60000]

    async def claim_alone(i: int) -> None:
        keys, args = claim_args(i)
        await client.evalsha(claim.sha, len(keys), *keys, *args)

    async def claim_pipelined(first: int) -> None:
        await asyncio.gather(*(pipe.script(claim, *claim_args(first + j)) for j in range(BATCH)))

    async def read_alone(_: int) -> None:
        await client.hget(record, "state")

    async def read_pipelined(_: int) -> None:
        await asyncio.gather(*(pipe.hget(record, "state") for _ in range(BATCH)))

    try:
        return {
            "claim, alone": await per_command_us(claim_alone, commands, 1),
            f"claim, auto-pipelined ({BATCH})": await per_command_us(
                claim_pipelined, commands, BATCH
            ),
            "20 KiB read, alone": await per_command_us(read_alone, commands // 2, 1),
            f"20 KiB read, auto-pipelined ({BATCH})": await per_command_us(
                read_pipelined, commands // 2, BATCH
            ),
        }
    finally:
        keys = [k async for k in client.scan_iter(f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def amain(args: argparse.Namespace) -> None:
    parsers: dict[str, Any] = {"redis-py parser": _AsyncRESP2Parser}
    if HIREDIS_AVAILABLE:
        parsers["hiredis"] = _AsyncHiredisParser
    samples: dict[tuple[str, str], list[float]] = {}
    prefix = f"weclaw-bench-redis-client:{uuid.uuid4().hex}"
    for repeat in range(args.repeats):
        order = list(parsers.items())
        if repeat % 2:
            order.reverse()
        for name, parser in order:
            for case, us in (await measure(args.redis_url, parser, args.commands, prefix)).items():
                samples.setdefault((case, name), []).append(us)
    cases = list(dict.fromkeys(case for case, _ in samples))
    header = "| case | " + " | ".join(f"{p} (us CPU/command)" for p in parsers)
    if HIREDIS_AVAILABLE:
        header += " | hiredis / redis-py"
    print(header + " |")
    print("|---" * (len(parsers) + 1 + HIREDIS_AVAILABLE) + "|")
    for case in cases:
        medians = [statistics.median(samples[(case, p)]) for p in parsers]
        cells = [f"{m:.1f}" for m in medians]
        if HIREDIS_AVAILABLE:
            cells.append(f"{medians[1] / medians[0]:.2f}x")
        print(f"| {case} | " + " | ".join(cells) + " |")
    if not HIREDIS_AVAILABLE:
        print("\nhiredis is not installed here: `pip install hiredis` in this venv to compare.")
    print(f"\n{args.repeats} repeats, interleaved; medians. {args.commands} commands per run.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commands", type=int, default=3200)
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()

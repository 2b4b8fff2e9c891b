"""The store's Redis client path in isolation: redis-py's path vs the lean path, alone vs
auto-pipelined, pure-Python parser vs hiredis. ``python -m benchmarks.redis_client``
(``make bench-redis-client``, ~40 s).

Against the Redis at ``WECLAW_MQ_REDIS_URL`` (127.0.0.1:6379 by default), with keys of its
own (deleted at the end): the client's CPU per command (process time, so a busy machine
changes it far less than wall time) for
- the claim script (EVALSHA, as a delivery's claim: the guard key, the cancel marker and a
  "running" record),
- a 20 KiB record read (HGET: where a reply parser has the most to do),
each through ``state.pipelining.AutoPipeline`` sent alone (one command per round trip, as a
publish's "queued" record or an idle worker's claim) and with 32 issued per loop iteration.

Two ways a batch goes out (``state.pipelining``): redis-py's own (a pipeline, or the plain
command when alone) and the lean path (packed by weclaw_mq, written on a connection of the
client's pool, replies read with the connection's ``read_response``). The client is made as
the store makes its own (a pool passed in, no retry). Two parsers: redis-py's own (pure
Python), and hiredis when it is installed in this interpreter (``pip install hiredis``;
redis-py picks it by default once it is there, so both are measured here by passing
``parser_class``). Each variant runs ``--repeats`` times, interleaved in a rotating order;
the table shows the median.
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
from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser
from redis.asyncio.connection import parse_url
from redis.utils import HIREDIS_AVAILABLE

from weclaw_mq.state.pipelining import AutoPipeline, Script
from weclaw_mq.state.redis import CLAIM_SCRIPT

RECORD_BYTES = 20 * 1024
BATCH = 32
PATHS = {"redis-py path": False, "lean path": True}


async def per_command_us(send: Callable[[int], Awaitable[Any]], commands: int, batch: int) -> float:
    started = time.process_time()
    for first in range(0, commands, batch):
        await send(first)
    return (time.process_time() - started) / commands * 1e6


def store_like_client(url: str, parser: Any) -> aioredis.Redis:
    """As ``state.redis_clients.open_client`` makes it (a pool passed in: no retry)."""
    pool = aioredis.ConnectionPool(
        parser_class=parser,
        socket_timeout=5,
        socket_connect_timeout=5,
        health_check_interval=30,
        **parse_url(url),
    )
    return aioredis.Redis(connection_pool=pool)


async def measure(
    url: str, parser: Any, lean: bool, commands: int, prefix: str
) -> dict[str, float]:
    client = store_like_client(url, parser)
    claim = Script.of(CLAIM_SCRIPT)
    await client.script_load(claim.text)
    record = f"{prefix}:record"
    await client.hset(record, "state", "x" * RECORD_BYTES)
    pipe = AutoPipeline(client, max_batch=BATCH, lean=lean)
    assert (pipe._lean is not None) is lean

    def claim_args(i: int) -> tuple[list[str], list[Any]]:
        task = f"{prefix}:{i % 500}"
        keys = [f"{task}:guard", f"{task}:cancel", f"{task}:state", f"{task}:latest"]
        state = '{"status":"running","task_id":"' + task + '","queue":"bench","attempt":1}'
        return keys, ["running:owner", 60000, "done", "bench", "running", state, 60000]

    async def claim_alone(i: int) -> None:
        await pipe.script(claim, *claim_args(i))

    async def claim_pipelined(first: int) -> None:
        await asyncio.gather(*(pipe.script(claim, *claim_args(first + j)) for j in range(BATCH)))

    async def read_alone(_: int) -> None:
        await pipe.hget(record, "state")

    async def read_pipelined(_: int) -> None:
        await asyncio.gather(*(pipe.hget(record, "state") for _ in range(BATCH)))

    try:
        return {
            "claim, alone": await per_command_us(claim_alone, commands // 2, 1),
            f"claim, auto-pipelined ({BATCH})": await per_command_us(
                claim_pipelined, commands, BATCH
            ),
            "20 KiB read, alone": await per_command_us(read_alone, commands // 4, 1),
            f"20 KiB read, auto-pipelined ({BATCH})": await per_command_us(
                read_pipelined, commands // 2, BATCH
            ),
        }
    finally:
        assert (pipe._lean is not None) is lean  # every batch went the way measured
        keys = [k async for k in client.scan_iter(f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def amain(args: argparse.Namespace) -> None:
    parsers: dict[str, Any] = {"redis-py parser": _AsyncRESP3Parser}  # (RESP3: the default)
    if HIREDIS_AVAILABLE:
        parsers["hiredis"] = _AsyncHiredisParser
    variants = [(p, path) for p in parsers for path in PATHS]
    samples: dict[tuple[str, str, str], list[float]] = {}
    prefix = f"weclaw-bench-redis-client:{uuid.uuid4().hex}"
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for parser, path in variants[shift:] + variants[:shift]:
            measured = await measure(
                args.redis_url, parsers[parser], PATHS[path], args.commands, prefix
            )
            for case, us in measured.items():
                samples.setdefault((case, parser, path), []).append(us)
    cases = list(dict.fromkeys(case for case, _, _ in samples))
    header = ["case"]
    for parser in parsers:
        header += [f"{path}, {parser}" for path in PATHS] + [f"lean / redis-py ({parser})"]
    if HIREDIS_AVAILABLE:
        header.append("lean + hiredis / lean + redis-py parser")
    print("| " + " | ".join(header) + " | (us CPU per command)")
    print("|---" * len(header) + "|")
    for case in cases:
        cells = [case]
        lean: dict[str, float] = {}
        for parser in parsers:
            old, new = (statistics.median(samples[(case, parser, p)]) for p in PATHS)
            lean[parser] = new
            cells += [f"{old:.1f}", f"{new:.1f}", f"{new / old:.2f}x"]
        if HIREDIS_AVAILABLE:
            cells.append(f"{lean['hiredis'] / lean['redis-py parser']:.2f}x")
        print("| " + " | ".join(cells) + " |")
    if not HIREDIS_AVAILABLE:
        print("\nhiredis is not installed here: `pip install hiredis` in this venv to compare.")
    print(
        f"\n{args.repeats} repeats, interleaved; medians. {args.commands} commands per run "
        f"pipelined, a quarter to a half of that alone."
    )


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

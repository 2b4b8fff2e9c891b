"""kill -9 of ``weclaw-mq dlq requeue`` in the middle of 1000 dead letters, then run again:
none lost. Each move is "publish with confirm, then ack the DLQ copy", one message at a
time, so a kill at any instant leaves at most one message both moved and still in the DLQ:
at most one duplicate per kill, never a loss.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Callable

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from pydantic import BaseModel

from tests.conftest import queue_depth, wait_until
from tests.integration.processes import REPO_ROOT, cli_executable, run_cli, settings_env
from weclaw_mq import App
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name

DEAD_LETTERS = 1000
# Enough moved that the kill lands mid-run, far from both ends.
MOVED_BEFORE_KILL = 50
DUPLICATES_PER_KILL = 1


class Prompt(BaseModel):
    text: str


async def fill_dlq(channel: AbstractChannel, dlq: str, ids: list[str]) -> None:
    async def one(task_id: str) -> None:
        await channel.default_exchange.publish(
            aio_pika.Message(
                b'{"text":"x"}',
                message_id=task_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={h.DEAD_LETTER_REASON: "retries_exhausted", h.ATTEMPT: 3},
            ),
            routing_key=dlq,
        )

    for start in range(0, len(ids), 100):  # confirmed, 100 in flight at a time
        await asyncio.gather(*(one(t) for t in ids[start : start + 100]))


async def test_a_requeue_killed_with_sigkill_mid_run_and_run_again_loses_no_dead_letter(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    app = make_app()

    @app.handler(qname)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    ids = [f"dead-{i:04d}" for i in range(DEAD_LETTERS)]
    await fill_dlq(amqp, dlq_name(qname), ids)
    assert await queue_depth(amqp, dlq_name(qname)) == DEAD_LETTERS
    env = {**os.environ, **settings_env(app.settings)}

    # Paced, so the run is long enough to be caught in the middle.
    proc = await asyncio.create_subprocess_exec(
        cli_executable(),
        "dlq",
        "requeue",
        qname,
        "--rate",
        "200/s",
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_until(
            lambda: _moved_at_least(amqp, qname, MOVED_BEFORE_KILL, proc),
            30,
            f"the requeue to move {MOVED_BEFORE_KILL} messages",
        )
        assert proc.returncode is None, "the requeue ended before it could be killed"
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)  # by pid: only the process this test started
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # Killed in the middle: some moved, some not.
    assert 0 < await queue_depth(amqp, qname) < DEAD_LETTERS
    assert await queue_depth(amqp, dlq_name(qname)) > 0

    again = await run_cli("dlq", "requeue", qname, env=settings_env(app.settings), timeout_s=60)

    assert again.code == 0, again.stderr
    assert again.stdout.startswith("moved "), again.stdout
    assert await queue_depth(amqp, dlq_name(qname)) == 0  # the second run moved all left
    in_queue = await task_ids_in(amqp, qname)
    assert set(in_queue) == set(ids), "lost: " + ", ".join(sorted(set(ids) - set(in_queue)))
    duplicates = sum(in_queue.values()) - DEAD_LETTERS
    assert 0 <= duplicates <= DUPLICATES_PER_KILL, in_queue.most_common(3)


async def task_ids_in(channel: AbstractChannel, queue: str) -> Counter[str]:
    """How often each task id is in ``queue``, taking every message: one consumer rather
    than a basic.get per message (about a thousand round trips)."""
    expected = await queue_depth(channel, queue)
    seen: Counter[str] = Counter()
    all_taken = asyncio.Event()

    async def take(message: AbstractIncomingMessage) -> None:
        seen[message.message_id or ""] += 1
        if seen.total() == expected:
            all_taken.set()

    declared = await channel.declare_queue(queue, passive=True)
    tag = await declared.consume(take, no_ack=True)
    try:
        await asyncio.wait_for(all_taken.wait(), 30)
    finally:
        await declared.cancel(tag)
    return seen


async def _moved_at_least(
    channel: AbstractChannel, queue: str, n: int, proc: asyncio.subprocess.Process
) -> bool:
    if proc.returncode is not None:
        return True  # ended by itself: the assertion after the wait says so
    return await queue_depth(channel, queue) >= n

"""The runnable examples: the FastAPI producer (``producers.api``) and ``make demo``'s script.

Real broker, real Redis; the demo handler runs in a Worker in this event loop (start_worker)
or, for the demo script, in the worker process the script starts itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import socket
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel

from consumers import demo
from producers.api import RETRY_AFTER_S, create_app
from tests.conftest import forget_task_keys, queue_depth, settings_for, wait_until
from tests.integration.dead_endpoints import closed_port
from tests.integration.live_server import serving
from weclaw_mq import App
from weclaw_mq.contract.naming import dlq_name, task_keys

REPO_ROOT = Path(__file__).resolve().parents[2]
DEAD_BROKER_URL = "amqp://guest:guest@127.0.0.1:1/"
DEMO_RUN_TIMEOUT_S = 90.0


@pytest.fixture(autouse=True)
def fast_reliable_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in model answers at once and never fails, so results are deterministic."""
    monkeypatch.setenv("DEMO_LLM_FAILURE_RATE", "0")
    monkeypatch.setenv("DEMO_LLM_LATENCY_S", "0.01")
    monkeypatch.setenv("DEMO_LLM_WORD_S", "0.002")


@pytest.fixture
async def forget_tasks(redis_url: str) -> AsyncIterator[list[tuple[str, str]]]:
    """(queue, task id) pairs whose Redis records are deleted at teardown."""
    tasks: list[tuple[str, str]] = []
    yield tasks
    # First every task found in those queues, with its per-task-id keys (the demo's streamed
    # replies: 4 streams were left per run when only task_keys were deleted, as make_app's own
    # scan ran after this and found no record left to follow).
    await forget_task_keys(redis_url, {queue for queue, _ in tasks})
    client = aioredis.Redis.from_url(redis_url)
    try:
        for queue, task_id in tasks:
            await client.delete(*task_keys(queue, task_id))
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def demo_client(
    mq: App, queue: str, *, lifespan: bool = False
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the demo API over ``mq``, with the demo handler on ``queue``. ``lifespan``
    runs the API's startup too, which declares the queues."""
    demo.register(mq, queue=queue)
    api = create_app(mq)
    async with contextlib.AsyncExitStack() as stack:
        if lifespan:
            await stack.enter_async_context(api.router.lifespan_context(api))
        transport = httpx.ASGITransport(app=api)
        yield await stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://api")
        )


async def poll_status(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def finished() -> bool:
        response = await client.get(f"/tasks/{task_id}")
        if response.status_code == 200:
            seen.update(response.json())
        return seen.get("status") in ("succeeded", "dead_lettered")

    await wait_until(finished, timeout_s=20, what=f"task {task_id} to finish")
    return seen


async def test_posted_prompt_is_accepted_with_202_and_its_status_reaches_succeeded(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget_tasks: list[tuple[str, str]],
) -> None:
    mq = make_app("demo-api")
    # The lifespan declares the queues, so the API accepts tasks before any worker started.
    async with demo_client(mq, qname, lifespan=True) as client:
        response = await client.post("/tasks", json={"text": "hello", "user_id": "u1"})
        assert response.status_code == 202, response.text
        task_id = response.json()["task_id"]
        forget_tasks.append((qname, task_id))

        await start_worker(mq)
        body = await poll_status(client, task_id)

    assert body == {
        "task_id": task_id,
        "queue": qname,
        "status": "succeeded",
        "result": {
            "reply": demo.reply_to("hello"),
            "model": demo.MODEL_NAME,
            "attempt": 1,
            "continued_after_words": 0,
        },
        "error": None,
        "attempt": 1,
    }


async def test_post_with_an_idempotency_key_uses_it_as_the_task_id(
    make_app: Callable[..., App], qname: str, forget_tasks: list[tuple[str, str]]
) -> None:
    key = f"order-{qname}"
    forget_tasks.append((qname, key))
    async with demo_client(make_app("demo-api"), qname, lifespan=True) as client:
        response = await client.post(
            "/tasks", json={"text": "hi"}, headers={"Idempotency-Key": key}
        )
        refused = await client.post(
            "/tasks", json={"text": "hi"}, headers={"Idempotency-Key": "no spaces allowed"}
        )

    assert response.status_code == 202, response.text
    assert response.json() == {"task_id": key}
    assert refused.status_code == 422


async def test_post_answers_503_with_retry_after_when_the_broker_is_unreachable(
    redis_url: str, qname: str, forget_tasks: list[tuple[str, str]]
) -> None:
    # Built by hand: make_app pins the URL to the live broker. Nothing is declared on a
    # broker that does not answer, so there are no queues to delete.
    mq = App("demo-api", settings=settings_for(DEAD_BROKER_URL, redis_url))
    key = f"t-{qname}"
    forget_tasks.append((qname, key))
    # The lifespan's declare fails too: the API must start anyway and answer 503.
    async with demo_client(mq, qname, lifespan=True) as client:
        response = await client.post(
            "/tasks", json={"text": "hello"}, headers={"Idempotency-Key": key}
        )

    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
    detail = response.json()["detail"]
    assert "unavailable" in detail["message"]
    # The broker's address stays in the server log, out of the client's answer.
    assert "127.0.0.1" not in response.text


async def test_post_answers_413_when_the_prompt_is_over_the_size_limit(
    make_app: Callable[..., App], qname: str
) -> None:
    async with demo_client(make_app("demo-api", max_message_bytes=64), qname) as client:
        response = await client.post("/tasks", json={"text": "x" * 100})

    assert response.status_code == 413
    assert "64 bytes" in response.json()["detail"]


async def test_post_answers_422_when_the_body_is_not_a_prompt(
    make_app: Callable[..., App], qname: str
) -> None:
    async with demo_client(make_app("demo-api"), qname) as client:
        response = await client.post("/tasks", json={"prompt": "the field is called text"})

    assert response.status_code == 422


async def test_get_answers_404_for_a_task_id_nobody_published(
    make_app: Callable[..., App], qname: str
) -> None:
    async with demo_client(make_app("demo-api"), qname) as client:
        response = await client.get(f"/tasks/never-published-{qname}")

    assert response.status_code == 404


async def test_get_answers_503_when_redis_does_not_answer(broker_url: str, qname: str) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    mq = App("demo-api", settings=settings_for(broker_url, url, redis_timeout_s=1))
    async with mq, demo_client(mq, qname) as client:
        response = await client.get(f"/tasks/some-task-{qname}")

    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == str(RETRY_AFTER_S)


async def test_get_reads_one_queues_record_when_asked_for_it(
    make_app: Callable[..., App], qname: str, forget_tasks: list[tuple[str, str]]
) -> None:
    mq = make_app("demo-api")
    async with demo_client(mq, qname, lifespan=True) as client:
        response = await client.post("/tasks", json={"text": "hello", "user_id": "u1"})
        task_id = response.json()["task_id"]
        forget_tasks.append((qname, task_id))
        mine = await client.get(f"/tasks/{task_id}", params={"queue": qname})
        other = await client.get(f"/tasks/{task_id}", params={"queue": f"{qname}-other"})

    assert mine.status_code == 200 and mine.json()["status"] == "queued", mine.text
    assert other.status_code == 404


async def test_demo_script_runs_end_to_end_and_reports_every_task_succeeded(
    make_app: Callable[..., App],
    broker_url: str,
    redis_url: str,
    qname: str,
    forget_tasks: list[tuple[str, str]],
    amqp: AbstractChannel,
) -> None:
    # An App on the same queue name, so make_app deletes the demo's queues at teardown.
    demo.register(make_app("demo-cleanup"), queue=qname)
    env = {
        **os.environ,
        "DEMO_QUEUE": qname,
        "WECLAW_MQ_AMQP_URL": broker_url,
        "WECLAW_MQ_REDIS_URL": redis_url,
        "PYTHONUNBUFFERED": "1",
        # Slow enough that the worker is killed mid-reply (8 of 56 words) even on a busy machine.
        "DEMO_LLM_WORD_S": "0.03",
    }
    # Its own process group: on a timeout the script's worker child is killed with it.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumers.demo_run",
        "3",
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), DEMO_RUN_TIMEOUT_S)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise AssertionError(f"the demo did not finish within {DEMO_RUN_TIMEOUT_S} s") from None
    text = out.decode(errors="replace")
    rows = re.findall(r"^([0-9a-f-]{36})\s+(\S+)\s+(\d+)\s", text, flags=re.MULTILINE)
    forget_tasks.extend((qname, task_id) for task_id, _, _ in rows)

    assert proc.returncode == 0, text
    # The streamed reply: its worker killed mid-reply, the next run continued it (one marker,
    # nothing discarded), the text read complete.
    assert re.search(r"^\$ kill -9 \d+ ", text, flags=re.MULTILINE), text
    continued = re.search(
        r"^\[final\] succeeded; the last run continued after (\d+) words; "
        r"1 attempt marker\(s\), 0 words discarded$",
        text,
        re.M,
    )
    assert continued is not None and 8 <= int(continued[1]) < 56, text
    assert "check: the text read is the stored reply, 56 words, none twice: OK" in text, text
    assert "summary: 3 published, 3 succeeded, 0 dead-lettered; " in text, text
    assert "streamed reply through the crash: complete" in text, text
    assert [status for _, status, _ in rows] == ["succeeded"] * 3, text
    assert "worker exited with code 0" in text, text
    # Every task was acked: nothing waits in the queue or its DLQ.
    for name in (qname, dlq_name(qname)):
        assert await queue_depth(amqp, name) == 0, name


async def test_post_answers_422_for_a_lone_surrogate_in_the_prompt_or_in_a_bad_field(
    make_app: Callable[..., App], qname: str
) -> None:
    # "\ud800" is valid JSON but no UTF-8 text: it cannot become a task body, nor be echoed.
    async with demo_client(make_app("demo-api"), qname) as client:
        in_prompt = await client.post("/tasks", content=b'{"text": "\\ud800"}', headers=JSON)
        in_bad_field = await client.post("/tasks", content=b'{"text": ["\\ud800"]}', headers=JSON)

    assert in_prompt.status_code == 422, in_prompt.text
    assert "surrogates not allowed" in in_prompt.json()["detail"]
    assert in_bad_field.status_code == 422, in_bad_field.text
    assert in_bad_field.json()["detail"][0]["loc"] == ["body", "text"]


async def test_post_of_a_body_far_over_the_limit_is_refused_having_read_little_of_it(
    make_app: Callable[..., App], qname: str
) -> None:
    limit = 64 * 1024
    pulled = 0

    async def huge_body() -> AsyncIterator[bytes]:  # no Content-Length: sent chunked
        nonlocal pulled
        for _ in range(320):  # 20 MiB
            pulled += len(CHUNK)
            yield CHUNK

    tracemalloc.start()
    try:
        async with demo_client(make_app("demo-api", max_message_bytes=limit), qname) as client:
            response = await client.post("/tasks", content=huge_body(), headers=JSON)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert response.status_code == 413, response.text
    assert f"over the limit of {limit} bytes" in response.json()["detail"]
    # The app stopped asking for the body once past the limit: one chunk over it, no more.
    assert pulled <= limit + len(CHUNK)
    assert peak < 4 * 1024 * 1024, peak


async def test_a_real_server_answers_413_before_a_huge_body_is_sent_with_or_without_its_length(
    make_app: Callable[..., App], qname: str
) -> None:
    limit = 64 * 1024
    mq = make_app("demo-api", max_message_bytes=limit)
    demo.register(mq, queue=qname)
    async with serving(create_app(mq, declare_on_startup=False)) as base_url:
        port = int(base_url.rsplit(":", 1)[1])
        # A declared length over the limit: the answer comes before any of the body is sent.
        declared, _ = await asyncio.to_thread(
            send_body, port, headers=b"Content-Length: 200000000\r\n", total=0
        )
        # Chunked, no length: the server reads up to the limit, answers and closes, so the
        # client can send only what the socket buffers between them hold.
        chunked, sent = await asyncio.to_thread(
            send_body, port, headers=b"Transfer-Encoding: chunked\r\n", total=HUGE_BODY_BYTES
        )

    for answer in (declared, chunked):
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"over the limit of 65536 bytes" in answer
    assert sent < HUGE_BODY_BYTES // 4, sent


JSON = {"content-type": "application/json"}
CHUNK = b"x" * 65536
HUGE_BODY_BYTES = 64 * 1024 * 1024


def send_body(port: int, *, headers: bytes, total: int) -> tuple[bytes, int]:
    """POST /tasks with ``headers`` and up to ``total`` bytes of chunked body, sent while the
    answer is read; the answer (until the server closes) and the body bytes sent."""
    head = b"POST /tasks HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
    frame = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
    answer, sent, pending = b"", 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + headers + b"\r\n")
        sock.setblocking(False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sending = sent < total
            readable, writable, _ = select.select([sock], [sock] if sending else [], [], 1.0)
            if readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    break
                if not data:
                    break  # the server closed: its answer is complete
                answer += data
            if writable:
                pending = pending or frame
                try:
                    n = sock.send(pending)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    total = sent  # the server closed: nothing more goes
                    continue
                sent += n
                pending = pending[n:]
    return answer, sent

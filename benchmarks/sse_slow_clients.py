"""What clients that never read cost the example API's event streams (server RSS).

    .venv/bin/python -m benchmarks.sse_slow_clients            # 300 clients, 3,000 entries
    .venv/bin/python -m benchmarks.sse_slow_clients --clients 1500 --hold-s 12

Real Redis (``WECLAW_MQ_REDIS_URL``); no broker traffic (the API declares nothing). A session
inbox named for this run gets ``--entries`` chunks of ``--entry-bytes``; the example API
(``producers.api``) runs in a uvicorn process of its own; ``--clients`` raw sockets (receive
buffer 4 KiB) each ask for that inbox's events and never read. Printed: the server's RSS
before, its peak while the clients hold their connections, and ``--after-s`` after they
close. The inbox
is deleted at the end, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid

from fastapi import FastAPI

from weclaw_mq import App
from weclaw_mq.contract.naming import inbox_key, inbox_trace_key
from weclaw_mq.streaming.events import chunk_entry, encode_data

RUN_ENV = "BENCH_SSE_RUN"
START_TIMEOUT_S = 20.0


def api() -> FastAPI:
    """The example API for the server process (``uvicorn --factory``), on a queue of the run."""
    from consumers import demo
    from producers.api import create_app

    mq = App("bench-sse")
    demo.register(mq, queue=f"bench-sse-{os.environ[RUN_ENV]}")
    return create_app(mq, declare_on_startup=False)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def fill(session: str, entries: int, entry_bytes: int) -> None:
    app = App("bench-sse")
    try:
        chunk = encode_data("w" * entry_bytes)
        batch = [chunk_entry(f"t{n}", 1, chunk) for n in range(entries)]
        for start in range(0, entries, 500):
            await app.streams.deliver(session, batch[start : start + 500])
    finally:
        await app.close()


async def forget(session: str) -> None:
    app = App("bench-sse")
    try:
        client = app.streams._redis  # the store's own client: the keys are its
        await client.delete(inbox_key(session), inbox_trace_key(session))
    finally:
        await app.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_server(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the API process exited with {server.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the API did not listen on port {port} within {START_TIMEOUT_S} s")


def stalled_client(port: int, path: str) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    return sock


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--entries", type=int, default=3000)
    parser.add_argument("--entry-bytes", type=int, default=1000)
    parser.add_argument("--hold-s", type=int, default=8)
    # Past a keep-alive (15 s): a response whose socket was not full notices the close when
    # it next writes.
    parser.add_argument("--after-s", type=int, default=20)
    args = parser.parse_args()
    run = uuid.uuid4().hex[:8]
    session = f"bench-sse-{run}"
    asyncio.run(fill(session, args.entries, args.entry_bytes))
    port = free_port()
    env = dict(os.environ, **{RUN_ENV: run})
    command = [sys.executable, "-m", "uvicorn", "--factory", "benchmarks.sse_slow_clients:api"]
    server = subprocess.Popen([*command, "--port", str(port), "--log-level", "warning"], env=env)
    clients: list[socket.socket] = []
    try:
        wait_for_server(port, server)
        time.sleep(1)  # the first requests' imports are done: the baseline is the idle API
        before = rss_mib(server.pid)
        clients = [stalled_client(port, f"/sessions/{session}/events") for _ in range(args.clients)]
        peak = before
        for _ in range(args.hold_s):
            time.sleep(1)
            peak = max(peak, rss_mib(server.pid))
        for sock in clients:
            sock.close()
        clients = []
        time.sleep(args.after_s)
        after = rss_mib(server.pid)
    finally:
        for sock in clients:
            sock.close()
        server.terminate()
        server.wait(timeout=30)
        asyncio.run(forget(session))
    print(
        f"{args.clients} clients that never read, an inbox of {args.entries} x "
        f"{args.entry_bytes} B chunks, held {args.hold_s} s"
    )
    print(f"| server RSS (MiB) | before | peak while held | {args.after_s} s after they closed |")
    print("|---|---|---|---|")
    print(f"| example API | {before:.0f} | {peak:.0f} | {after:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A worker imports what its configuration uses (issue 17): no redis-py with the guard and
results off, no CLI or admin modules on the worker's path, no outbox without its file.
Checked in a fresh interpreter, since this test process has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from weclaw_mq import App, Settings, Worker

app = App("light", settings=Settings(results_enabled={results}, _env_file=None))

@app.handler("light-q", idempotent={results})
async def handle(task: dict) -> None:
    return None

Worker(app, concurrency=10)
assert app.spans is None  # opentelemetry is installed, but no TracerProvider was set
if {results}:
    app.store
names = {{m.split(".")[0] for m in sys.modules}} | {{m for m in sys.modules if "weclaw_mq." in m}}
print(json.dumps(sorted(names)))
"""


def loaded(results: bool) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(results=results)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return set(json.loads(out.stdout))


def test_a_worker_without_guard_and_results_never_imports_redis_nor_the_cli() -> None:
    modules = loaded(results=False)
    assert "weclaw_mq.worker.consume" in modules  # the probe did build a worker
    assert "redis" not in modules
    assert not {m for m in modules if m.startswith(("weclaw_mq.cli", "weclaw_mq.admin"))}
    assert not {"typer", "click", "fastapi"} & modules
    # The [otel] extra is installed here (dev), yet unused spans import nothing of it.
    assert "opentelemetry" not in modules
    # nor the outbox (sqlite3) without WECLAW_MQ_OUTBOX_PATH, nor pydantic-settings
    assert not {"sqlite3", "weclaw_mq.outbox.store", "pydantic_settings", "dotenv"} & modules
    # nor prometheus_client without a metrics port: the counters are plain objects until read
    assert "prometheus_client" not in modules
    # nor the metrics server's code (weclaw_mq.observability.metrics_server, the standard library's
    # servers)
    assert (
        not {"weclaw_mq.observability.metrics_server", "http", "wsgiref", "socketserver"} & modules
    )


# What ``weclaw-mq worker`` has loaded before it runs a worker: the whole CLI (typer builds
# every command at import), but none of what only the other commands use.
CLI_PROBE = """
import json, sys
import weclaw_mq.cli
from weclaw_mq.cli.exit_codes import ExitCode, classify
# a Redis error is classified without loading redis-py (none can exist before it is loaded)
assert classify(RuntimeError("x"))[0] is ExitCode.FAILED
names = {m.split(".")[0] for m in sys.modules} | {m for m in sys.modules if "weclaw_mq." in m}
print(json.dumps(sorted(names)))
"""


def test_the_worker_command_loads_no_redis_outbox_health_check_nor_rich() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CLI_PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    modules = set(json.loads(out.stdout))
    assert {"weclaw_mq.cli.run_worker", "weclaw_mq.worker.consume", "typer"} <= modules
    # redis-py (+6 MiB) was loaded by the CLI's error classifier, for every command
    assert "redis" not in modules
    # nor the file watcher of --reload (and its anyio)
    assert not {"watchfiles", "anyio"} & modules
    # the outbox (sqlite3) loads when an outbox command runs, the health check when it runs
    assert not {"sqlite3", "weclaw_mq.outbox", "weclaw_mq.admin.dependency_checks"} & modules
    assert (
        not {"rich", "prometheus_client", "weclaw_mq.observability.metrics_server", "opentelemetry"}
        & modules
    )


def test_a_store_loads_redis_when_the_configuration_asks_for_it() -> None:
    modules = loaded(results=True)
    assert {"redis", "weclaw_mq.state.redis", "weclaw_mq.state.pipelining"} <= modules


# What the supervisor of ``--processes N`` holds when it forks: the app loaded and what its
# workers import at their start, and nothing open (cli.supervisor).
BEFORE_FORK_PROBE = """
import json, os, sys, threading
from weclaw_mq import App, Settings
from weclaw_mq.cli.run_worker import preload

app = App("forking", settings=Settings(_env_file=None))

@app.handler("fork-q")
async def handle(task: dict) -> None:
    return None

preload(app, loop="asyncio", metrics=True)
fds = []
for fd in os.listdir("/proc/self/fd"):
    try:
        fds.append(os.readlink(f"/proc/self/fd/{fd}"))
    except FileNotFoundError:  # the listing's own, closed since
        pass
print(json.dumps({
    "threads": threading.active_count(),
    "sockets": [fd for fd in fds if fd.startswith(("socket:", "anon_inode:"))],
    "loaded": sorted(m for m in ("redis", "weclaw_mq.state.redis", "prometheus_client")
                     if m in sys.modules),
}))
"""


def test_the_supervisor_preloads_a_workers_imports_and_opens_nothing_before_it_forks() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BEFORE_FORK_PROBE],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    seen = json.loads(out.stdout)
    assert seen["loaded"] == ["prometheus_client", "redis", "weclaw_mq.state.redis"], seen
    # No connection, no event loop (its selector and self-pipe), no thread: a forked child
    # shares none of them.
    assert seen == {**seen, "threads": 1, "sockets": []}, seen

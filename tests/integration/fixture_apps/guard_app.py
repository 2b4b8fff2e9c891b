"""A worker app for idempotency tests and drills, configured by environment variables.

Run as ``weclaw-mq worker tests.integration.fixture_apps.guard_app:app`` with cwd at the
repository root. Every handler completion is recorded OUTSIDE the process, as an RPUSH of the
task id to the Redis list ``<GUARD_APP_RECORD_KEY>:runs``: a test can count completions (and
completions per task id, i.e. duplicates) after it killed the worker with SIGKILL.

Environment:
    GUARD_APP_QUEUE             the handler's queue (required to use ``app``)
    GUARD_APP_RECORD_KEY        prefix of this test's Redis keys (required to use ``app``)
    GUARD_APP_SLEEP_MIN_S       shortest handler run (default 0)
    GUARD_APP_SLEEP_MAX_S       longest handler run (default: the minimum)
    GUARD_APP_DIE_AFTER_STORE   "1": for a task flagged ``die_after_store``, the result store
                                SIGKILLs the process right after the succeeded record was
                                written, i.e. before the guard's done marker and the ack. Only
                                once per record key, so the redelivered copy can proceed.
    GUARD_APP_NOTIFY            "1": the handler publishes result notifications to
                                ``<queue>.results`` (``notify=True``)
    GUARD_APP_IDEMPOTENT        "0": the handler claims nothing (``idempotent=False``: the
                                guard off, results still stored); default "1"
The ``WECLAW_MQ_*`` settings apply as in any app.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from weclaw_mq import App, Context, Settings, TaskState, TaskStatus
from weclaw_mq.state import Finish, RedisTaskStore

if TYPE_CHECKING:
    from tests.integration.processes import WorkerProcess

APP_PATH = "tests.integration.fixture_apps.guard_app:app"


class Job(BaseModel):
    n: int = 0
    die_after_store: bool = False


def runs_key(record_key: str) -> str:
    """The list of task ids, one entry per handler completion."""
    return f"{record_key}:runs"


def died_key(record_key: str) -> str:
    """Set once the die-after-store mode has killed a process: later copies live."""
    return f"{record_key}:died"


def as_text(value: bytes | str) -> str:
    """A task id read back from the runs list (clients may or may not decode responses)."""
    return value.decode() if isinstance(value, bytes) else value


def record_keys(record_key: str) -> list[str]:
    return [runs_key(record_key), died_key(record_key)]


def _client(settings: Settings) -> aioredis.Redis:
    # Our own client, not the App's: the recording must not depend on the library's wiring.
    return aioredis.Redis.from_url(
        settings.redis_url_plain(), socket_connect_timeout=5, socket_timeout=5
    )


class DieAfterStoreResults(RedisTaskStore):
    """Stores a flagged task's success for real, then dies before anything else happens."""

    def __init__(self, client: aioredis.Redis, *, settings: Settings, record_key: str) -> None:
        super().__init__(
            client,
            ttl_s=settings.result_ttl_s,
            lease_s=settings.guard_lease_s,
            done_ttl_s=settings.done_ttl_s,
            heartbeat_ttl_s=settings.guard_heartbeat_ttl_s,
        )
        self._client = client
        self._record_key = record_key
        self.flagged: set[str] = set()

    async def record(self, state: TaskState, *, only_if_new: bool = False) -> bool:
        written = await super().record(state, only_if_new=only_if_new)
        await self._die_if_flagged(state)
        return written

    async def finish(
        self, queue: str, task_id: str, result: TaskState | None, *, owner: str | None = None
    ) -> Finish:
        # The worker stores a success this way when the guard is on (result and done marker
        # in one step): the kill lands after both, before the ack.
        finish = await super().finish(queue, task_id, result, owner=owner)
        if result is not None:
            await self._die_if_flagged(result)
        return finish

    async def _die_if_flagged(self, state: TaskState) -> None:
        if (
            state.status is TaskStatus.SUCCEEDED
            and state.task_id in self.flagged
            and await self._client.set(died_key(self._record_key), str(os.getpid()), nx=True)
        ):
            os.kill(os.getpid(), signal.SIGKILL)


def build_app(
    queue: str,
    *,
    settings: Settings,
    record_key: str,
    sleep_min_s: float = 0.0,
    sleep_max_s: float | None = None,
    die_after_store: bool = False,
    notify: bool = False,
    idempotent: bool = True,
) -> App:
    recorder = _client(settings)
    store: DieAfterStoreResults | None = None
    if die_after_store:
        store = DieAfterStoreResults(_client(settings), settings=settings, record_key=record_key)
    app = App("guard-fixture", settings=settings, store=store)
    longest = sleep_min_s if sleep_max_s is None else sleep_max_s

    @app.handler(queue, notify=notify, idempotent=idempotent)
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        await asyncio.sleep(random.uniform(sleep_min_s, longest))
        if store is not None and task.die_after_store:
            store.flagged.add(ctx.task_id)
        await recorder.rpush(runs_key(record_key), ctx.task_id)
        return {"n": task.n, "pid": os.getpid()}

    return app


def _app_from_env() -> App:
    queue, record_key = required_env(__name__, "GUARD_APP_QUEUE", "GUARD_APP_RECORD_KEY")
    shortest = float(os.environ.get("GUARD_APP_SLEEP_MIN_S", "0"))
    return build_app(
        queue,
        settings=Settings(),
        record_key=record_key,
        sleep_min_s=shortest,
        sleep_max_s=float(os.environ.get("GUARD_APP_SLEEP_MAX_S", str(shortest))),
        die_after_store=os.environ.get("GUARD_APP_DIE_AFTER_STORE") == "1",
        notify=os.environ.get("GUARD_APP_NOTIFY") == "1",
        idempotent=os.environ.get("GUARD_APP_IDEMPOTENT", "1") == "1",
    )


def spawn_worker(
    *,
    queue: str,
    record_key: str,
    settings: Settings,
    log_path: Path,
    concurrency: int = 1,
    sleep_min_s: float = 0.0,
    sleep_max_s: float | None = None,
    die_after_store: bool = False,
    metrics_port: int | None = None,
    notify: bool = False,
    idempotent: bool = True,
) -> WorkerProcess:
    """Start ``weclaw-mq worker`` on this app in a new process; its output goes to ``log_path``.

    The caller owns the process: kill it by pid (``WorkerProcess.kill``) when done.
    """
    # Imported here: the worker process itself never needs the test helpers.
    from tests.integration.processes import spawn_cli_worker

    app_env = {
        "GUARD_APP_QUEUE": queue,
        "GUARD_APP_RECORD_KEY": record_key,
        "GUARD_APP_SLEEP_MIN_S": str(sleep_min_s),
        "GUARD_APP_SLEEP_MAX_S": str(sleep_min_s if sleep_max_s is None else sleep_max_s),
        "GUARD_APP_DIE_AFTER_STORE": "1" if die_after_store else "0",
        "GUARD_APP_NOTIFY": "1" if notify else "0",
        "GUARD_APP_IDEMPOTENT": "1" if idempotent else "0",
    }
    extra = [] if metrics_port is None else ["--metrics-port", str(metrics_port)]
    return spawn_cli_worker(
        APP_PATH,
        settings=settings,
        app_env=app_env,
        log_path=log_path,
        concurrency=concurrency,
        extra_args=extra,
    )


# Built on first access rather than at import, so tests can import build_app without the
# worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

"""No password in the open: a full run with a distinctive password in both URLs (a RabbitMQ
user and a private Redis with requirepass, made for this test) prints it nowhere: not in the
worker's log (its Redis stopped under it included), the CLI's output and errors, ``health``,
``stats``, the ``/metrics`` and ``/healthz`` pages, the demo script's output (``make demo``),
or the example API's answers and log lines."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from consumers import demo
from tests.conftest import settings_for, wait_until
from tests.integration.broker_users import broker_user
from tests.integration.dead_endpoints import closed_port
from tests.integration.processes import REPO_ROOT, run_cli, settings_env, spawn_cli_worker
from tests.integration.test_examples import demo_client
from tests.private_servers import PrivateRedis, PrivateServers
from weclaw_mq import App
from weclaw_mq.admin.permissions import Role, grant

APP_PATH = "tests.integration.fixture_apps.worker_app:app"


async def test_a_full_run_never_shows_the_password(
    qname: str,
    broker_url: str,
    tmp_path: Path,
    private_servers: PrivateServers,
    make_app: Callable[..., App],
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = f"Sekr1t{uuid.uuid4().hex[:12]}"
    wrong = f"Wr0ng{uuid.uuid4().hex[:12]}"  # a mistyped password must not show either
    redis = PrivateRedis(private_servers, private_servers.folder("redis"), password=secret)
    redis.start()
    seen: list[str] = []
    operator = make_app("fixture")  # the queues' names, and their removal at teardown

    @operator.handler(qname, priorities=True)  # as the fixture app's: its lanes are granted
    async def work(task: dict[str, str]) -> None:
        return None

    demo_queue = f"{qname}-demo"
    demo.register(operator, queue=demo_queue)  # what 'make demo' runs, on a queue of its own
    caplog.set_level(logging.DEBUG)
    worker = None
    try:
        with broker_user(
            broker_url, grant(Role.OPERATOR, operator.handlers.values()), password=secret
        ) as (_, url):
            settings = settings_for(url, redis.url)
            env = {**settings_env(settings), "TEST_QUEUE": qname, "TEST_RECORD_DIR": str(tmp_path)}
            metrics_port = closed_port()

            async def cli(*args: str, **extra: str) -> None:
                done = await run_cli(*args, env={**env, **extra})
                seen.extend([" ".join(args), done.stdout, done.stderr])

            async def demo_run() -> None:
                # The demo script starts its own worker process and prints both outputs.
                fast = {"DEMO_QUEUE": demo_queue, "DEMO_LLM_FAILURE_RATE": "0"}
                fast["DEMO_LLM_LATENCY_S"] = "0.01"
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "consumers.demo_run",
                    "2",
                    cwd=REPO_ROOT,
                    env={**os.environ, **env, **fast, "PYTHONUNBUFFERED": "1"},
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                )
                out, _ = await asyncio.wait_for(proc.communicate(), 90)
                seen.append(out.decode(errors="replace"))
                assert "2 succeeded" in seen[-1], seen[-1]

            worker = spawn_cli_worker(
                APP_PATH,
                settings=settings,
                app_env={"TEST_QUEUE": qname, "TEST_RECORD_DIR": str(tmp_path)},
                log_path=tmp_path / "worker.log",
                extra_args=["--metrics-port", str(metrics_port), "--log-level", "DEBUG"],
            )
            await cli("declare", APP_PATH)
            await worker.wait_consuming()
            bad_amqp = url.replace(quote(secret), wrong)
            dead = f"amqp://someone:{wrong}@127.0.0.1:{closed_port()}/"
            # At once, to keep the test short. Wrong passwords and dead servers too: the
            # errors name the URL, never its password.
            await asyncio.gather(
                demo_run(),
                cli("publish", qname, "--data", '{"text": "hi"}', "--task-id", "t-1"),
                cli("status", "t-1", "--wait", "20"),
                cli("health"),
                cli("stats", qname, "--app", APP_PATH),
                cli("dlq", "list", qname),
                cli("health", WECLAW_MQ_AMQP_URL=bad_amqp),
                cli("publish", qname, "--data", "{}", WECLAW_MQ_AMQP_URL=bad_amqp),
                cli("declare", APP_PATH, WECLAW_MQ_AMQP_URL=dead),
                cli("health", WECLAW_MQ_REDIS_URL=redis.url.replace(secret, wrong)),
            )
            async with httpx.AsyncClient() as client:
                page = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
                health = await client.get(f"http://127.0.0.1:{metrics_port}/healthz")
            seen.extend([page.text, health.text])
            # Redis gone under a running worker: its warnings name the failure, not the URL.
            redis.stop()
            async with App("fixture", settings=settings) as producer:
                await producer.publish(qname, {"text": "while redis is down"})
            await wait_until(
                lambda: "task store unavailable" in worker.log() if worker else False,
                20,
                "the worker to meet Redis down",
            )
            redis.start()
            # The example API, in process: its answers and log lines.
            api_app = App("demo-api", settings=settings_for(url, redis.url))
            async with demo_client(api_app, qname) as client:
                posted = await client.post("/tasks", json={"text": "hi"})
                got = await client.get(f"/tasks/{posted.json()['task_id']}")
                seen.extend([posted.text, got.text])
            dead_api = App("demo-api", settings=settings_for(dead, redis.url))
            async with demo_client(dead_api, qname) as client:
                refused = await client.post("/tasks", json={"text": "hi"})
                seen.append(refused.text)
            assert refused.status_code == 503
    finally:
        if worker is not None:
            worker.kill()
            seen.append(worker.log())
        redis.stop()
    seen.extend(r.getMessage() for r in caplog.records)
    seen.extend(str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    everything = "\n".join(seen)
    # The run did happen: the task succeeded, the failures were reported.
    assert '"status": "succeeded"' in everything and "weclaw-mq: error:" in everything
    for password in (secret, wrong):
        assert password not in everything, [s for s in seen if password in s][:1]

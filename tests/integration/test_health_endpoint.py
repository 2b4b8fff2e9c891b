"""``/healthz`` on a real worker's metrics port follows its broker link: 200 while it
consumes, 503 once the link is cut (and stays cut), 200 again after it heals. The worker
dials the broker through a TCP proxy of this test; the shared broker itself is never touched.
``/metrics`` still serves the metrics, and any other path is 404."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.conftest import wait_until
from tests.drills.tcp_proxy import TcpProxy
from tests.integration.processes import OpenFleet
from tests.private_servers import free_port


async def _get(port: int, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(f"http://127.0.0.1:{port}{path}")


async def _health_becomes(port: int, code: int, what: str) -> dict[str, Any]:
    seen: list[httpx.Response] = []

    async def answers() -> bool:
        try:
            seen.append(await _get(port, "/healthz"))
        except httpx.TransportError:
            return False  # the server is not up yet
        return seen[-1].status_code == code

    await wait_until(answers, 30, what)
    body: dict[str, Any] = seen[-1].json()
    return body


async def test_healthz_goes_503_while_the_broker_link_is_cut_and_200_when_it_heals(
    open_fleet: OpenFleet, broker_url: str, qname: str
) -> None:
    target = urlsplit(broker_url)
    async with TcpProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        port = free_port()
        async with open_fleet(
            broker_url=proxy.url_for(broker_url),
            metrics_port=port,
            heartbeat_s=2,
            reconnect_max_delay_s=1.0,
        ) as fleet:
            worker = await fleet.start_consuming()
            healthy = await _health_becomes(port, 200, "/healthz 200 once consuming")
            assert healthy == {"status": "ok", "broker": "open", "queues": {qname: "consuming"}}

            metrics = await _get(port, "/metrics")
            assert metrics.status_code == 200
            assert "weclaw_mq_reconnects_total" in metrics.text
            for path in ("/", "/health", "/metrics/x"):
                assert (await _get(port, path)).status_code == 404, path

            # Cut every link and let no new one through: the worker cannot reconnect.
            proxy.blackhole()
            assert proxy.cut() >= 1
            down = await _health_becomes(port, 503, "/healthz 503 after the cut")
            assert down == {"status": "unavailable", "broker": "closed", "queues": {qname: "down"}}
            # Still serving metrics while unhealthy.
            assert (await _get(port, "/metrics")).status_code == 200

            proxy.pass_traffic()
            healed = await _health_becomes(port, 200, "/healthz 200 after the link healed")
            assert healed["queues"] == {qname: "consuming"}
            assert worker.popen.poll() is None, worker.describe()
            # It is really consuming again: a task published now is handled.
            task_id = await fleet.app.publish(qname, {"text": "after the cut"})
            state = await fleet.app.result(task_id, timeout_s=20)
            assert state is not None and state.result == {"echo": "after the cut"}

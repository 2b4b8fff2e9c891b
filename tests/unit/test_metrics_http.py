"""The metrics port's paths and its bind address, served for real on an ephemeral port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.settings import Settings
from weclaw_mq.worker.health import QueueState, WorkerHealth


def _get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_the_metrics_port_listens_on_this_host_only_by_default() -> None:
    assert Settings(_env_file=None).metrics_addr == "127.0.0.1"  # type: ignore[call-arg]
    server = Metrics().serve(0)
    try:
        assert server.address == ("127.0.0.1", server.port)
    finally:
        server.close()


def test_healthz_answers_the_report_and_other_paths_are_404() -> None:
    reports = [
        WorkerHealth(broker_open=True, queues={"a": QueueState.CONSUMING, "b": QueueState.PAUSED}),
        WorkerHealth(broker_open=True, queues={"a": QueueState.CONSUMING, "b": QueueState.DOWN}),
    ]
    metrics = Metrics()
    metrics.messages.labels("a", "acked").inc()
    server = metrics.serve(0, health=lambda: reports[0])
    try:
        # A paused queue (its breaker is open) is healthy: it waits for its upstream.
        code, kind, body = _get(server.port, "/healthz")
        assert (code, kind) == (200, "application/json")
        assert json.loads(body) == {
            "status": "ok",
            "broker": "open",
            "queues": {"a": "consuming", "b": "paused"},
        }
        reports.pop(0)
        code, _, body = _get(server.port, "/healthz")
        assert code == 503
        assert json.loads(body)["queues"]["b"] == "down"
        code, _, body = _get(server.port, "/metrics")
        assert code == 200
        assert b'weclaw_mq_messages_total{outcome="acked",queue="a"} 1.0' in body
        for path in ("/", "/metrics/", "/healthz/x", "/favicon.ico"):
            assert _get(server.port, path)[0] == 404, path
    finally:
        server.close()


def test_a_process_without_a_health_report_has_no_healthz() -> None:
    server = Metrics().serve(0)
    try:
        assert _get(server.port, "/healthz")[0] == 404
        assert _get(server.port, "/metrics")[0] == 200
    finally:
        server.close()

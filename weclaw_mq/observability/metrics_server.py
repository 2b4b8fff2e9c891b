"""The metrics port: ``/metrics`` for Prometheus and ``/healthz`` for probes, nothing else.

``/healthz`` answers 200 with a small JSON body when the process is healthy by its own
report (a worker: its broker connection is open and every handler queue is consumed), 503
with the same body naming what is down otherwise; a process that reports nothing (the outbox
relay) has no ``/healthz``. Any other path is 404, so a probe or a scraper pointed at the
wrong path fails loudly instead of reading metrics as "healthy".

The server runs in a daemon thread, beside the event loop: a scrape costs the loop nothing,
and answers while a handler holds the loop.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"


def _json_headers() -> list[tuple[str, str]]:
    # A new list per response: wsgiref adds Content-Length to the list it is handed.
    return [("Content-Type", "application/json")]


class HealthReport(Protocol):
    @property
    def ok(self) -> bool: ...

    def as_json(self) -> Mapping[str, object]: ...


StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def endpoints(
    registry: CollectorRegistry, health: Callable[[], HealthReport] | None = None
) -> WsgiApp:
    """The WSGI app of the metrics port (served by ``MetricsServer``; also mountable)."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == METRICS_PATH:
            body: Iterable[bytes] = metrics(environ, start_response)
            return body
        if path == HEALTH_PATH and health is not None:
            report = health()
            status = "200 OK" if report.ok else "503 Service Unavailable"
            start_response(status, _json_headers())
            return [json.dumps(report.as_json()).encode()]
        start_response("404 Not Found", _json_headers())
        known = [METRICS_PATH, *([HEALTH_PATH] if health is not None else [])]
        return [json.dumps({"error": f"no such path; see {', '.join(known)}"}).encode()]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood the worker's log: none are logged."""


class _Server6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics`` (and ``/healthz``) on ``addr:port`` in a daemon thread until ``close``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        *,
        addr: str,
        health: Callable[[], HealthReport] | None = None,
    ) -> None:
        server_class: type[WSGIServer] = _Server6 if ":" in addr else ThreadingWSGIServer
        self._server = make_server(
            addr, port, endpoints(registry, health), server_class, handler_class=_Quiet
        )
        self.port: int = self._server.server_port  # the one bound, when port was 0
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="weclaw-mq-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

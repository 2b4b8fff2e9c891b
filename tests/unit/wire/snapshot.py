"""What goes on the wire for one example app: every header and name, each handler's
declarations, and the messages ``App.prepare`` builds. ``python -m tests.unit.wire.snapshot``
prints it as JSON; ``wire_0.1.0.json`` is that print from the last release, and
``test_wire_compat`` holds today's code to it, so a refactoring cannot change the wire."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import weclaw_mq
from weclaw_mq import App, Limit, Priority, RetryPolicy

VERSIONS = [None, "3.10.8", "3.13.7", "4.0.5", "4.2.1", "4.3.0"]
EXAMPLE_TASK = "task-1"


def _app() -> App:
    app = App("wire-snapshot")

    @app.handler("wire.plain")
    async def plain(payload: dict[str, Any], ctx: weclaw_mq.Context) -> dict[str, Any]:
        return payload

    @app.handler(
        "wire.full",
        retry=RetryPolicy(max_retries=4, delay_s=2.0, max_delay_s=30.0),
        priorities=True,
        notify=True,
        limit=Limit(key=lambda task: str(task["user"]), concurrency=2),
        ttl_s=600,
    )
    async def full(payload: dict[str, Any], ctx: weclaw_mq.Context) -> dict[str, Any]:
        return payload

    @app.handler("wire.classic", queue_type="classic", priorities=True)
    async def classic(payload: dict[str, Any], ctx: weclaw_mq.Context) -> dict[str, Any]:
        return payload

    return app


def _plain(value: Any) -> Any:
    """JSON of a header or argument value; a time becomes its type (it differs per run)."""
    if isinstance(value, datetime):
        return "<datetime>"
    if isinstance(value, int) and not isinstance(value, bool) and value > 1_600_000_000_000:
        return "<epoch ms>"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


def snapshot() -> dict[str, Any]:
    from weclaw_mq.contract import headers, naming
    from weclaw_mq.policy.broker_version import parse_server_version
    from weclaw_mq.wire import topology

    app = _app()
    out: dict[str, Any] = {
        "headers": {k: v for k, v in vars(headers).items() if k.isupper()},
        "naming_constants": {
            k: v for k, v in vars(naming).items() if k.isupper() and isinstance(v, str)
        },
    }
    q, t = "wire.full", EXAMPLE_TASK
    out["names"] = {
        "dlq": naming.dlq_name(q),
        "results": naming.results_queue_name(q),
        "lanes": {lvl: naming.lane_queue_name(q, lvl) for lvl in ("high", "urgent")},
        "ladder_2000": naming.ladder_queue_name(2000),
        "parking": naming.parking_queue_name(),
        "retry_2000": naming.retry_queue_name(q, 2000),
        "delay_2000": naming.delay_queue_name(q, 2000),
        "guard": naming.guard_key(q, t),
        "state": naming.state_key(q, t),
        "body": naming.body_key(q, t),
        "latest": naming.latest_key(t),
        "done": naming.done_channel(t),
        "stream": naming.stream_key(t),
        "inbox": naming.inbox_key("s-1"),
        "inbox_trace": naming.inbox_trace_key("s-1"),
        "cancel": naming.cancel_key(t),
        "heartbeat": naming.heartbeat_key("w-1"),
        "task_keys": naming.task_keys(q, t),
        "limit": list(naming.limit_keys(q, 0, "user-1")),
    }
    declarations: dict[str, Any] = {}
    for raw in VERSIONS:
        version = parse_server_version(raw) if raw else None
        specs = [spec.queue_spec() for spec in app.handlers.values()]
        per: dict[str, Any] = {
            "ladder": _plain(topology.ladder_declarations(specs, version)),
        }
        for spec in specs:
            per[spec.name] = _plain(topology.queue_declarations(spec, version))
        declarations[str(raw)] = per
    out["declarations"] = declarations
    messages: dict[str, Any] = {}
    cases: dict[str, dict[str, Any]] = {
        "plain": {"queue": "wire.plain"},
        "full": {"queue": "wire.full", "priority": Priority.HIGH, "session_id": "s-1"},
        "ttl_delay": {"queue": "wire.full", "ttl_s": 120, "delay_s": 5, "headers": {"k": "v"}},
        "classic": {"queue": "wire.classic", "priority": "urgent"},
    }
    for name, kwargs in cases.items():
        queue = kwargs.pop("queue")
        message = app.prepare(
            queue, {"prompt": "hi", "user": "u"}, task_id=t, trace_id="trace-1", **kwargs
        )
        messages[name] = {
            "body": message.body.decode(),
            "message_id": message.message_id,
            "content_type": message.content_type,
            "delivery_mode": int(message.delivery_mode),
            "priority": message.priority,
            "expiration": _plain(message.expiration),
            "headers": _plain(dict(message.headers or {})),
        }
    out["messages"] = messages
    return out


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1, sort_keys=True))

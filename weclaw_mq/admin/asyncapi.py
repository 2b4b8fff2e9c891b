"""An App's contract as an AsyncAPI 3.0.0 document: read from its handlers, no I/O.

What a foreign producer or consumer needs, per handler queue ``Q``:

- channel ``Q`` (the queue, through the default exchange with routing key ``Q``): the task
  message, its payload the handler's first annotation as JSON Schema, its headers
  (``asyncapi_headers``); operations ``Q.send`` (producers publish) and ``Q.receive`` (the
  app's worker consumes, its reply the task's record in Redis);
- channel ``Q.result`` (Redis, no fixed address): the record ``App.result`` and
  ``weclaw-mq status`` read, whose ``result`` is the handler's return annotation;
- channel ``Q.dlq`` and operation ``Q.deadLetter``: the dead letter and its headers;
- ``<Q>.results`` (``notify=``): the ``TaskNotification`` the worker publishes;
- ``Q.stream`` (Redis; handlers that take a context, so may call ``ctx.emit``): the events.

Schemas are pydantic's (JSON Schema 2020-12); for plain objects, lists, strings and numbers
that is the same as the AsyncAPI Schema format (a superset of draft 07). Every model lands in
``components.schemas`` once, named by pydantic (which keeps two models of one name apart).
Servers come from the settings' URLs with any password masked (``***``).
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pydantic import TypeAdapter

from weclaw_mq.admin import asyncapi_headers as hd
from weclaw_mq.admin.permissions import vhost_of
from weclaw_mq.app import App
from weclaw_mq.contract.message import CONTENT_TYPE
from weclaw_mq.contract.naming import dlq_name, fair_lane_name, lane_queue_name
from weclaw_mq.handlers.notifications import TaskNotification
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.settings import Settings, redact_url
from weclaw_mq.state import TaskState
from weclaw_mq.streaming import StreamEvent

ASYNCAPI_VERSION = "3.0.0"
AMQP_BINDING_VERSION = "0.3.0"
REF = "#/components/schemas/{model}"
# Ours, beside pydantic's names (which never hold a "."), so no model of yours meets them.
TASK_HEADERS = "weclaw_mq.TaskHeaders"
DEAD_LETTER_HEADERS = "weclaw_mq.DeadLetterHeaders"
_NOT_A_KEY = re.compile(r"[^A-Za-z0-9_.-]")

# What aio-pika sets on every task message (weclaw_mq.contract.message.build_message).
AMQP_PROPERTIES = {
    "message_id": "the task id (a uuid4 unless the producer gives one): printable, at most "
    "255 bytes; publishing the same id again is the same task (the idempotency guard)",
    "content_type": CONTENT_TYPE,
    "delivery_mode": "2 (persistent)",
    "timestamp": "when the task was published",
    "expiration": "the task's lifetime in ms (x-weclaw-ttl-ms): RabbitMQ dead-letters it to "
    "Q.dlq past it",
}


def key(queue: str) -> str:
    """A queue name as a component key (letters, digits, ``_.-``): ``:`` becomes ``_``."""
    return _NOT_A_KEY.sub("_", queue)


def build_document(app: App, *, version: str = "1.0.0") -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of ``app`` (plain JSON data); ``version`` is info.version."""
    specs = list(app.handlers.values())
    schemas, types = _schemas(specs)
    hosts = servers(app.settings)
    d = _Parts(
        types,
        vhost=vhost_of(app.settings.amqp_urls()[0]),
        brokers=[_ref("servers", name) for name in hosts if name != "redis"],
        stores_results=app.settings.results_enabled,
    )
    for spec in specs:
        _add_handler(spec, d)
    for spec in specs:  # after every handler: a notify= queue may be one of them
        if spec.notify is not None:
            _add_notifications(spec, spec.notify.queue, d)
    schemas[TASK_HEADERS] = hd.headers_schema(TASK_HEADERS, (*hd.TASK, *hd.FAILURE))
    schemas[DEAD_LETTER_HEADERS] = hd.headers_schema(
        DEAD_LETTER_HEADERS, (*hd.TASK, *hd.FAILURE, *hd.DEAD_LETTER)
    )
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": app.name,
            "version": version,
            "description": f"The task queues of the weclaw_mq app {app.name!r}: "
            f"{len(specs)} handler(s).",
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": hosts,
        "channels": d.channels,
        "operations": d.operations,
        "components": {"schemas": schemas, "messages": d.messages},
    }


def servers(settings: Settings) -> dict[str, Any]:
    """One server per AMQP URL (failover list: ``rabbitmq``, ``rabbitmq-2``...) and Redis."""
    out: dict[str, Any] = {}
    for i, url in enumerate(settings.amqp_urls(), start=1):
        parts = urlsplit(url)
        out["rabbitmq" if i == 1 else f"rabbitmq-{i}"] = {
            "host": parts.netloc.rpartition("@")[2],
            "protocol": parts.scheme,
            "protocolVersion": "0.9.1",
            "pathname": parts.path or "/",
            "description": f"RabbitMQ, vhost {vhost_of(url)!r} (WECLAW_MQ_AMQP_URL: "
            f"{redact_url(url)}).",
        }
    redis = settings.redis_url_plain()
    parts = urlsplit(redis)
    out["redis"] = {
        "host": parts.netloc.rpartition("@")[2],
        "protocol": "redis",
        "description": f"Redis: task records and streams (WECLAW_MQ_REDIS_URL: "
        f"{redact_url(redis)}).",
    }
    return out


def _annotations(spec: HandlerSpec) -> tuple[Any, Any]:
    """The handler's task and return annotations (``Any`` where there is none). Resolved
    once already (``build_spec``), so no forward reference can fail here."""
    hints = typing.get_type_hints(spec.func)
    task = next(
        p.name
        for p in inspect.signature(spec.func).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )
    return hints.get(task, Any), hints.get("return", Any)


def _adapter(annotation: Any) -> TypeAdapter[Any] | None:
    """A TypeAdapter of ``annotation`` if pydantic can write its JSON Schema, else None."""
    try:
        adapter: TypeAdapter[Any] = TypeAdapter(annotation)
        adapter.json_schema()
    except Exception:  # pydantic validates it (or not), but has no JSON Schema for it
        return None
    return adapter


def _schemas(specs: list[HandlerSpec]) -> tuple[dict[str, Any], dict[tuple[str, str], Any]]:
    """``components.schemas`` and, per (queue, "payload" | "result"), the schema or its $ref;
    ours under ("", class name).

    One pydantic run over every type, so a model used by two handlers is one component and
    two models of one name get two names (then ours are renamed too: always use the $ref
    given here)."""
    types: dict[tuple[str, str], Any] = {}
    inputs: list[tuple[tuple[str, str], Any, TypeAdapter[Any]]] = [
        (("", "TaskState"), "serialization", TypeAdapter(TaskState)),
        (("", "TaskNotification"), "serialization", TypeAdapter(TaskNotification)),
        (("", "StreamEvent"), "serialization", TypeAdapter(StreamEvent)),
    ]
    for spec in specs:
        task, returns = _annotations(spec)
        for part, mode, annotation in (
            ("payload", "validation", task),
            ("result", "serialization", returns),
        ):
            adapter = _adapter(annotation)
            if adapter is not None:
                inputs.append(((spec.queue, part), mode, adapter))
            else:
                types[(spec.queue, part)] = {
                    "description": f"Any JSON: pydantic has no JSON Schema for {annotation!r}."
                }
    by_key, defs = TypeAdapter.json_schemas(inputs, ref_template=REF)
    types.update({k: schema for (k, _mode), schema in by_key.items()})
    return dict(defs.get("$defs", {})), types


def _ref(*path: str) -> dict[str, str]:
    return {"$ref": "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path)}


def _amqp_queue(name: str, vhost: str) -> dict[str, Any]:
    queue = {"name": name, "durable": True, "exclusive": False, "autoDelete": False}
    return {
        "amqp": {
            "is": "queue",
            "queue": {**queue, "vhost": vhost},
            "bindingVersion": AMQP_BINDING_VERSION,
        }
    }


def _handler_extension(spec: HandlerSpec) -> dict[str, Any]:
    r = spec.retry
    return {
        "handler": spec.name,
        "retry": {
            "max_retries": r.max_retries,
            "delay_s": r.delay_s,
            "multiplier": r.multiplier,
            "max_delay_s": r.max_delay_s,
        },
        "timeout_s": spec.timeout_s,
        "delivery_limit": spec.delivery_limit,
        "ttl_s": spec.ttl_s,
        "idempotent": spec.idempotent,
        "priority": spec.priority.value,
        "priorities": spec.priorities,
        "queue_type": spec.queue_type,
        "max_length": spec.max_length,
    }


@dataclass
class _Parts:
    """The document's maps, filled handler by handler."""

    types: dict[tuple[str, str], Any]  # from _schemas
    vhost: str
    brokers: list[dict[str, str]]  # $refs of the RabbitMQ servers
    stores_results: bool
    channels: dict[str, Any] = field(default_factory=dict)
    operations: dict[str, Any] = field(default_factory=dict)
    messages: dict[str, Any] = field(default_factory=dict)
    task_channels: dict[str, str] = field(default_factory=dict)  # handler queue -> its key

    def claim(self, space: dict[str, Any], wanted: str) -> str:
        """``wanted``, or ``wanted-2``, ``-3``...: queue names may meet in a key ("a:b" and
        "a_b"; a handler queue "q.result" and q's result channel), never overwrite."""
        name, n = wanted, 1
        while name in space:
            n += 1
            name = f"{wanted}-{n}"
        space[name] = None  # taken; the caller fills it
        return name


def _add_handler(spec: HandlerSpec, d: _Parts) -> None:
    q = spec.queue
    k = d.task_channels[q] = d.claim(d.channels, key(q))
    message = d.claim(d.messages, f"{key(q)}.task")
    d.messages[message] = {
        "name": "task",
        "title": f"A task of {q}",
        "contentType": CONTENT_TYPE,
        "headers": _ref("components", "schemas", TASK_HEADERS),
        "payload": d.types[(q, "payload")],
        "x-weclaw-amqp-properties": AMQP_PROPERTIES,
        "bindings": {"amqp": {"bindingVersion": AMQP_BINDING_VERSION}},
    }
    lanes = (
        f" With priorities=True, a high or urgent task goes to {lane_queue_name(q, 'high')} / "
        f"{lane_queue_name(q, 'urgent')} where the broker has no usable priorities, else to "
        "this queue with the AMQP priority property (App.publish decides by broker version)."
        if spec.priorities
        else ""
    )
    if spec.fair is not None:
        lanes += (
            f" With fair share, App.publish sends a NORMAL task to its tenant's lane: this "
            f"queue or {fair_lane_name(q, 1)} ... {fair_lane_name(q, spec.fair.lanes - 1)} "
            "(the tenant in x-weclaw-tenant); a producer that does not place tenants sends here."
        )
    d.channels[k] = {
        "address": q,
        "title": q,
        "description": f"The work queue of {spec.name} ({spec.queue_type}). Publish through "
        f"the default exchange with routing key {q!r}.{lanes}",
        "servers": d.brokers,
        "messages": {"task": _ref("components", "messages", message)},
        "bindings": _amqp_queue(q, d.vhost),
    }
    task_message = [_ref("channels", k, "messages", "task")]
    d.operations[d.claim(d.operations, f"{key(q)}.send")] = {
        "action": "send",
        "title": f"Publish a task to {q}",
        "description": "A producer publishes with confirms; the body must fit the payload.",
        "channel": _ref("channels", k),
        "messages": task_message,
        "bindings": {
            "amqp": {
                "deliveryMode": 2,
                "mandatory": True,
                "timestamp": True,
                "bindingVersion": AMQP_BINDING_VERSION,
            }
        },
    }
    receive: dict[str, Any] = {
        "action": "receive",
        "title": f"Run {spec.name}",
        "description": "The worker acks a task only after its result is stored; a failure "
        "retries it through a delay queue, then dead-letters it to the DLQ channel.",
        "channel": _ref("channels", k),
        "messages": task_message,
        "bindings": {"amqp": {"ack": True, "bindingVersion": AMQP_BINDING_VERSION}},
        "x-weclaw-handler": _handler_extension(spec),
    }
    if d.stores_results:
        result = _add_result(spec, d)
        receive["reply"] = {
            "channel": _ref("channels", result),
            "messages": [_ref("channels", result, "messages", "result")],
        }
    d.operations[d.claim(d.operations, f"{key(q)}.receive")] = receive
    _add_dead_letters(spec, d)
    if spec.takes_context:
        _add_stream(spec, d)


def _with_result(base: Any, result: Any) -> dict[str, Any]:
    """``base`` (a record schema's $ref) whose ``result`` is ``result`` (or null: any other
    end than succeeded)."""
    return {
        "allOf": [base, {"properties": {"result": {"anyOf": [result, {"type": "null"}]}}}],
    }


def _add_result(spec: HandlerSpec, d: _Parts) -> str:
    """The channel of the task's record in Redis; returns its key."""
    k = d.claim(d.channels, f"{key(spec.queue)}.result")
    message = d.claim(d.messages, f"{key(spec.queue)}.result")
    d.messages[message] = {
        "name": "result",
        "title": f"The record of a task of {spec.queue}",
        "summary": "Its result is the handler's return value once the status is succeeded "
        "(null before, and for any other end).",
        "contentType": CONTENT_TYPE,
        "payload": _with_result(d.types[("", "TaskState")], d.types[(spec.queue, "result")]),
    }
    d.channels[k] = {
        "address": None,
        "title": f"{spec.queue} results",
        "description": "Not a queue: the task's record in Redis, one per (queue, task id), "
        "read with App.result(task_id) or 'weclaw-mq status TASK_ID'.",
        "servers": [_ref("servers", "redis")],
        "messages": {"result": _ref("components", "messages", message)},
    }
    return k


def _add_dead_letters(spec: HandlerSpec, d: _Parts) -> None:
    dlq = dlq_name(spec.queue)
    k = d.claim(d.channels, key(dlq))
    message = d.claim(d.messages, f"{key(spec.queue)}.deadLetter")
    d.messages[message] = {
        "name": "deadLetter",
        "title": f"A dead letter of {spec.queue}",
        "contentType": CONTENT_TYPE,
        "headers": _ref("components", "schemas", DEAD_LETTER_HEADERS),
        # The body is moved as it came: one that failed the model is here too.
        "payload": {
            "description": "The task's body byte for byte: the task's payload, or (reason "
            "undecodable or invalid_payload) a body that fails it.",
            "anyOf": [d.types[(spec.queue, "payload")], {}],
        },
    }
    d.channels[k] = {
        "address": dlq,
        "title": dlq,
        "description": f"Where tasks of {spec.queue} end when they cannot succeed; nothing "
        "expires here. Inspect and requeue with 'weclaw-mq dlq'.",
        "servers": d.brokers,
        "messages": {"deadLetter": _ref("components", "messages", message)},
        "bindings": _amqp_queue(dlq, d.vhost),
    }
    d.operations[d.claim(d.operations, f"{key(spec.queue)}.deadLetter")] = {
        "action": "send",
        "title": f"Dead-letter a task of {spec.queue}",
        "channel": _ref("channels", k),
        "messages": [_ref("channels", k, "messages", "deadLetter")],
    }


def _add_notifications(spec: HandlerSpec, target: str, d: _Parts) -> None:
    """The ``notify=`` queue: its own channel, or the task channel of the handler on it."""
    operation = d.claim(d.operations, f"{key(spec.queue)}.notify")
    description = (
        "notify=: each task's final state, published with a confirm before the task is acked "
        "or dead-lettered. The message id is the notification id."
    )
    if target in d.task_channels:  # a handler of this app consumes them: its task message
        k = d.task_channels[target]
        d.operations[operation] = {
            "action": "send",
            "description": description,
            "channel": _ref("channels", k),
            "messages": [_ref("channels", k, "messages", "task")],
        }
        return
    k = d.claim(d.channels, key(target))
    message = d.claim(d.messages, f"{key(spec.queue)}.notification")
    d.messages[message] = {
        "name": "notification",
        "title": f"The final state of a task of {spec.queue}",
        "contentType": CONTENT_TYPE,
        "payload": _with_result(d.types[("", "TaskNotification")], d.types[(spec.queue, "result")]),
    }
    d.channels[k] = {
        "address": target,
        "title": target,
        "description": description,
        "servers": d.brokers,
        "messages": {"notification": _ref("components", "messages", message)},
        "bindings": _amqp_queue(target, d.vhost),
    }
    d.operations[operation] = {
        "action": "send",
        "channel": _ref("channels", k),
        "messages": [_ref("channels", k, "messages", "notification")],
    }


def _add_stream(spec: HandlerSpec, d: _Parts) -> None:
    k = d.claim(d.channels, f"{key(spec.queue)}.stream")
    message = d.claim(d.messages, f"{key(spec.queue)}.stream")
    d.messages[message] = {
        "name": "streamEvent",
        "title": f"An event of a task of {spec.queue}",
        "summary": "kind attempt (a run starts: drop the partial text of an earlier one), "
        "chunk (data: what the handler emitted, str or any JSON) or final.",
        "contentType": CONTENT_TYPE,
        "payload": d.types[("", "StreamEvent")],
    }
    d.channels[k] = {
        "address": None,
        "title": f"{spec.queue} streams",
        "description": "Not a queue: the task's Redis Stream, whose events App.stream(task_id) "
        "yields. Written only when the handler calls ctx.emit (it takes a context, so it may).",
        "servers": [_ref("servers", "redis")],
        "messages": {"streamEvent": _ref("components", "messages", message)},
    }
    d.operations[d.claim(d.operations, f"{key(spec.queue)}.emit")] = {
        "action": "send",
        "channel": _ref("channels", k),
        "messages": [_ref("channels", k, "messages", "streamEvent")],
    }

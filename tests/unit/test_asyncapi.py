"""``weclaw-mq asyncapi``: the AsyncAPI 3.0.0 document of an app, built without a broker.

The document is checked against the rules of AsyncAPI 3.0.0 that need no download (required
fields, where references may point, operation messages taken from their channel), every
``$ref`` is resolved inside it, and its schemas are run with ``jsonschema`` on real values:
what the app's handler gets and returns, what ``App.prepare`` and the worker put in headers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from tests.unit.asyncapi_app import Article, Summary, Tag, build_app
from weclaw_mq import App, Settings, TaskNotification, TaskStatus
from weclaw_mq import TaskState as Record
from weclaw_mq.admin import asyncapi_headers
from weclaw_mq.admin.asyncapi import build_document
from weclaw_mq.cli.exit_codes import ExitCode
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.message import Delivery
from weclaw_mq.errors import HandlerTimeout
from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.worker.settle import failure_headers

ROOT = Path(__file__).resolve().parents[2]
AMQP_SECRET = "amqp-s3cret"
REDIS_SECRET = "redis-s3cret"
AMQP_URL = f"amqp://alice:{AMQP_SECRET}@rabbit.example:5673/prod"
REDIS_URL = f"redis://:{REDIS_SECRET}@cache.example:6380/2"
DOC_URI = "urn:weclaw-mq:asyncapi-test"
# Keys of components (AsyncAPI 3.0.0, "Components Object").
COMPONENT_KEY = re.compile(r"^[a-zA-Z0-9.\-_]+$")
CLI_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    settings = Settings(_env_file=None, amqp_url=AMQP_URL, redis_url=REDIS_URL)
    document = build_document(build_app(settings), version="2.1.0")
    # What the command prints: the document must survive JSON as it is.
    return dict(json.loads(json.dumps(document)))


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref} points outside the document"
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref}: no {part!r}"
        node = node[part]
    return node


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def validator(doc: dict[str, Any], pointer: str) -> jsonschema.Draft7Validator:
    """A validator of the schema at ``pointer``, its $refs resolved within ``doc``."""
    registry: Registry[Any] = Registry().with_resource(
        DOC_URI, Resource(contents=doc, specification=DRAFT7)
    )
    return jsonschema.Draft7Validator({"$ref": f"{DOC_URI}{pointer}"}, registry=registry)


def accepts(doc: dict[str, Any], pointer: str, value: Any) -> bool:
    return validator(doc, pointer).is_valid(value)


def test_the_document_has_every_field_asyncapi_3_requires(doc: dict[str, Any]) -> None:
    assert doc["asyncapi"] == "3.0.0"
    assert doc["info"] == {**doc["info"], "title": "asyncapi-test", "version": "2.1.0"}
    assert doc["defaultContentType"] == "application/json"
    for server in doc["servers"].values():
        assert isinstance(server["host"], str) and isinstance(server["protocol"], str)
    for name, channel in doc["channels"].items():
        assert channel["address"] is None or isinstance(channel["address"], str), name
        for message in channel["messages"].values():
            assert message["$ref"].startswith("#/components/messages/"), name
        for server in channel.get("servers", []):
            assert server["$ref"].startswith("#/servers/"), name
    for section in ("schemas", "messages"):
        for name in doc["components"][section]:
            assert COMPONENT_KEY.match(name), f"components.{section}: {name!r}"
    for message in doc["components"]["messages"].values():
        assert "payload" in message


def test_each_operation_takes_its_messages_from_its_own_channel(doc: dict[str, Any]) -> None:
    for name, op in doc["operations"].items():
        assert op["action"] in ("send", "receive"), name
        channel = op["channel"]["$ref"]
        for message in op["messages"]:
            assert message["$ref"].startswith(f"{channel}/messages/"), name
        if "reply" in op:
            reply = op["reply"]["channel"]["$ref"]
            for message in op["reply"]["messages"]:
                assert message["$ref"].startswith(f"{reply}/messages/"), name


def test_every_reference_resolves_within_the_document(doc: dict[str, Any]) -> None:
    found = list(refs(doc))
    assert len(found) > 20
    for ref in found:
        resolve(doc, ref)


def test_every_schema_is_a_valid_draft_07_schema(doc: dict[str, Any]) -> None:
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft7Validator.check_schema(schema)
    for message in doc["components"]["messages"].values():
        jsonschema.Draft7Validator.check_schema(message["payload"])


def test_each_handler_queue_has_its_channels_and_operations(doc: dict[str, Any]) -> None:
    assert set(doc["channels"]) == {
        "summaries",
        "summaries.result",
        "summaries.dlq",
        "summaries.results",
        "summaries.stream",
        "scores_v2",
        "scores_v2.result",
        "scores_v2.dlq",
    }
    # A queue name keeps its own spelling as the address; only the key is tamed.
    assert doc["channels"]["scores_v2"]["address"] == "scores:v2"
    assert doc["channels"]["scores_v2.dlq"]["address"] == "scores:v2.dlq"
    assert doc["channels"]["summaries.result"]["address"] is None  # Redis: no fixed address
    assert {name: op["action"] for name, op in doc["operations"].items()} == {
        "summaries.send": "send",
        "summaries.receive": "receive",
        "summaries.deadLetter": "send",
        "summaries.notify": "send",
        "summaries.emit": "send",
        "scores_v2.send": "send",
        "scores_v2.receive": "receive",
        "scores_v2.deadLetter": "send",
    }
    handler = doc["operations"]["summaries.receive"]["x-weclaw-handler"]
    assert handler["retry"]["max_retries"] == 2
    assert doc["operations"]["scores_v2.receive"]["x-weclaw-handler"]["timeout_s"] == 30


def test_the_model_payload_accepts_a_real_task_and_refuses_a_bad_one(doc: dict[str, Any]) -> None:
    payload = "#/components/messages/summaries.task/payload"
    good = Article(title="t", words=3, tags=[Tag(name="x")]).model_dump(mode="json")
    assert accepts(doc, payload, good)
    assert accepts(doc, payload, {"title": "t", "words": 1})  # tags has a default
    assert not accepts(doc, payload, {"title": "t", "words": 0})  # ge=1
    assert not accepts(doc, payload, {"title": "t", "words": 2, "tags": [{"name": ""}]})
    assert not accepts(doc, payload, {"words": 2})


def test_the_plain_typed_payload_accepts_a_list_of_ints_only(doc: dict[str, Any]) -> None:
    payload = "#/components/messages/scores_v2.task/payload"
    assert accepts(doc, payload, [1, 2, 3])
    assert not accepts(doc, payload, ["one"])
    assert not accepts(doc, payload, {"task": [1]})


def test_the_reply_is_the_task_record_whose_result_is_the_return_model(
    doc: dict[str, Any],
) -> None:
    payload = "#/components/messages/summaries.result/payload"
    done = Record(
        task_id="t-1",
        queue="summaries",
        status=TaskStatus.SUCCEEDED,
        attempt=1,
        result=Summary(text="s", tokens=2).model_dump(mode="json"),
    ).model_dump(mode="json")
    assert accepts(doc, payload, done)
    queued = Record(task_id="t-1", queue="summaries", status=TaskStatus.QUEUED)
    assert accepts(doc, payload, queued.model_dump(mode="json"))
    assert not accepts(doc, payload, {**done, "result": {"text": "s"}})  # tokens missing
    assert not accepts(doc, payload, {**done, "status": "pondering"})
    score = "#/components/messages/scores_v2.result/payload"
    assert accepts(doc, score, {**done, "queue": "scores:v2", "result": 1.5})
    assert not accepts(doc, score, {**done, "queue": "scores:v2", "result": "high"})


def test_the_notification_carries_the_same_result_schema(doc: dict[str, Any]) -> None:
    payload = "#/components/messages/summaries.notification/payload"
    note = {
        "task_id": "t-1",
        "queue": "summaries",
        "status": "succeeded",
        "attempt": 1,
        "trace_id": "tr",
        "result": {"text": "s", "tokens": 2},
    }
    assert accepts(doc, payload, note)
    assert not accepts(doc, payload, {**note, "result": {"tokens": "two"}})
    assert doc["channels"]["summaries.results"]["address"] == "summaries.results"


def test_task_headers_accept_what_publish_writes(doc: dict[str, Any]) -> None:
    app = build_app(Settings(_env_file=None, amqp_url=AMQP_URL, redis_url=REDIS_URL))
    message = app.prepare(
        "summaries", Article(title="t", words=1), session_id="user-7", delay_s=5, ttl_s=60
    )
    schema = "#/components/schemas/weclaw_mq.TaskHeaders"
    headers = dict(message.headers)
    assert {h.TRACE_ID, h.ATTEMPT, h.TTL_MS, h.EXPIRES_AT, h.NOT_BEFORE, h.SESSION_ID} <= set(
        headers
    )
    assert accepts(doc, schema, headers)
    assert not accepts(doc, schema, {**headers, h.ATTEMPT: 0})
    assert not accepts(doc, schema, {**headers, h.PRIORITY: "asap"})
    assert not accepts(doc, schema, {**headers, h.SESSION_ID: "has spaces"})
    assert not accepts(doc, schema, {**headers, h.TRACEPARENT: "not-a-traceparent"})


def test_dead_letter_headers_accept_what_the_worker_writes(doc: dict[str, Any]) -> None:
    delivery = Delivery("t-1", "trace-1", None, 3, 0, {}, b"{}", False, None, "summaries")
    headers = failure_headers(delivery, "summaries", HandlerTimeout("ran past 120 s"))
    headers[h.DEAD_LETTER_REASON] = DeadLetterReason.RETRIES_EXHAUSTED.value
    schema = "#/components/schemas/weclaw_mq.DeadLetterHeaders"
    assert accepts(doc, schema, headers)
    assert not accepts(doc, schema, {**headers, h.DEAD_LETTER_REASON: "bored"})
    props = doc["components"]["schemas"]["weclaw_mq.DeadLetterHeaders"]["properties"]
    assert props[h.DEAD_LETTER_REASON]["enum"] == [r.value for r in DeadLetterReason]
    assert "weclaw_mq.HandlerTimeout" in props[h.ERROR_TYPE]["examples"]
    assert props[h.ERROR_TYPE]["readOnly"] is True
    assert "readOnly" not in props[h.TRACE_ID]  # a producer may set it


def test_every_header_weclaw_mq_defines_is_documented_or_deliberately_left_out(
    doc: dict[str, Any],
) -> None:
    defined = {
        value
        for name, value in vars(h).items()
        if name.isupper() and isinstance(value, str) and value.startswith(("x-", "traceparent"))
    }
    defined.discard(h.PREFIX)
    documented = set(doc["components"]["schemas"]["weclaw_mq.DeadLetterHeaders"]["properties"])
    assert defined - documented == asyncapi_headers.NOT_DOCUMENTED
    assert documented <= defined


def test_the_document_names_the_servers_without_their_passwords(doc: dict[str, Any]) -> None:
    text = json.dumps(doc)
    assert AMQP_SECRET not in text and REDIS_SECRET not in text
    rabbit, redis = doc["servers"]["rabbitmq"], doc["servers"]["redis"]
    assert rabbit["host"] == "rabbit.example:5673"
    assert rabbit["pathname"] == "/prod"
    assert "vhost 'prod'" in rabbit["description"]
    assert "amqp://alice:***@rabbit.example:5673/prod" in rabbit["description"]
    assert redis["host"] == "cache.example:6380"
    assert "redis://:***@cache.example:6380/2" in redis["description"]


def test_failover_urls_are_one_server_each() -> None:
    urls = f"{AMQP_URL},amqps://bob:{AMQP_SECRET}@rabbit-2.example:5671/"
    document = build_document(build_app(Settings(_env_file=None, amqp_url=urls)))
    assert [s["host"] for s in document["servers"].values()][:2] == [
        "rabbit.example:5673",
        "rabbit-2.example:5671",
    ]
    assert document["servers"]["rabbitmq-2"]["protocol"] == "amqps"
    assert AMQP_SECRET not in json.dumps(document)


def test_with_results_off_the_worker_operation_has_no_reply() -> None:
    settings = Settings(_env_file=None, results_enabled=False)
    document = build_document(build_app(settings, notify=False))
    assert "reply" not in document["operations"]["summaries.receive"]
    assert "summaries.result" not in document["channels"]


class TaskState(BaseModel):  # a user's model of the same name as weclaw_mq's record
    note: str


class Opaque:  # pydantic has no JSON Schema for it
    pass


def odd_app() -> App:
    """Names that meet in a key, a notify= queue that is a handler of the app, a model named
    like ours, a return type without a JSON Schema, and a handler with priorities."""
    app = App("odd", settings=Settings(_env_file=None))

    @app.handler("a:b", notify="notes", priorities=True)
    async def colon(task: TaskState) -> Opaque:
        return Opaque()

    @app.handler("a_b")
    async def underscore(task: int) -> None:
        return None

    @app.handler("a_b.result")  # a queue named like a_b's result channel
    async def dotted(task: str) -> str:
        return task

    @app.handler("notes")
    async def notes(task: TaskNotification) -> None:
        return None

    return app


def test_names_that_meet_in_a_key_each_keep_their_channel() -> None:
    document = json.loads(json.dumps(build_document(odd_app())))
    addresses = [c["address"] for c in document["channels"].values()]
    for queue in ("a:b", "a_b", "a_b.result", "notes", "a:b.dlq", "a_b.dlq"):
        assert addresses.count(queue) == 1, queue
    for ref in refs(document):
        resolve(document, ref)
    # a:b's notifications go to the task channel of the handler on "notes".
    notify = document["operations"]["a_b.notify"]
    assert resolve(document, notify["channel"]["$ref"])["address"] == "notes"
    assert "lane.high" in document["channels"]["a_b"]["description"]
    assert "lane.high" not in resolve(document, "#/channels/a_b-2")["description"]


def test_a_model_named_like_ours_and_a_type_without_schema_are_both_described() -> None:
    document = json.loads(json.dumps(build_document(odd_app())))
    schemas = document["components"]["schemas"]
    assert len([name for name in schemas if "TaskState" in name]) == 2  # named apart
    task = "#/components/messages/a_b.task/payload"
    assert accepts(document, task, {"note": "n"})
    assert not accepts(document, task, {"status": "queued"})
    result = resolve(document, "#/components/messages/a_b.result/payload")
    record = resolve(document, result["allOf"][0]["$ref"])
    assert "status" in record["properties"]  # weclaw_mq's record, not the user's model
    opaque = result["allOf"][1]["properties"]["result"]["anyOf"][0]
    assert "no JSON Schema" in opaque["description"]


# -- the command ---------------------------------------------------------------------------


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``weclaw-mq`` of this tree (not an installed copy) in a child process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WECLAW_MQ_")}
    return subprocess.run(
        [sys.executable, "-m", "weclaw_mq.cli", *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


def test_the_command_writes_the_document_without_a_broker_or_redis(tmp_path: Path) -> None:
    # Port 9 (discard) on loopback: nothing answers there, and nothing is asked.
    env = {
        "WECLAW_MQ_AMQP_URL": f"amqp://alice:{AMQP_SECRET}@127.0.0.1:9/",
        "WECLAW_MQ_REDIS_URL": f"redis://:{REDIS_SECRET}@127.0.0.1:9/0",
    }
    out = tmp_path / "asyncapi.json"
    run = run_cli("asyncapi", "tests.unit.asyncapi_app:app", "--output", str(out), env=env)
    assert run.returncode == ExitCode.OK, run.stderr
    assert AMQP_SECRET not in run.stderr + run.stdout
    text = out.read_text(encoding="utf-8")
    assert AMQP_SECRET not in text and REDIS_SECRET not in text
    document = json.loads(text)
    assert document["asyncapi"] == "3.0.0"
    assert document["servers"]["rabbitmq"]["host"] == "127.0.0.1:9"
    printed = run_cli("asyncapi", "tests.unit.asyncapi_app:app", env=env)
    assert printed.returncode == ExitCode.OK, printed.stderr
    assert json.loads(printed.stdout) == document


@pytest.mark.parametrize(
    ("args", "code", "complaint"),
    [
        (["nomodule"], ExitCode.CONFIG, "expected MODULE:APP"),
        (["no_such_module_for_weclaw_tests:app"], ExitCode.CONFIG, "cannot import"),
        (["tests.unit.asyncapi_app:Article"], ExitCode.CONFIG, "not a weclaw_mq.App"),
        (["tests.unit.asyncapi_app:app", "--format", "yaml"], ExitCode.USAGE, "--format"),
        (["tests.unit.asyncapi_app:app", "--api-version", ""], ExitCode.USAGE, "--api-version"),
        (["tests.unit.asyncapi_app:app", "-o", "/"], ExitCode.USAGE, "--output"),
    ],
    ids=["no-colon", "no-module", "not-an-app", "no-yaml", "empty-version", "output-dir"],
)
def test_a_bad_argument_ends_in_one_line_and_its_exit_code(
    args: list[str], code: ExitCode, complaint: str
) -> None:
    run = run_cli("asyncapi", *args)
    assert run.returncode == code, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("weclaw-mq: error: "), run.stderr
    assert complaint in lines[0]
    assert run.stdout == ""


# -- the documentation's excerpt -----------------------------------------------------------

EXCERPT = ROOT / "docs" / "examples" / "asyncapi_excerpt.json"
TUTORIAL_APP = "docs.examples.first_handler:app"


def excerpt(document: dict[str, Any]) -> dict[str, Any]:
    """What docs/reference/asyncapi.md shows of the tutorial app's document, paths kept."""
    q = "ai-replies"
    return {
        "channels": {q: document["channels"][q]},
        "operations": {f"{q}.receive": document["operations"][f"{q}.receive"]},
        "components": {
            "messages": {f"{q}.task": document["components"]["messages"][f"{q}.task"]},
            "schemas": {"Prompt": document["components"]["schemas"]["Prompt"]},
        },
    }


def test_the_docs_excerpt_is_what_the_command_prints_for_the_tutorial_app(tmp_path: Path) -> None:
    # Default settings: no WECLAW_MQ_* variables, and no .env file where it runs.
    run = run_cli("asyncapi", TUTORIAL_APP, cwd=tmp_path)
    assert run.returncode == ExitCode.OK, run.stderr
    text = json.dumps(excerpt(json.loads(run.stdout)), indent=2, ensure_ascii=False) + "\n"
    if not EXCERPT.exists() or EXCERPT.read_text(encoding="utf-8") != text:
        EXCERPT.write_text(text, encoding="utf-8")
        pytest.fail(f"{EXCERPT.relative_to(ROOT)} was out of date and is rewritten: commit it")

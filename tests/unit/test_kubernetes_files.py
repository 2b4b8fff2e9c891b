"""The Kubernetes example in ops/kubernetes/ works as written: every document is valid YAML
with the fields its kind requires, the KEDA ScaledObject scales the worker Deployment on the
queue that worker consumes, through a TriggerAuthentication that reads a Secret (no password
in the files), the worker's command is a ``weclaw-mq worker`` invocation the CLI accepts for
an App that loads, and the pod's grace outlasts the worker's stop bound."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import typer
import yaml

from weclaw_mq import App
from weclaw_mq.cli.loading import load_app
from weclaw_mq.cli.root import cli
from weclaw_mq.cli.run_worker import HARD_EXIT_MARGIN_S
from weclaw_mq.settings import Settings

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "ops" / "kubernetes"
KEDA_API = "keda.sh/v1alpha1"
# A URL that carries a password: scheme://user:password@host
CREDENTIALS_IN_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@", re.IGNORECASE)


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    files = sorted(KUBERNETES.glob("*.yaml"))
    assert files, f"no YAML files in {KUBERNETES}"
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:  # an empty document (a trailing '---')
                continue
            assert isinstance(doc, dict), f"{path.name}: a document that is not a mapping"
            for field in ("apiVersion", "kind", "metadata"):
                assert field in doc, f"{path.name}: a document without {field}"
            assert doc["metadata"].get("name"), f"{path.name}: a {doc['kind']} without a name"
            docs.append(doc)
    return docs


def of_kind(kind: str) -> list[dict[str, Any]]:
    found = [d for d in documents() if d["kind"] == kind]
    assert found, f"ops/kubernetes/ has no {kind}"
    return found


def the_deployment() -> dict[str, Any]:
    deployments = of_kind("Deployment")
    assert len(deployments) == 1
    return deployments[0]


def worker_container() -> dict[str, Any]:
    deployment = the_deployment()
    assert deployment["apiVersion"] == "apps/v1"
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def worker_argv() -> list[str]:
    container = worker_container()
    argv = [*container.get("command", []), *container.get("args", [])]
    assert all(isinstance(a, str) for a in argv), argv
    return argv


def worker_app_path() -> str:
    """The MODULE:APP of the worker command, as the CLI itself parses the command line."""
    program, *args = worker_argv()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert program in scripts, f"{program!r} is not a console script of this project"
    group = typer.main.get_command(cli)
    # Parsing only (no callback runs): unknown options, bad values and a missing argument
    # raise here as they would for 'weclaw-mq' itself.
    root = group.make_context(program, list(args))
    name, command, rest = group.resolve_command(root, list(args))  # type: ignore[attr-defined]
    assert name == "worker" and command is not None, args
    ctx = command.make_context(name, rest, parent=root)
    app_path = ctx.params["app_path"]
    assert isinstance(app_path, str)
    assert ctx.params["processes"] == 1, "one process per pod: Kubernetes scales pods"
    return app_path


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_document_is_valid_yaml_with_a_kind_and_a_name() -> None:
    kinds = sorted(d["kind"] for d in documents())

    assert kinds == ["Deployment", "ScaledObject", "TriggerAuthentication"]


def test_the_scaled_object_scales_the_worker_deployment_on_its_queue_length() -> None:
    (scaled,) = of_kind("ScaledObject")
    spec = scaled["spec"]
    handlers = load_app(worker_app_path()).handlers
    auth_names = {a["metadata"]["name"] for a in of_kind("TriggerAuthentication")}

    assert scaled["apiVersion"] == KEDA_API
    assert spec["scaleTargetRef"]["name"] == the_deployment()["metadata"]["name"]
    assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    assert 0 <= spec.get("minReplicaCount", 0) <= spec["maxReplicaCount"]
    assert spec["triggers"]
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "rabbitmq"
        assert meta["queueName"] in handlers, f"the worker consumes no {meta['queueName']!r}"
        assert meta["mode"] in ("QueueLength", "MessageRate")
        # KEDA reads trigger metadata as strings: a YAML number here is refused.
        assert isinstance(meta["value"], str) and float(meta["value"]) > 0
        assert meta.get("protocol", "auto") in ("amqp", "http", "auto")
        assert "host" not in meta and "hostFromEnv" not in meta, "the broker URL is a secret"
        assert trigger["authenticationRef"]["name"] in auth_names


def test_the_trigger_authentication_takes_the_broker_url_from_the_workers_secret() -> None:
    (auth,) = of_kind("TriggerAuthentication")
    secrets_of_worker = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in env_of(worker_container()).values()
        if "secretKeyRef" in e.get("valueFrom", {})
    }

    assert auth["apiVersion"] == KEDA_API
    refs = auth["spec"]["secretTargetRef"]
    assert [r["parameter"] for r in refs] == ["host"]
    for ref in refs:
        assert ref["name"] in secrets_of_worker and ref["key"]


def test_no_password_is_written_in_the_files() -> None:
    text = "\n".join(p.read_text() for p in sorted(KUBERNETES.glob("*.yaml")))
    docs = documents()
    env = env_of(worker_container())

    assert not [d for d in docs if d["kind"] == "Secret"], "a Secret belongs to kubectl, not git"
    # Comments may show the form of a URL, with PASSWORD for the password, never a real one.
    for url in CREDENTIALS_IN_URL.findall(text):
        assert url.endswith(":PASSWORD@"), url
    for name in ("WECLAW_MQ_AMQP_URL", "WECLAW_MQ_REDIS_URL"):
        assert "value" not in env[name] and "secretKeyRef" in env[name]["valueFrom"], name


def test_the_worker_command_is_a_real_cli_invocation_of_an_app_that_loads() -> None:
    app_path = worker_app_path()
    module = app_path.partition(":")[0]

    assert (REPO / Path(*module.split("."))).with_suffix(".py").is_file(), module
    assert isinstance(load_app(app_path), App)


def test_the_pod_outlasts_the_workers_stop_bound() -> None:
    spec = the_deployment()["spec"]["template"]["spec"]
    grace = env_of(worker_container()).get("WECLAW_MQ_SHUTDOWN_GRACE_S")
    grace_s = float(grace["value"]) if grace is not None else Settings().shutdown_grace_s

    # docs/design/guarantees.md, "Stopping has a hard bound": the worker exits within its grace
    # + the margin.
    assert spec["terminationGracePeriodSeconds"] > grace_s + HARD_EXIT_MARGIN_S
    # No replicas in the Deployment: KEDA's autoscaler owns the count.
    assert "replicas" not in the_deployment()["spec"]


def test_the_deploying_page_says_what_the_files_hold() -> None:
    section = (REPO / "docs" / "how-to" / "deploy.md").read_text()
    (scaled,) = of_kind("ScaledObject")
    spec = scaled["spec"]
    pod = the_deployment()["spec"]["template"]["spec"]
    grace = env_of(worker_container())["WECLAW_MQ_SHUTDOWN_GRACE_S"]["value"]

    assert f"`{' '.join(worker_argv())}`" in section
    assert f"between {spec['minReplicaCount']} and {spec['maxReplicaCount']} pods" in section
    assert f'`value: "{spec["triggers"][0]["metadata"]["value"]}"`' in section
    assert f"`terminationGracePeriodSeconds` ({pod['terminationGracePeriodSeconds']})" in section
    assert f"`WECLAW_MQ_SHUTDOWN_GRACE_S` ({grace}) + {HARD_EXIT_MARGIN_S:g} s" in section

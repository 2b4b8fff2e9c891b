"""The files in ops/ work as written: the alert rules load and fire on what they describe, the
dashboard is valid, both name only metrics that exist, and the systemd unit stops cleanly.

The alert rules are checked by promtool (Debian/Ubuntu: 'apt-get install prometheus'), the
only tool that really parses PromQL. Without it these tests fail rather than skip: a rule file
nobody can load would otherwise pass CI.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.policy.breaker import CircuitState
from weclaw_mq.settings import Settings

OPS = Path(__file__).resolve().parents[2] / "ops"
ALERTS = OPS / "prometheus" / "alerts.yml"
DASHBOARD = OPS / "grafana" / "weclaw-mq.json"
RUNBOOK = OPS / "RUNBOOK.md"
UNIT = OPS / "weclaw-mq-worker.service"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed, so ops/prometheus/alerts.yml cannot be checked; "
            "install it with 'apt-get install prometheus' (Debian/Ubuntu)",
            pytrace=False,
        )
    return path


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def alert_blocks() -> dict[str, str]:
    """Each alert's name and its text up to the next rule (the file keeps one layout)."""
    text = ALERTS.read_text()
    parts = re.split(r"^\s*- alert: ", text, flags=re.MULTILINE)[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def without_annotations(rules: str) -> str:
    """The rules with every ``annotations:`` block cut out, for promtool's rule tests, which
    compare annotations verbatim; here only when and with which labels an alert fires count."""
    out: list[str] = []
    cut_below: int | None = None
    for line in rules.splitlines():
        indent = len(line) - len(line.lstrip())
        if cut_below is not None and (not line.strip() or indent > cut_below):
            continue
        cut_below = None
        if line.strip() == "annotations:":
            cut_below = indent
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def weclaw_metric_names() -> set[str]:
    metrics = Metrics()
    # Labelled collectors expose samples only once a child exists.
    metrics.published.labels("q", "confirmed").inc()
    metrics.messages.labels("q", "acked").inc()
    metrics.handler_seconds.labels("q").observe(1.0)
    metrics.in_flight.labels("q").set(0)
    metrics.reconnects.labels("worker").inc()
    metrics.circuit_state("q", CircuitState.CLOSED)
    metrics.circuit_opened("q").inc()
    return {s.name for m in metrics.registry.collect() for s in m.samples}


def test_alert_rules_pass_promtool_check() -> None:
    result = run(promtool(), "check", "rules", str(ALERTS))

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_blocks())} rules found" in result.stdout


def test_every_alert_has_severity_summary_description_and_a_runbook_section() -> None:
    headings = set(re.findall(r"^### (\w+)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE))
    blocks = alert_blocks()

    assert len(blocks) >= 10
    for name, block in blocks.items():
        assert re.search(r"severity: (critical|warning|info)\b", block), name
        assert "summary:" in block and "description:" in block, name
        assert f'runbook_url: "ops/RUNBOOK.md#{name.lower()}"' in block, name
        assert name in headings, f"ops/RUNBOOK.md has no '### {name}' section"


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{label_text}}}", "values": values}


def _fires(at: str, alert: str, *expected: dict[str, str]) -> dict[str, Any]:
    return {
        "eval_time": at,
        "alertname": alert,
        "exp_alerts": [{"exp_labels": labels} for labels in expected],
    }


READY = "rabbitmq_queue_messages_ready"
CONSUMERS = "rabbitmq_queue_consumers"
SETTLED = "weclaw_mq_messages_total"
OUTBOX_AGE = "weclaw_mq_outbox_oldest_age_seconds"
BREAKER = "weclaw_mq_breaker_state"

# (alert, input series, [(time, labels of every alert firing then)]): each alert both quiet
# and firing, and each time beside a look-alike that must stay quiet.
RULE_CASES: list[tuple[str, list[dict[str, str]], list[tuple[str, list[dict[str, str]]]]]] = [
    (
        "WeclawMQQueueBacklog",
        [
            _series(READY, "1500x10", queue="jobs", vhost="/"),
            _series(READY, "5000x10", queue="jobs.dlq", vhost="/"),
            _series(READY, "5000x10", queue="jobs.retry.5s", vhost="/"),
            _series(READY, "900x10", queue="small", vhost="/"),
        ],
        [
            ("4m", []),
            ("6m", [{"severity": "warning", "queue": "jobs", "vhost": "/"}]),
        ],
    ),
    (
        "WeclawMQQueueWithoutConsumers",
        [
            _series(READY, "5x10", queue="jobs", vhost="/"),
            _series(CONSUMERS, "0x10", queue="jobs", vhost="/"),
            _series(READY, "5x10", queue="served", vhost="/"),
            _series(CONSUMERS, "2x10", queue="served", vhost="/"),
            _series(READY, "5x10", queue="jobs.retry.5s", vhost="/"),
            _series(CONSUMERS, "0x10", queue="jobs.retry.5s", vhost="/"),
        ],
        [("6m", [{"severity": "critical", "queue": "jobs", "vhost": "/"}])],
    ),
    (
        "WeclawMQDeadLetterQueueGrowing",
        [
            _series(READY, "0 0 1 2 3 3 3 3 3 3 3 3", queue="jobs.dlq", vhost="/"),
            _series(READY, "7x11", queue="old.dlq", vhost="/"),
        ],
        [
            ("2m", []),
            ("9m", [{"severity": "warning", "queue": "jobs.dlq", "vhost": "/"}]),
        ],
    ),
    (
        "WeclawMQDeadLetterRatioHigh",
        [
            _series(SETTLED, "0+90x30", queue="jobs", outcome="acked"),
            _series(SETTLED, "0+10x30", queue="jobs", outcome="dead_lettered"),
            _series(SETTLED, "0+100x30", queue="fine", outcome="acked"),
            _series(SETTLED, "0+1x30", queue="fine", outcome="dead_lettered"),
        ],
        [
            ("5m", []),
            ("25m", [{"severity": "warning", "queue": "jobs"}]),
        ],
    ),
    (
        "WeclawMQHandlersStuck",
        [
            _series("weclaw_mq_in_flight", "2x40", queue="jobs", instance="w1"),
            _series(SETTLED, "5x40", queue="jobs", outcome="acked"),
            _series("weclaw_mq_in_flight", "1x40", queue="busy", instance="w1"),
            _series(SETTLED, "0+10x40", queue="busy", outcome="acked"),
        ],
        [("35m", [{"severity": "critical", "queue": "jobs"}])],
    ),
    (
        "WeclawMQCircuitOpen",
        [
            # Down: open and half_open take turns (a failed probe per cool-down).
            _series(BREAKER, "1 0 1 0 1 0 1 0 1 0 1 0 1 0 1", queue="jobs", state="open"),
            _series(BREAKER, "0 1 0 1 0 1 0 1 0 1 0 1 0 1 0", queue="jobs", state="half_open"),
            # A short outage: open for 3 minutes, closed again.
            _series(BREAKER, "1 1 1 0 0 0 0 0 0 0 0 0 0 0 0", queue="blip", state="open"),
            _series(BREAKER, "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1", queue="blip", state="closed"),
        ],
        [
            ("5m", []),
            ("12m", [{"severity": "warning", "queue": "jobs"}]),
        ],
    ),
    (
        "WeclawMQOutboxNotDraining",
        [
            _series(OUTBOX_AGE, "0+60x20", instance="p1"),
            _series(OUTBOX_AGE, "0x20", instance="p2"),
            _series(OUTBOX_AGE, "0 120 240 0 120 240 0 120 240 0 120 240", instance="p3"),
        ],
        [
            ("5m", []),
            ("9m", [{"severity": "warning", "instance": "p1"}]),
        ],
    ),
    (
        "WeclawMQTasksDeferred",
        [
            # Redis down: everything parked, nothing ends.
            _series("weclaw_mq_messages_total", "0+10x20", queue="stuck", outcome="deferred"),
            # A busy per-key limit: parked and finished side by side.
            _series("weclaw_mq_messages_total", "0+10x20", queue="limited", outcome="deferred"),
            _series("weclaw_mq_messages_total", "0+30x20", queue="limited", outcome="acked"),
        ],
        [
            ("5m", []),
            ("17m", [{"severity": "warning", "queue": "stuck"}]),
        ],
    ),
    (
        "WeclawMQPublishUnroutable",
        [
            _series("weclaw_mq_published_total", "0 0 0 1 1 1", queue="typo", outcome="unroutable"),
            _series("weclaw_mq_published_total", "0+5x5", queue="jobs", outcome="confirmed"),
        ],
        [
            ("2m", []),
            ("4m", [{"severity": "critical", "queue": "typo"}]),
        ],
    ),
]


@pytest.mark.parametrize(
    ("alert", "series", "checks"), RULE_CASES, ids=[case[0] for case in RULE_CASES]
)
def test_alert_fires_on_the_condition_it_describes_and_not_on_look_alikes(
    alert: str,
    series: list[dict[str, str]],
    checks: list[tuple[str, list[dict[str, str]]]],
    tmp_path: Path,
) -> None:
    tool = promtool()
    (tmp_path / "rules.yml").write_text(without_annotations(ALERTS.read_text()))
    spec = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [_fires(at, alert, *labels) for at, labels in checks],
            }
        ],
    }
    # JSON is YAML: no YAML library needed to write promtool's test file.
    (tmp_path / "test.yml").write_text(json.dumps(spec, indent=2))

    result = run(tool, "test", "rules", "test.yml", cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_is_valid_json_and_every_panel_queries_something() -> None:
    dashboard = json.loads(DASHBOARD.read_text())

    panels = dashboard["panels"]
    assert len(panels) >= 6
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["title"], panel
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"panel {panel['title']!r} has an empty query"
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("outcome", "p95", "in flight", "dead-letter", "reconnect"):
        assert topic in titles, topic


def test_alerts_and_dashboard_name_only_metrics_that_weclaw_mq_exports() -> None:
    exported = weclaw_metric_names()
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = set(re.findall(r"\bweclaw_mq_\w+", ALERTS.read_text() + "\n".join(exprs)))

    assert used, "no weclaw_mq metric used at all"
    assert used <= exported, (
        f"not exported by weclaw_mq.observability.metrics: {sorted(used - exported)}"
    )


def test_worker_unit_stops_with_sigterm_and_waits_longer_than_the_shutdown_grace() -> None:
    text = UNIT.read_text()
    # Single-valued keys only; Environment= may repeat and is read on its own.
    keys = dict(re.findall(r"^(\w+)=(.*)$", text, flags=re.MULTILINE))
    env = dict(re.findall(r"^Environment=(\w+)=(\S+)$", text, flags=re.MULTILINE))
    grace_s = float(env.get("WECLAW_MQ_SHUTDOWN_GRACE_S", Settings().shutdown_grace_s))

    assert keys["KillSignal"] == "SIGTERM"
    assert float(keys["TimeoutStopSec"]) > grace_s + 10  # time to ack and close, too
    assert "weclaw-mq worker" in keys["ExecStart"]

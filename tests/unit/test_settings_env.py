"""Settings are read from ``WECLAW_MQ_*`` variables and ``.env`` by weclaw_mq/config/environment.py
(not pydantic-settings, which cost an idle worker about 4 MiB): the same names in any case,
the same precedence, complex values as JSON, and a bad value a one-line error naming its
variable with the value (maybe a password) never shown."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest

from weclaw_mq import Settings
from weclaw_mq.cli.exit_codes import ExitCode, classify
from weclaw_mq.config.environment import EnvSettings, read_dotenv


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory whose .env is the test's, and no WECLAW_MQ_* variable set."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.upper().startswith("WECLAW_MQ_"):
            monkeypatch.delenv(name)
    return tmp_path


def test_a_variable_is_read_in_any_case(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WECLAW_MQ_CONCURRENCY", "7")
    monkeypatch.setenv("weclaw_mq_Results_Enabled", "false")
    settings = Settings()
    assert settings.concurrency == 7
    assert settings.results_enabled is False
    assert settings.metrics_port is None  # the default, nothing set


def test_arguments_win_over_the_environment_which_wins_over_dotenv(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (in_tmp / ".env").write_text(
        "# a comment\n"
        "export WECLAW_MQ_CONCURRENCY=3\n"
        "WECLAW_MQ_HEARTBEAT_S=4  # seconds\n"
        "WECLAW_MQ_REDIS_URL='redis://localhost:6380/2'\n"
        "OTHER_TOOL=ignored\n"
    )
    assert Settings().concurrency == 3
    assert Settings().heartbeat_s == 4
    assert Settings().redis_url_plain() == "redis://localhost:6380/2"
    monkeypatch.setenv("WECLAW_MQ_CONCURRENCY", "5")
    assert Settings().concurrency == 5
    assert Settings(concurrency=9).concurrency == 9
    # _env_file=None reads no file (what the tests and benchmarks pass)
    assert Settings(_env_file=None).heartbeat_s == 10


def test_dotenv_quotes_escapes_and_references(tmp_path: Path) -> None:
    path = tmp_path / "x.env"
    path.write_text(
        'A="two\\nlines # not a comment"\n'
        "B='${A} stays literal'\n"
        "C=${A}-${MISSING:-fallback}\n"
        'D="spans\n'
        'two lines"\n'
        "not a line at all\n"
    )
    values = read_dotenv(path)
    assert values["A"] == "two\nlines # not a comment"
    assert values["B"] == "${A} stays literal"
    assert values["C"] == "two\nlines # not a comment-fallback"
    assert values["D"] == "spans\ntwo lines"
    assert len(values) == 4


class _Complex(EnvSettings):
    env_prefix = "WECLAW_MQ_TEST_"
    env_file = None
    names: list[str] = pydantic.Field(default_factory=list)
    limits: dict[str, int] | None = None
    label: str = ""


def test_complex_fields_take_json(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WECLAW_MQ_TEST_NAMES", '["a", "b"]')
    monkeypatch.setenv("WECLAW_MQ_TEST_LIMITS", '{"x": 2}')
    monkeypatch.setenv("WECLAW_MQ_TEST_LABEL", '["kept as text"]')
    loaded = _Complex()
    assert loaded.names == ["a", "b"]
    assert loaded.limits == {"x": 2}
    assert loaded.label == '["kept as text"]'
    monkeypatch.setenv("WECLAW_MQ_TEST_NAMES", "not json")
    with pytest.raises(pydantic.ValidationError) as caught:
        _Complex()
    assert caught.value.errors()[0]["loc"] == ("names",)


def test_a_bad_value_names_its_variable_and_never_shows_the_value(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WECLAW_MQ_AMQP_URL", "amqp://app:s3cret-pw@broker:99999/")
    monkeypatch.setenv("WECLAW_MQ_CONCURRENCY", "many")
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings()
    assert caught.value.title == "Settings"
    code, message = classify(caught.value)
    assert code is ExitCode.CONFIG
    assert "WECLAW_MQ_AMQP_URL" in message and "WECLAW_MQ_CONCURRENCY" in message
    assert "s3cret-pw" not in message and "s3cret-pw" not in str(caught.value)
    assert "many" not in str(caught.value)


PASSWORD = "pa55-w0rd"


@pytest.mark.parametrize(
    ("field", "url"),
    [
        ("amqp_url", f"amqp://guest:{PASSWORD}@broker:0/"),
        ("amqp_url", f"amqps://guest:{PASSWORD}@broker:00/vhost"),
        ("amqp_url", f"amqp://guest:{PASSWORD}@a:5672/,amqp://guest:{PASSWORD}@b:0/"),
        ("redis_url", f"redis://:{PASSWORD}@h:0/1"),
        ("redis_url", f"rediss://:{PASSWORD}@h:0"),
    ],
)
def test_port_0_is_refused_not_read_as_the_default_port(field: str, url: str) -> None:
    # The clients take port 0 for "no port given": amqp://host:0/ connected to 5672.
    with pytest.raises(pydantic.ValidationError) as raised:
        Settings(**{field: url})
    assert "has port 0, outside 1-65535" in str(raised.value)
    assert PASSWORD not in str(raised.value)

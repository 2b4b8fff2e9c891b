"""The TLS settings (weclaw_mq/config/tls.py) are checked when settings load, in one line each:
a TLS setting beside a URL that does not ask for TLS, a key without its certificate, a file that is
not there; a file that is there but unusable is refused when its context is made. (The
handshakes themselves are tested against real servers in tests/drills/test_tls.py.)"""

from __future__ import annotations

import ssl
from pathlib import Path

import pydantic
import pytest

from weclaw_mq import Settings
from weclaw_mq.cli.exit_codes import ExitCode, classify
from weclaw_mq.config.tls import client_context, describe_refusal
from weclaw_mq.errors import ConfigurationError

TLS_AMQP = "amqps://app:pw@broker.example:5671/"
TLS_REDIS = "rediss://broker.example:6380/0"


def _refusal(**values: object) -> str:
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings(**values)  # type: ignore[arg-type]
    code, message = classify(caught.value)
    assert code is ExitCode.CONFIG
    assert "\n" not in message
    return message


def test_a_tls_setting_beside_a_plain_url_is_refused(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    message = _refusal(amqp_url="amqp://localhost/", amqp_tls_ca_file=str(ca))
    assert "WECLAW_MQ_AMQP_TLS_* is set but WECLAW_MQ_AMQP_URL is not a amqps:// URL" in message
    message = _refusal(redis_url="redis://localhost/0", redis_tls_verify_hostname=False)
    assert "WECLAW_MQ_REDIS_URL is not a rediss:// URL" in message


def test_a_key_without_a_certificate_and_a_missing_file_are_refused(tmp_path: Path) -> None:
    message = _refusal(amqp_url=TLS_AMQP, amqp_tls_key_file=str(tmp_path / "k.pem"))
    assert "WECLAW_MQ_AMQP_TLS_KEY_FILE is set without WECLAW_MQ_AMQP_TLS_CERT_FILE" in message
    missing = tmp_path / "nowhere.pem"
    message = _refusal(redis_url=TLS_REDIS, redis_tls_ca_file=str(missing))
    assert f"WECLAW_MQ_REDIS_TLS_CA_FILE={missing}: no such file" in message


def test_tls_urls_load_with_verification_on_by_default() -> None:
    settings = Settings(amqp_url=TLS_AMQP, redis_url=TLS_REDIS)
    assert settings.uses_tls("amqp") and settings.uses_tls("redis")
    assert settings.tls("amqp").verify_hostname and settings.tls("redis").verify_hostname
    context = client_context(settings.tls("amqp"))
    assert context.check_hostname and context.verify_mode is ssl.CERT_REQUIRED


def test_an_unusable_file_is_a_configuration_error_naming_its_setting(tmp_path: Path) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate")
    settings = Settings(redis_url=TLS_REDIS, redis_tls_ca_file=str(garbage))
    with pytest.raises(ConfigurationError, match="WECLAW_MQ_REDIS_TLS_CA_FILE="):
        client_context(settings.tls("redis"))
    settings = Settings(amqp_url=TLS_AMQP, amqp_tls_cert_file=str(garbage))
    with pytest.raises(ConfigurationError, match="WECLAW_MQ_AMQP_TLS_CERT_FILE="):
        client_context(settings.tls("amqp"))


def test_only_a_certificate_refusal_is_described_as_one() -> None:
    assert describe_refusal(ConnectionRefusedError(111, "refused"), "amqp") is None
    refused = ssl.SSLCertVerificationError(1, "certificate verify failed")
    refused.verify_message = "unable to get local issuer certificate"
    try:
        try:
            raise refused
        except ssl.SSLError as e:
            raise OSError("wrapped") from e  # how aiormq and redis-py re-raise it
    except OSError as outer:
        described = describe_refusal(outer, "redis")
    assert described is not None
    assert "Redis's certificate is not trusted" in described
    assert "WECLAW_MQ_REDIS_TLS_CA_FILE" in described

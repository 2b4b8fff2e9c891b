"""TLS for real: a RabbitMQ node of this module's own with a TLS listener (``amqps://``) and a
redis-server with only a ``tls-port`` (``rediss://``), both demanding a client certificate,
with certificates made here by the openssl CLI: a CA, a server certificate for ``localhost``
only, a client certificate, and a second CA that signed nothing of theirs.

The right CA and the client certificate connect, and a task goes the whole way (publish,
consume, the idempotency guard, the result); a wrong CA, or a host the certificate does not
name (127.0.0.1: the certificate names ``localhost`` only), is refused with one line naming
the cause, in the library's errors and in the CLI's. Turning hostname verification off is a
setting, and a warning in the log.

Nothing here touches the shared broker or Redis: both servers live in this run's folder, on
free ports, and are stopped by pid (tests/private_servers.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import BaseModel

from tests.drills.conftest import (
    NodeSpace,
    single_node,
)
from tests.private_servers import PrivateServers, TcpRedis, free_port, pings, wait_for
from weclaw_mq import App, Context, Settings, StateUnavailableError, TaskStatus
from weclaw_mq.errors import BrokerUnavailableError
from weclaw_mq.wire.connection import BrokerEndpoints

pytestmark = pytest.mark.drill

HOW_TO_GET_OPENSSL = "the TLS tests need the openssl CLI (Debian: apt-get install openssl)"


# -- certificates -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    folder: Path

    def __getitem__(self, name: str) -> str:
        return str(self.folder / name)


def _openssl(folder: Path, *args: str) -> None:
    try:
        done = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.fail(HOW_TO_GET_OPENSSL, pytrace=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")


def _new_ca(folder: Path, name: str) -> None:
    _openssl(
        folder, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN=weclaw-mq test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip


def _new_leaf(folder: Path, name: str, ca: str, extensions: list[str]) -> None:
    _openssl(
        folder, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=weclaw-mq test {name}",
    )  # fmt: skip
    (folder / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl(
        folder, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("tls")
    _new_ca(folder, "ca")
    _new_ca(folder, "wrong-ca")
    leaf = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment"]
    # localhost only, not 127.0.0.1: connecting by address is the "wrong host name" case.
    _new_leaf(
        folder,
        "server",
        "ca",
        [*leaf, "subjectAltName=DNS:localhost", "extendedKeyUsage=serverAuth"],
    )
    _new_leaf(folder, "client", "ca", [*leaf, "extendedKeyUsage=clientAuth"])
    for key in folder.glob("*.key"):
        key.chmod(0o600)
    return Certs(folder)


# -- the servers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsNodeSpace(NodeSpace):
    """A base folder of its own for the TLS node, and cluster.sh's TLS settings."""

    tls_dir: Path = Path()
    tls_port: int = 0

    def env(self) -> dict[str, str]:
        return {
            **super().env(),
            "WECLAW_CLUSTER_TLS_DIR": str(self.tls_dir),
            "WECLAW_CLUSTER_TLS_PORT": str(self.tls_port),
        }


@pytest.fixture(scope="module")
def tls_rabbit_port(private_servers: PrivateServers, certs: Certs) -> Iterator[int]:
    """A private RabbitMQ node listening for amqps:// on the returned port."""
    space = TlsNodeSpace(
        private_servers.folder("rabbit-tls"),
        f"{private_servers.run_id}-tls",
        private_servers,
        tls_dir=certs.folder,
        tls_port=free_port(),
    )
    with single_node(space, "with TLS"):
        yield space.tls_port


def _tls_ping(port: int, certs: Certs) -> bool:
    client = redis.Redis(
        host="localhost",
        port=port,
        ssl=True,
        ssl_ca_certs=certs["ca.pem"],
        ssl_certfile=certs["client.pem"],
        ssl_keyfile=certs["client.key"],
        socket_timeout=2,
    )
    return pings(client)


@pytest.fixture(scope="module")
def tls_redis_port(private_servers: PrivateServers, certs: Certs) -> Iterator[int]:
    """A private redis-server speaking only TLS (``port 0``) on the returned port."""
    server = TcpRedis(
        private_servers,
        private_servers.folder("redis-tls"),
        [
            "port 0",  # after TcpRedis's own "port N": no plain-text port at all
            "tls-port PORT",
            f'tls-cert-file "{certs["server.pem"]}"',
            f'tls-key-file "{certs["server.key"]}"',
            f'tls-ca-cert-file "{certs["ca.pem"]}"',
            "tls-auth-clients yes",
            'save ""',
            "appendonly no",
        ],
    )
    server.config[server.config.index("tls-port PORT")] = f"tls-port {server.port}"
    try:
        server.start()
        try:
            wait_for(lambda: _tls_ping(server.port, certs), 20, "the TLS redis-server to answer")
        except RuntimeError as e:
            log = Path(server.folder, "redis.log")
            tail = log.read_text()[-600:] if log.exists() else ""
            pytest.fail(
                f"{e}: redis-server must be built with TLS (Debian's is); log: {tail}",
                pytrace=False,
            )
        yield server.port
    finally:
        server.stop()


# -- settings ---------------------------------------------------------------------------------


def tls_settings(
    certs: Certs,
    rabbit_port: int,
    redis_port: int,
    *,
    host: str = "localhost",
    ca: str = "ca.pem",
    **overrides: Any,
) -> Settings:
    values: dict[str, Any] = {
        "amqp_url": f"amqps://guest:guest@{host}:{rabbit_port}/",
        "redis_url": f"rediss://{host}:{redis_port}/0",
        "amqp_tls_ca_file": certs[ca],
        "amqp_tls_cert_file": certs["client.pem"],
        "amqp_tls_key_file": certs["client.key"],
        "redis_tls_ca_file": certs[ca],
        "redis_tls_cert_file": certs["client.pem"],
        "redis_tls_key_file": certs["client.key"],
        "redis_timeout_s": 3.0,
        "reconnect_max_delay_s": 0.5,
        **overrides,
    }
    return Settings(**values)


class Prompt(BaseModel):
    text: str


# -- the tests --------------------------------------------------------------------------------


async def test_the_right_ca_runs_a_task_end_to_end_over_tls(
    certs: Certs, tls_rabbit_port: int, tls_redis_port: int, start_worker: Any
) -> None:
    app = App("tls", settings=tls_settings(certs, tls_rabbit_port, tls_redis_port))
    ran: Counter[str] = Counter()

    @app.handler("tls-q")
    async def shout(task: Prompt, ctx: Context) -> dict[str, str]:
        ran[ctx.task_id] += 1
        return {"reply": task.text.upper()}

    try:
        await start_worker(app)
        first = await app.publish("tls-q", Prompt(text="over tls"))
        state = await app.result(first, timeout_s=20)
        assert state.status is TaskStatus.SUCCEEDED
        assert state.result == {"reply": "OVER TLS"}
        # The guard (in the TLS Redis) turns away the same task id published again; the next
        # task behind it in the queue proves the duplicate was delivered and settled first.
        await app.publish("tls-q", Prompt(text="again"), task_id=first)
        second = await app.publish("tls-q", Prompt(text="next"))
        assert (await app.result(second, timeout_s=20)).result == {"reply": "NEXT"}
        assert ran == {first: 1, second: 1}
    finally:
        await app.close()


async def test_a_wrong_ca_is_refused_with_one_line_naming_it(
    certs: Certs, tls_rabbit_port: int, tls_redis_port: int
) -> None:
    settings = tls_settings(
        certs,
        tls_rabbit_port,
        tls_redis_port,
        ca="wrong-ca.pem",
        # The clients' own "don't verify" URL options are not read: the settings decide.
        amqp_url=f"amqps://guest:guest@localhost:{tls_rabbit_port}/?no_verify_ssl=1",
        redis_url=f"rediss://localhost:{tls_redis_port}/0?ssl_cert_reqs=none",
    )
    with pytest.raises(BrokerUnavailableError) as broker:
        await BrokerEndpoints(settings).connect(name="tls-wrong-ca")
    app = App("tls-wrong-ca", settings=settings)
    try:
        with pytest.raises(StateUnavailableError) as state:
            await app.status(str(uuid.uuid4()))
    finally:
        await app.close()
    for error, setting in (
        (broker.value, "WECLAW_MQ_AMQP_TLS_CA_FILE"),
        (state.value, "WECLAW_MQ_REDIS_TLS_CA_FILE"),
    ):
        text = str(error)
        assert "\n" not in text
        assert "certificate is not trusted" in text, text
        assert setting in text, text


async def test_a_host_the_certificate_does_not_name_is_refused_unless_verification_is_off(
    certs: Certs, tls_rabbit_port: int, tls_redis_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    by_address = tls_settings(certs, tls_rabbit_port, tls_redis_port, host="127.0.0.1")
    with pytest.raises(BrokerUnavailableError) as broker:
        await BrokerEndpoints(by_address).connect(name="tls-wrong-host")
    app = App("tls-wrong-host", settings=by_address)
    try:
        with pytest.raises(StateUnavailableError) as state:
            await app.status(str(uuid.uuid4()))
    finally:
        await app.close()
    for error, setting in (
        (broker.value, "WECLAW_MQ_AMQP_TLS_VERIFY_HOSTNAME"),
        (state.value, "WECLAW_MQ_REDIS_TLS_VERIFY_HOSTNAME"),
    ):
        text = str(error)
        assert "\n" not in text
        assert "does not name the host" in text and "127.0.0.1" in text, text
        assert setting in text, text

    # The same address with verification explicitly off: connects, and says so in the log.
    unverified = tls_settings(
        certs,
        tls_rabbit_port,
        tls_redis_port,
        host="127.0.0.1",
        amqp_tls_verify_hostname=False,
        redis_tls_verify_hostname=False,
    )
    with caplog.at_level(logging.WARNING, logger="weclaw_mq.tls"):
        conn = await BrokerEndpoints(unverified).connect(name="tls-unverified")
        await conn.close()
        app = App("tls-unverified", settings=unverified)
        try:
            assert await app.status(str(uuid.uuid4())) is None
        finally:
            await app.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "weclaw_mq.tls"]
    assert any("RabbitMQ" in w and "hostname verification is OFF" in w for w in warnings)
    assert any("Redis" in w and "hostname verification is OFF" in w for w in warnings)


def test_the_cli_prints_one_line_for_a_refused_certificate(
    certs: Certs, tls_rabbit_port: int, tls_redis_port: int
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("WECLAW_MQ_")},
        "WECLAW_MQ_AMQP_URL": f"amqps://guest:s3cret@localhost:{tls_rabbit_port}/",
        "WECLAW_MQ_AMQP_TLS_CA_FILE": certs["wrong-ca.pem"],
        "WECLAW_MQ_AMQP_TLS_CERT_FILE": certs["client.pem"],
        "WECLAW_MQ_AMQP_TLS_KEY_FILE": certs["client.key"],
    }
    done = subprocess.run(
        [sys.executable, "-m", "weclaw_mq.cli", "stats", "tls-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 4, done.stderr  # ExitCode.BROKER_UNAVAILABLE
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("weclaw-mq: error: "), lines
    assert "certificate is not trusted" in lines[0] and "WECLAW_MQ_AMQP_TLS_CA_FILE" in lines[0]
    assert "s3cret" not in done.stderr + done.stdout

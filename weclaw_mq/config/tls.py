"""TLS to RabbitMQ (``amqps://``) and Redis (``rediss://``): the one place a client SSLContext
is made from the settings, and the one place a refused handshake is put into words.

Per service (``amqp`` or ``redis``), four settings (``WECLAW_MQ_<SERVICE>_TLS_...``):

    CA_FILE          PEM file of the CA(s) the server's certificate must chain to; unset: the
                     system's trusted CAs (what a managed broker's public certificate needs)
    CERT_FILE        PEM client certificate, for a server that asks for one (mutual TLS)
    KEY_FILE         its private key (unset: the key is in CERT_FILE)
    VERIFY_HOSTNAME  true (default): the certificate must name the host in the URL. false is
                     an explicit choice, logged as a warning whenever a client is made: any
                     certificate a trusted CA signed is then accepted for any host

The certificate chain is always verified: there is no setting that turns it off.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from typing import Literal

from weclaw_mq.errors import ConfigurationError

log = logging.getLogger("weclaw_mq.tls")

Service = Literal["amqp", "redis"]
_SERVER_NAMES: dict[Service, str] = {"amqp": "RabbitMQ", "redis": "Redis"}


def setting_name(service: Service, what: str) -> str:
    """The environment variable of one TLS setting, as errors and warnings name it."""
    return f"WECLAW_MQ_{service.upper()}_TLS_{what.upper()}"


@dataclass(frozen=True)
class TlsOptions:
    """The TLS settings of one service (read from Settings by ``Settings.tls``)."""

    service: Service
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify_hostname: bool = True

    @property
    def configured(self) -> bool:
        """Whether any TLS setting differs from its default."""
        return bool(self.ca_file or self.cert_file or self.key_file) or not self.verify_hostname


def client_context(options: TlsOptions) -> ssl.SSLContext:
    """A client SSLContext for ``options``; ``ConfigurationError`` naming the setting whose
    file cannot be read or used."""
    try:
        # Only the named CA when one is named (a private CA must not widen to every public
        # one); the system's CAs otherwise.
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=options.ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigurationError(
            f"{setting_name(options.service, 'ca_file')}={options.ca_file}: cannot load it ({e})"
        ) from None
    if options.cert_file:
        try:
            context.load_cert_chain(options.cert_file, options.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigurationError(
                f"{setting_name(options.service, 'cert_file')}={options.cert_file} with "
                f"{setting_name(options.service, 'key_file')}={options.key_file}: "
                f"cannot load the client certificate and key ({e})"
            ) from None
    if not options.verify_hostname:
        context.check_hostname = False
        log.warning(
            "TLS hostname verification is OFF for %s (%s=false): any certificate signed by a "
            "trusted CA is accepted, whatever host it names",
            _SERVER_NAMES[options.service],
            setting_name(options.service, "verify_hostname"),
        )
    return context


def describe_refusal(e: BaseException, service: Service) -> str | None:
    """What a failed TLS handshake with ``service`` (``e``, or any exception it was raised
    from) means, in one line naming the setting to look at; None when ``e`` is no refusal of
    the server's certificate."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return _certificate_refused(current, service)
        current = current.__cause__ or current.__context__
    return None


def _certificate_refused(e: ssl.SSLCertVerificationError, service: Service) -> str:
    server = _SERVER_NAMES[service]
    detail = e.verify_message or str(e)
    if "mismatch" in detail.lower():  # "Hostname mismatch", "IP address mismatch"
        return (
            f"TLS: {server}'s certificate does not name the host in the URL ({detail}); "
            f"connect by a name the certificate was issued for, or set "
            f"{setting_name(service, 'verify_hostname')}=false to accept it anyway"
        )
    return (
        f"TLS: {server}'s certificate is not trusted ({detail}): no CA in "
        f"{setting_name(service, 'ca_file')} (the system's CAs when unset) signed it"
    )

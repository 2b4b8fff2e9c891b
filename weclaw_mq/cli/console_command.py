"""``weclaw-mq console MODULE:APP``: serve the web console (``weclaw_mq.console``) of the app
with uvicorn until Ctrl-C.

Safe by default: it binds 127.0.0.1. Any other host needs ``--token``, since the console can
cancel tasks and requeue or purge dead letters, and ``--behind-tls-proxy``, since the console
speaks plain HTTP and the token and its session cookie must not cross a network in clear
(each refused with one line and exit 2 without); ``--read-only`` serves the pages without
any of those actions. The console's packages
(starlette, uvicorn, jinja2) come with the ``console`` extra, imported only by this command.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Annotated

import typer

from weclaw_mq.cli.exit_codes import ExitCode, fail
from weclaw_mq.cli.loading import load_app
from weclaw_mq.cli.options import AppPath, LogLevel
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability.tracing import configure_logging

if TYPE_CHECKING:
    from weclaw_mq.app import App
    from weclaw_mq.console import Access

HOW_TO_GET_CONSOLE = "pip install 'weclaw_mq[console]'"
CONSOLE_PACKAGES = ("starlette", "uvicorn", "jinja2")
# A token shorter than this is refused: it would be guessed.
TOKEN_MIN_LENGTH = 16
# As weclaw_mq.console.access's, which this module may not import before the extra is known.
DEFAULT_SESSION_TTL_S = 12 * 3600.0


# Who may use the console, and for how long (weclaw_mq.console.access).
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="WECLAW_MQ_CONSOLE_TOKEN",
        metavar="TOKEN",
        show_default=False,
        help=f"The access token (at least {TOKEN_MIN_LENGTH} characters): every request "
        "carries it, as 'Authorization: Bearer TOKEN' or the cookie of the sign-in form. "
        "Prefer the environment variable: a command line is visible to every user.",
    ),
]
ReadOnlyOption = Annotated[
    bool,
    typer.Option(
        "--read-only",
        envvar="WECLAW_MQ_CONSOLE_READ_ONLY",
        help="Show everything, change nothing: no cancel, requeue or purge.",
    ),
]
BehindTlsProxyOption = Annotated[
    bool,
    typer.Option(
        "--behind-tls-proxy",
        envvar="WECLAW_MQ_CONSOLE_BEHIND_TLS_PROXY",
        help="Say that a proxy terminating TLS stands in front (needed to bind anything but "
        "a loopback address); the session cookie is then always marked Secure.",
    ),
]
SessionHoursOption = Annotated[
    float,
    typer.Option(
        "--session-hours",
        envvar="WECLAW_MQ_CONSOLE_SESSION_HOURS",
        min=0.01,
        max=24 * 366,
        metavar="HOURS",
        help="How long a sign-in lasts; signing out ends it sooner.",
    ),
]


def is_loopback_host(host: str) -> bool:
    from weclaw_mq.console.access import is_loopback

    return is_loopback(host)


def console(
    app_path: AppPath,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            envvar="WECLAW_MQ_CONSOLE_HOST",
            metavar="HOST",
            help="The address to bind. Anything but a loopback address needs --token and "
            "--behind-tls-proxy (the console speaks plain HTTP).",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            "--port",
            envvar="WECLAW_MQ_CONSOLE_PORT",
            min=0,
            max=65535,
            metavar="PORT",
            help="The port to bind.",
        ),
    ] = 8765,
    token: TokenOption = None,
    read_only: ReadOnlyOption = False,
    behind_tls_proxy: BehindTlsProxyOption = False,
    session_hours: SessionHoursOption = DEFAULT_SESSION_TTL_S / 3600,
    trace_url: Annotated[
        str | None,
        typer.Option(
            "--trace-url",
            envvar="WECLAW_MQ_CONSOLE_TRACE_URL",
            metavar="URL",
            show_default=False,
            help="Link each task's trace id to your tracing UI: an http(s) URL in which the "
            "field trace_id in braces stands for it (docs/operations/console.md).",
        ),
    ] = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Serve the web console of the app: its queues and workers, run history, each task's
    timeline and live output, and its dead letters (requeue, purge)."""
    _require_the_extra()
    _refuse_unsafe_options(host, token, behind_tls_proxy, trace_url)
    configure_logging(log_level)
    app = load_app(app_path)
    access = _access(token, read_only, session_hours, behind_tls_proxy)
    _serve(app, access, host, port, trace_url, log_level)


def _require_the_extra() -> None:
    """Fail (exit CONFIG, naming the extra) unless the console's packages import."""
    # Before anything imports weclaw_mq.console (the host check does): it needs the extra.
    missing = [name for name in CONSOLE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        fail(
            f"the console needs {', '.join(missing)}, not installed: {HOW_TO_GET_CONSOLE}",
            ExitCode.CONFIG,
        )
    try:
        for module in ("uvicorn", "weclaw_mq.console", "weclaw_mq.console.detail"):
            importlib.import_module(module)
    except ModuleNotFoundError as e:  # a package of the extra there, one it needs not
        package = (e.name or "weclaw_mq").partition(".")[0]
        if package == "weclaw_mq":
            raise
        fail(f"the console needs {package}, not installed: {HOW_TO_GET_CONSOLE}", ExitCode.CONFIG)


def _refuse_unsafe_options(
    host: str, token: str | None, behind_tls_proxy: bool, trace_url: str | None
) -> None:
    """Fail (exit USAGE) on a short token, on a host beyond this machine without a token and
    a TLS proxy, and on a trace URL that is not one."""
    from weclaw_mq.console.detail import check_trace_url

    if token is not None and len(token) < TOKEN_MIN_LENGTH:
        fail(f"--token must be at least {TOKEN_MIN_LENGTH} characters", ExitCode.USAGE)
    if token is None and not is_loopback_host(host):
        fail(
            f"--host {host} serves the console beyond this machine: give an access token "
            "(--token or WECLAW_MQ_CONSOLE_TOKEN)",
            ExitCode.USAGE,
        )
    if not behind_tls_proxy and not is_loopback_host(host):
        fail(
            f"--host {host} would send the token and its session cookie over plain HTTP: put "
            "a proxy that terminates TLS in front and pass --behind-tls-proxy",
            ExitCode.USAGE,
        )
    if trace_url is not None:
        try:
            check_trace_url(trace_url)
        except ConfigurationError as e:
            fail(f"--trace-url: {e}", ExitCode.USAGE)


def _access(token: str | None, read_only: bool, session_hours: float, secure: bool) -> Access:
    from weclaw_mq.console import Access

    return Access(
        token=token,
        read_only=read_only,
        session_ttl_s=session_hours * 3600,
        secure_cookie=secure,
    )


def _serve(
    app: App, access: Access, host: str, port: int, trace_url: str | None, log_level: str
) -> None:
    """Serve the app's console on ``host:port`` with uvicorn until Ctrl-C."""
    import uvicorn

    from weclaw_mq.console import create_console

    web = create_console(app, access, trace_url=trace_url)
    shown = f"[{host}]" if ":" in host else host
    logging.getLogger("weclaw_mq.console").info(
        "console of app %r on http://%s:%d/%s",
        app.name,
        shown,
        port,
        " (read-only)" if access.read_only else "",
    )
    # uvicorn's own access log would print every poll; the audit log says what changed.
    uvicorn.run(web, host=host, port=port, log_level=log_level.lower(), access_log=False)

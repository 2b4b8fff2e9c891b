"""Every knob of weclaw_mq, read once from the environment (prefix ``WECLAW_MQ_``) or ``.env``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Self
from urllib.parse import urlsplit, urlunsplit

import annotated_types
import yarl
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from weclaw_mq.config.environment import EnvSettings
from weclaw_mq.config.redis_urls import RedisTopology, check_database, is_multi_node, parse_topology
from weclaw_mq.config.tls import Service, TlsOptions, setting_name
from weclaw_mq.contract.lifetime import DEFAULT_TTL_S
from weclaw_mq.policy.retry import RetryPolicy

# The retry defaults are RetryPolicy's own, stated once in retry.py.
_DEFAULT_RETRY = RetryPolicy()

# RabbitMQ closes a channel whose delivery stays unacked past consumer_timeout (30 min by
# default, settable per queue only from 3.12), requeueing everything on it.
BROKER_CONSUMER_TIMEOUT_S = 30 * 60

# Blocking SDK calls mostly wait on the network: a thread each, made only when one runs.
DEFAULT_SYNC_THREADS = 64

_HOUR_S = 3600.0
_DAY_S = 24 * _HOUR_S
_WEEK_S = 7 * _DAY_S
_YEAR_S = 365 * _DAY_S


def seconds(default: float, *, floor: float, ceiling: float) -> Any:
    """A duration setting (its name ends in ``_s``): a finite number from ``floor`` to
    ``ceiling``, both said in the error. Every duration has both: a value that validates but
    is unusable (a lease of 1e-9 s, a grace of inf) must fail at load, not stall a worker."""
    return Field(default=default, ge=floor, le=ceiling, allow_inf_nan=False)


# Named in the error for a URL of no known scheme (redis_urls.py parses these).
_MULTI_NODE = ("redis+cluster", "redis+sentinel")


class Settings(EnvSettings):
    """Every knob of weclaw_mq, read from ``WECLAW_MQ_<FIELD>`` variables and ``.env``.

    docs/operations/configuration.md lists the fields, from the comments above them.

    Args:
        _env_file: The ``.env`` file to read; default the class's ``env_file`` (``.env``);
            None reads none.
        **values: Fields set here, over the environment.

    Raises:
        pydantic.ValidationError: A value out of its bounds; the value itself is never
            echoed back (it may be a URL with a password in it).
    """

    # Read from WECLAW_MQ_<FIELD> (any case), then .env (config/environment.py: unknown keys are
    # ignored, a rejected value is never echoed back: it may be a URL with a password in it).
    env_prefix: ClassVar[str] = "WECLAW_MQ_"
    env_file: ClassVar[str | None] = ".env"

    # One URL, or a cluster's nodes separated by commas: clients connect to the first that
    # answers and move to another node when theirs dies.
    amqp_url: SecretStr = SecretStr("amqp://guest:guest@localhost:5672/")
    # One Redis, or a Redis Cluster (redis+cluster://) or Sentinel set (redis+sentinel://):
    # the forms are listed in redis_urls.py.
    redis_url: SecretStr = SecretStr("redis://localhost:6379/0")

    # TLS (amqps://, rediss://): what each setting means is in tls.py. Hostname verification
    # is on unless turned off here (and then logged as a warning).

    # PEM file of the CA(s) the broker's certificate must chain to; unset: the system's CAs.
    amqp_tls_ca_file: str | None = None
    # PEM client certificate, for a broker that asks for one (mutual TLS).
    amqp_tls_cert_file: str | None = None
    # Its private key (unset: the key is in the certificate file).
    amqp_tls_key_file: str | None = None
    # False accepts a trusted certificate for any host (logged as a warning).
    amqp_tls_verify_hostname: bool = True
    # PEM file of the CA(s) Redis's certificate must chain to; unset: the system's CAs.
    redis_tls_ca_file: str | None = None
    # PEM client certificate, for a Redis that asks for one (mutual TLS).
    redis_tls_cert_file: str | None = None
    # Its private key (unset: the key is in the certificate file).
    redis_tls_key_file: str | None = None
    # False accepts a trusted certificate for any host (logged as a warning).
    redis_tls_verify_hostname: bool = True

    # Handlers in flight per queue (the prefetch too); 'worker --concurrency' overrides it.
    concurrency: int = Field(default=1, ge=1, le=10_000)
    # Priority lanes (docs/how-to/priorities.md): a lane with a task waiting is passed over by at
    # most this many starts from higher lanes in a row; then its task starts next.
    priority_starvation_limit: int = Field(default=8, ge=1, le=10_000)
    # Priority lanes: a task delivered to the worker and not started for this long while a
    # slot is free is logged, counted (weclaw_mq_held_deliveries) and given back.
    held_delivery_s: float = seconds(30.0, floor=0.1, ceiling=3600.0)
    # At start, a worker beside a local broker reads its file handles and memory with
    # rabbitmqctl (about a second of CPU, run at low priority) and warns near a limit.
    broker_load_check: bool = True
    # The level of the line a failed attempt that is retried writes ("attempt N failed (...);
    # retrying in ..."); a handler asking for a retry (Retry) is logged at INFO.
    retry_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    # A retried or dead-lettered attempt's line carries the handler's traceback (its frames
    # from the handler down, the worker's own left out).
    failure_tracebacks: bool = True
    # The policy of a handler given no ``retry=``; defaults from RetryPolicy (retry.py).
    max_retries: int = Field(default=_DEFAULT_RETRY.max_retries, ge=0, le=100)
    # The first retry's delay; each next one is multiplied by retry_multiplier.
    retry_delay_s: float = seconds(_DEFAULT_RETRY.delay_s, floor=0.001, ceiling=_WEEK_S)
    # Capped: delay_s * multiplier ** attempt must stay a float (a huge one overflows).
    retry_multiplier: float = Field(
        default=_DEFAULT_RETRY.multiplier, ge=1.0, le=100.0, allow_inf_nan=False
    )
    # The cap of a retry delay.
    retry_max_delay_s: float = seconds(_DEFAULT_RETRY.max_delay_s, floor=0.001, ceiling=_WEEK_S)
    # Crash loops (worker dies on a message every time) end in the DLQ after this many returns.
    delivery_limit: int = Field(default=10, ge=1)

    # The lifetime (TTL) of a task published to a queue whose handler sets none: past it,
    # the task ends in Q.dlq with reason "expired" (see weclaw_mq.contract.lifetime).
    task_ttl_s: float = seconds(DEFAULT_TTL_S, floor=0.001, ceiling=_YEAR_S)

    # A larger payload is refused before sending; a larger body that arrives is
    # dead-lettered unparsed (invalid_payload).
    max_message_bytes: int = Field(default=1024 * 1024, ge=1)
    # How long a publish waits for the broker's confirm.
    confirm_timeout_s: float = seconds(10.0, floor=0.1, ceiling=_HOUR_S)
    # Well below the broker's consumer_timeout: a stuck model call must fail here first.
    handler_timeout_s: float = seconds(300.0, floor=0.001, ceiling=_WEEK_S)
    # A handler still running this long after its timeout's cancel is abandoned (it ignores
    # cancellation): its attempt fails, the worker serves on. See process._ending_without.
    handler_cancel_grace_s: float = seconds(10.0, floor=0.01, ceiling=_HOUR_S)
    # Threads per worker process for plain-'def' handlers (docs/how-to/handlers.md): made
    # only as such calls need them. A call past its timeout is abandoned, not killed, and
    # keeps its thread until it returns; a task that finds none free waits under its timeout.
    sync_threads: int = Field(default=DEFAULT_SYNC_THREADS, ge=1, le=4096)
    # The time in-flight tasks get after SIGTERM; the process exits within this plus 10 s.
    shutdown_grace_s: float = seconds(30.0, floor=0, ceiling=_DAY_S)
    # The cap of the reconnect backoff.
    reconnect_max_delay_s: float = seconds(10.0, floor=0.1, ceiling=_HOUR_S)
    # A dead peer (paused broker, blackholed link) is noticed within (heartbeat_s + 1) * 3 s.
    # Whole seconds (AMQP's unit): an int is finite; pydantic < 2.11 refuses allow_inf_nan on it.
    heartbeat_s: int = Field(default=10, ge=0, le=600)
    # Serve Prometheus /metrics and /healthz from the worker on this port; unset: off.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # Where the metrics port (/metrics, /healthz) listens: this host only, unless opened on
    # purpose ("0.0.0.0" for a Prometheus or a kubelet on another host).
    metrics_addr: str = Field(default="127.0.0.1", min_length=1)
    # OpenTelemetry spans per publish and per handler run (weclaw_mq.observability.otel): "auto"
    # opens them
    # when the process has set a TracerProvider, "on" requires opentelemetry-api, "off" never.
    otel: Literal["auto", "on", "off"] = "auto"
    # The worker's event loop: "uvloop" needs the extra weclaw_mq[uvloop] (worker/event_loop.py).
    event_loop: Literal["asyncio", "uvloop"] = "asyncio"

    # Idempotency guard and result store (Redis).
    # Per pool (the task store's, the stream store's, the limiter's), per process. A worker
    # needs a fixed few whatever its concurrency (worker.start_checks.REDIS_CONNECTIONS_NEEDED:
    # commands share the auto-pipeline); past the limit a command fails like an outage.
    redis_max_connections: int = Field(default=1024, ge=4)
    # Redis connect, socket and pool-wait timeout.
    redis_timeout_s: float = seconds(5.0, floor=0.01, ceiling=600)
    # Keep task states and results in Redis (and guard handlers with it).
    results_enabled: bool = True
    # The lease of a running task's guard key, renewed while it runs and stores its result.
    guard_lease_s: float = seconds(30.0, floor=0.5, ceiling=_DAY_S)
    # How long a finished task id is remembered as done (a redelivered copy is acked unrun).
    done_ttl_s: float = seconds(_DAY_S, floor=1, ceiling=_YEAR_S)
    # How long a task's state and result are kept.
    result_ttl_s: float = seconds(_DAY_S, floor=1, ceiling=_YEAR_S)
    # Keep the task index (every task, newest first, for App.tasks and the console) and each
    # task's timeline (App.timeline) beside the records (weclaw_mq.state.task_index).
    task_index: bool = True
    # The most tasks the index keeps; past it the oldest entries go (each writing process
    # trims every 1,000 index writes, so the index may run over by about that many per writer).
    task_index_max_entries: int = Field(default=1_000_000, ge=1)
    # How long a task stays in the index after its first record; 0: as long as records are
    # kept (result_ttl_s).
    task_index_max_age_s: float = seconds(0, floor=0, ceiling=_YEAR_S)
    # When Redis does not answer: "defer" parks the task in a delay queue until it does
    # (never run unguarded); "run_unguarded" is the explicit best-effort choice of users
    # who prefer availability over at-most-once effects.
    guard_on_redis_down: Literal["defer", "run_unguarded"] = "defer"
    # How long a finished handler keeps trying to store its result before giving the task
    # back to the broker (which would run it again).
    result_store_patience_s: float = seconds(60.0, floor=0, ceiling=_HOUR_S)

    # The guard's liveness (weclaw_mq.state.redis): every claim names its worker's heartbeat
    # key, which lives this long and is renewed every third of it; a claim whose worker's key
    # lapsed (the worker died) is free at once, without waiting out guard_lease_s. A worker
    # whose event loop stalls longer than this looks dead to the others.
    guard_heartbeat_ttl_s: float = seconds(5.0, floor=0.5, ceiling=300.0)
    # A long run's watch copy (worker.long_runs) comes back this often, through the longest
    # of its handler's delay queues not longer: one publish per period per run. A run whose
    # worker died resumes within this plus guard_heartbeat_ttl_s (docs/how-to/long-runs.md).
    long_run_watch_s: float = seconds(16.0, floor=1.0, ceiling=1024.0)
    # 'weclaw-mq inspect' (weclaw_mq.state.worker_registry): a worker with a Redis task store
    # writes what it runs to Redis this often, off the delivery path; the record lives three
    # beats, so a worker killed without stopping disappears within 3 x this.
    worker_beat_s: float = seconds(5.0, floor=0.1, ceiling=300.0)
    # Workflows (weclaw_mq.workflows): a chain or group not ended this long after its start
    # is ended "expired", naming what was missing (``deadline_s=`` of App.chain / App.group).
    workflow_deadline_s: float = seconds(_DAY_S, floor=0.001, ceiling=_YEAR_S)
    # How often each worker sweeps the workflow deadlines (one Redis script per sweep).
    workflow_sweep_s: float = seconds(5.0, floor=0.05, ceiling=_HOUR_S)
    # Schedules (docs/how-to/schedules.md): the scheduler replica that holds this lease in Redis
    # fires the ticks; killed, its lease lapses after this long and a standby takes over, and
    # the ticks in between are missed (each schedule's missed= policy decides).
    scheduler_lease_s: float = seconds(10.0, floor=0.5, ceiling=600.0)
    # Workers also run the scheduler (weclaw-mq worker --schedules): every replica competes for
    # the lease, one fires. Off: run 'weclaw-mq scheduler MODULE:APP' instead.
    schedules_in_worker: bool = False
    # Costs (docs/how-to/costs.md): how many UTC days an app's daily totals per tenant and
    # per model are kept in Redis ('weclaw-mq costs' reads them).
    cost_days_kept: int = Field(default=90, ge=1, le=3660)

    # The local outbox (weclaw_mq.outbox): off unless a file is named. Publishes that find
    # the broker unreachable, or whose outcome is unknown, are stored there and relayed.
    outbox_path: str | None = None
    # The outbox's bound in rows: past it, publish raises OutboxFullError.
    outbox_max_rows: int = Field(default=100_000, ge=1)
    # The outbox's bound in bytes (bodies and properties).
    outbox_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    # How often an idle relay looks for rows, and waits after a failed pass.
    outbox_relay_interval_s: float = seconds(1.0, floor=0.01, ceiling=_HOUR_S)
    # Rows one relay pass publishes before awaiting their confirms.
    outbox_relay_window: int = Field(default=500, ge=1, le=10_000)
    # A relay's claim on rows it is sending; a relay killed mid-pass leaves its rows to
    # others once this lapses (well past confirm_timeout_s).
    outbox_claim_s: float = seconds(60.0, floor=1, ceiling=_DAY_S)
    # Start the relay inside the producer process (App); off: run 'weclaw-mq outbox relay'.
    outbox_relay_in_app: bool = True
    # The PostgreSQL outbox (weclaw_mq.outbox.postgres): the database whose weclaw_outbox
    # table 'weclaw-mq outbox relay/status/migrate' use when no --postgres URL is given.
    outbox_postgres_url: SecretStr | None = None
    # Streamed partial output (ctx.emit): a chunk's JSON size, and chunks per attempt; over
    # either, emit raises StreamLimitError in the handler. Streams live for result_ttl_s.
    stream_max_chunk_bytes: int = Field(default=64 * 1024, ge=1)
    # The most chunks one attempt may emit.
    stream_max_chunks: int = Field(default=10_000, ge=1)
    # Memoized steps (ctx.step): the most bytes of JSON one step's result may hold; over it
    # ctx.step raises StepError and records nothing. Steps live as long as the task's record.
    step_max_bytes: int = Field(default=256 * 1024, ge=1, le=64 * 1024 * 1024)
    # Per-session inbox: pending (unconfirmed) entries expire after inbox_ttl_s, leaving an
    # "expired" record; past inbox_max_entries the oldest are dropped (and counted).
    inbox_ttl_s: float = seconds(_WEEK_S, floor=0.1, ceiling=_YEAR_S)
    # The most entries a session's inbox holds; past it the oldest are dropped.
    inbox_max_entries: int = Field(default=10_000, ge=1)

    @field_validator("*", mode="wrap")
    @classmethod
    def _durations_in_bounds(
        cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> Any:
        # pydantic's own words name one bound, or none ("a finite number"): say both.
        try:
            return handler(value)
        except ValidationError:
            bounds = duration_bounds(info.field_name or "")
            if bounds is None:
                raise
            whole = cls.model_fields[info.field_name or ""].annotation is int
            raise ValueError(
                f"must be {'a whole' if whole else 'a'} number of seconds from "
                f"{bounds[0]:g} to {bounds[1]:g}"
            ) from None

    @field_validator("amqp_url")
    @classmethod
    def _amqp_urls_parse(cls, value: SecretStr) -> SecretStr:
        # Checked here, not at the first connect: a garbage URL is a configuration mistake,
        # and aio-pika would report it as a bare ValueError from deep inside its parser.
        for url in (u.strip() for u in value.get_secret_value().split(",")):
            if url:
                _check_url(url, ("amqp", "amqps"), need_host=True)
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url_parses(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value()
        if is_multi_node(url):
            parse_topology(url, redact_url(url))
        else:
            _check_url(url, ("redis", "rediss", "unix", *_MULTI_NODE), need_host=False)
            check_database(url, redact_url(url))
        return value

    @model_validator(mode="after")
    def _tls_settings_fit(self) -> Self:
        # A CA file beside a plain amqp:// URL would be silently unused: the operator meant
        # TLS and would get none. Refused instead, like a file that is not there.
        services: tuple[Service, ...] = ("amqp", "redis")
        for service in services:
            options = self.tls(service)
            if options.configured and not self.uses_tls(service):
                url = "amqps://" if service == "amqp" else "rediss://"
                raise ValueError(
                    f"WECLAW_MQ_{service.upper()}_TLS_* is set but "
                    f"WECLAW_MQ_{service.upper()}_URL is not a {url} URL"
                )
            if options.key_file and not options.cert_file:
                raise ValueError(
                    f"{setting_name(service, 'key_file')} is set without "
                    f"{setting_name(service, 'cert_file')}"
                )
            for what, path in (
                ("ca_file", options.ca_file),
                ("cert_file", options.cert_file),
                ("key_file", options.key_file),
            ):
                if path and not Path(path).is_file():
                    raise ValueError(f"{setting_name(service, what)}={path}: no such file")
        return self

    def tls(self, service: Service) -> TlsOptions:
        """The TLS settings for RabbitMQ (``amqp``) or Redis (``redis``).

        Args:
            service: ``"amqp"`` or ``"redis"``.

        Returns:
            The service's CA, certificate and key files and hostname check.
        """
        if service == "amqp":
            return TlsOptions(
                service,
                self.amqp_tls_ca_file,
                self.amqp_tls_cert_file,
                self.amqp_tls_key_file,
                self.amqp_tls_verify_hostname,
            )
        return TlsOptions(
            service,
            self.redis_tls_ca_file,
            self.redis_tls_cert_file,
            self.redis_tls_key_file,
            self.redis_tls_verify_hostname,
        )

    def uses_tls(self, service: Service) -> bool:
        """Whether the service's URL (any node of an AMQP list) asks for TLS.

        Args:
            service: ``"amqp"`` or ``"redis"``.

        Returns:
            True for ``amqps://`` (RabbitMQ) or ``rediss`` (Redis).
        """
        if service == "amqp":
            return any(u.lower().startswith("amqps://") for u in self.amqp_urls())
        return self.redis_url_plain().lower().startswith("rediss")

    def retry_policy(self) -> RetryPolicy:
        """The retry policy of a handler registered without its own ``retry=``.

        Returns:
            The policy of ``max_retries`` and the ``retry_*`` settings.
        """
        return RetryPolicy(
            max_retries=self.max_retries,
            delay_s=self.retry_delay_s,
            multiplier=self.retry_multiplier,
            max_delay_s=self.retry_max_delay_s,
        )

    def amqp_url_plain(self) -> str:
        """``amqp_url`` as written, password included: never log it.

        Returns:
            The URL, or the comma-separated list of a cluster's nodes.
        """
        return self.amqp_url.get_secret_value()

    def amqp_urls(self) -> list[str]:
        """The broker URLs, one per node, in the order clients try them.

        Returns:
            The URLs; the default local broker's when the list is empty.
        """
        urls = [u.strip() for u in self.amqp_url_plain().split(",") if u.strip()]
        return urls or ["amqp://guest:guest@localhost:5672/"]

    def amqp_url_redacted(self) -> str:
        """``amqp_url`` with every password replaced by ``***``, for logs.

        Returns:
            The redacted URLs, comma-separated.
        """
        return ",".join(redact_url(u) for u in self.amqp_urls())

    def redis_url_plain(self) -> str:
        """``redis_url`` as written, password included: never log it.

        Returns:
            The URL.
        """
        return self.redis_url.get_secret_value()

    def redis_url_redacted(self) -> str:
        """``redis_url`` with any password replaced by ``***``, for logs.

        Returns:
            The redacted URL.
        """
        return redact_url(self.redis_url_plain())

    def redis_topology(self) -> RedisTopology | None:
        """The Redis Cluster or Sentinel set the URL names.

        Returns:
            Its nodes and options; None for one Redis.
        """
        url = self.redis_url_plain()
        return parse_topology(url, redact_url(url)) if is_multi_node(url) else None


def duration_bounds(field: str) -> tuple[float, float] | None:
    """The (floor, ceiling) of a duration setting made by ``seconds``; None for another."""
    info = Settings.model_fields.get(field)
    if info is None or not field.endswith(("_s", "_ms")):
        return None
    floor = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
    ceiling = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
    if floor is None or ceiling is None:
        return None
    return float(floor), float(ceiling)  # type: ignore[arg-type]


def _check_url(url: str, schemes: tuple[str, ...], *, need_host: bool) -> None:
    """Raise ValueError (with the URL redacted) unless ``url`` parses with one of ``schemes``."""
    try:
        parsed = yarl.URL(url)
        _ = parsed.port  # an out-of-range port raises only when read
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot parse the URL {redact_url(url)} ({e})") from None
    if parsed.scheme not in schemes:
        raise ValueError(
            f"the URL {redact_url(url)} does not start with "
            + " or ".join(f"{s}://" for s in schemes)
        )
    if need_host and not parsed.host:
        raise ValueError(f"the URL {redact_url(url)} names no host")
    if parsed.explicit_port == 0:
        # aio-pika and redis-py read port 0 as "no port" and would connect to 5672 or 6379.
        raise ValueError(f"the URL {redact_url(url)} has port 0, outside 1-65535")


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``: the only form that may reach a log."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        # The host part as written: reading .port would raise for a port out of range.
        host = parts.netloc.rpartition("@")[2]
    except ValueError:
        return "<unparseable url>"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))

"""``App``'s registration methods: handlers, startup and shutdown hooks, resources,
middleware and schedules. The options are checked here, at import time, so a mistake fails
when the module loads, not at the first task; the registry they fill is the App's."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

from weclaw_mq.contract.message import encode_payload
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.handlers.lifespan import HookT, Lifespan, Provider, ProviderT
from weclaw_mq.handlers.middleware import Chain, Middleware
from weclaw_mq.handlers.notifications import notify_target
from weclaw_mq.handlers.spec import HandlerFunc, HandlerSpec, build_spec
from weclaw_mq.llm.calls import handler_chain
from weclaw_mq.policy.breaker import Breaker
from weclaw_mq.policy.costs import Cap, Price
from weclaw_mq.policy.fair_share import Fair
from weclaw_mq.policy.fallback import Fallback
from weclaw_mq.policy.limits import KeyFunc, Limit, as_limits
from weclaw_mq.policy.priority import QUORUM, Priority
from weclaw_mq.policy.retry import RetryPolicy
from weclaw_mq.policy.schedules import DEFAULT_GRACE_S, MissedPolicy, Payload, Schedule
from weclaw_mq.settings import Settings

if TYPE_CHECKING:
    from weclaw_mq.llm.resources import ModelResources
    from weclaw_mq.observability.metrics import Metrics
    from weclaw_mq.state import TaskStore

_T = TypeVar("_T")


class Registration:
    """Registering what a worker runs (``App`` inherits these methods)."""

    # Set by App.__init__.
    name: str
    settings: Settings
    prices: dict[str, Price]
    metrics: Metrics
    lifespan: Lifespan
    middleware: Chain
    _handlers: dict[str, HandlerSpec]
    _schedules: dict[str, Schedule]
    # The LLM layer's state in Redis (limiter, ledger, models' health): a resource of the
    # App's lifespan, opening what its handlers and prices need then.
    _models: ModelResources

    @property
    def store(self) -> TaskStore | None:
        raise NotImplementedError  # App's

    def handler_chain(self, spec: HandlerSpec) -> Chain | None:
        """The middleware a handler's runs pass: the App's, then the handler's own.

        The handler's own are the LLM layer's (``weclaw_mq.llm``): its cap, fallback chain,
        limits and costs, when it has any. A worker asks once per handler.

        Args:
            spec: The handler.

        Returns:
            The chain, or None when no hook of it runs.
        """
        return handler_chain(
            self.middleware, self._models, self.name, self.settings, self.metrics, self.prices, spec
        )

    def handler(
        self,
        queue: str,
        *,
        retry: RetryPolicy | None = None,
        timeout_s: float | None = None,
        delivery_limit: int | None = None,
        max_length: int | None = None,
        idempotent: bool = True,
        ttl_s: float | None = None,
        notify: bool | str = False,
        priority: Priority | str = Priority.NORMAL,
        priorities: bool = False,
        queue_type: str = QUORUM,
        limit: Limit | Sequence[Limit] | None = None,
        breaker: Breaker | None = None,
        tenant: KeyFunc | None = None,
        cap: Cap | None = None,
        fallback: Fallback | None = None,
        fair: Fair | bool | None = None,
        long_running: bool = False,
    ) -> Callable[[HandlerFunc], HandlerFunc]:
        """Register a handler (async or plain def) for ``queue``; unset options come from settings.

        Args:
            queue: The handler queue; one handler per queue.
            retry: The retry policy; default ``settings.retry_policy()``.
            timeout_s: How long one attempt may run before it is cancelled; default
                ``settings.handler_timeout_s``.
            delivery_limit: The quorum queue's ``x-delivery-limit``: a task whose worker died
                on it this often is dead-lettered. Default ``settings.delivery_limit``.
            max_length: The queue's length bound (``x-max-length``), if any: past it,
                publishes are refused (``PublishNackedError``).
            idempotent: Guard the handler with the task store, so a redelivered task runs
                once.
            ttl_s: The lifetime of a task this App publishes to ``queue`` without its own
                ``ttl_s``; default ``settings.task_ttl_s`` (7 days).
            notify: ``True`` publishes each task's final state to ``<queue>.results``, a
                queue name to that queue, before the task is acked or dead-lettered (see
                ``notification``). Needs results on.
            priority: The default priority of tasks published to ``queue`` without one. A
                default above NORMAL implies ``priorities=True``.
            priorities: Let tasks of ``queue`` carry a priority above NORMAL. On a broker
                without usable priorities that costs two lane queues.
            queue_type: ``"quorum"``, or ``"classic"`` for a classic queue with native
                priorities (not replicated: see docs/how-to/priorities.md).
            limit: A ``Limit(key=..., concurrency=..., rate=..., per_s=...)`` or a list of
                them: tasks over a limit are deferred without spending an attempt (see
                ``limits``).
            breaker: A ``Breaker(...)`` pauses the queue in a worker after repeated failures
                (``UpstreamDown`` by default) and probes it after a cool-down (see
                ``breaker``).
            tenant: A function of the task naming whose bill it is on (a ``str`` or ``int``):
                its reported costs are summed per tenant (``weclaw-mq costs``).
            cap: A ``Cap(per_day=..., action=...)``: a tenant whose day's costs reached it
                gets its next tasks parked, shed or run on a cheaper model. Needs ``prices``.
            fallback: A ``Fallback([model, ...])``: each attempt gets ``ctx.model``, the first
                model that is up and that the task has not failed on (see
                ``weclaw_mq.policy.fallback``).
            fair: ``Fair(lanes=4)`` (or ``True``): a tenant's backlog does not hold up another
                tenant's task: each tenant's tasks go to a lane of its own, served in turn
                (``weclaw_mq.policy.fair_share``). The tenant is ``tenant=`` or ``Fair(key=)``.
            long_running: Runs may outlive the broker's consumer timeout: the delivery is
                acked as the run begins, a watch copy keeps the task on the broker, and a
                run whose worker died resumes elsewhere (``weclaw_mq.worker.long_runs``).
                Needs the guard (``idempotent=True``) and Redis.

        Returns:
            The decorator, which registers the function and returns it unchanged.

        Raises:
            ConfigurationError: ``limit`` holds something that is not a ``Limit``; when the
                decorator is applied, also a queue that already has a handler, or an option
                that cannot work (a bad ``notify``, a bad queue name).
            InvalidPriorityError: When the decorator is applied: an unknown ``priority`` or
                ``queue_type``.
        """
        limits = as_limits(limit)
        if cap is not None and not self.prices:
            raise ConfigurationError(
                f"cap for {queue!r} needs the models' prices: App(..., prices={{...}})"
            )

        def register(func: HandlerFunc) -> HandlerFunc:
            if queue in self._handlers:
                raise ConfigurationError(
                    f"queue {queue!r} already has a handler "
                    f"({self._handlers[queue].name}); one queue, one handler"
                )
            s = self.settings
            self._handlers[queue] = build_spec(
                func,
                queue=queue,
                retry=retry or s.retry_policy(),
                timeout_s=timeout_s if timeout_s is not None else s.handler_timeout_s,
                delivery_limit=delivery_limit if delivery_limit is not None else s.delivery_limit,
                max_length=max_length,
                idempotent=idempotent,
                ttl_s=ttl_s if ttl_s is not None else s.task_ttl_s,
                notify=notify_target(queue, notify, s),
                priority=priority,
                queue_type=queue_type,
                limits=limits,
                breaker=breaker,
                priorities=priorities,
                tenant=tenant,
                cap=cap,
                fallback=fallback,
                fair=fair,
                long_running=long_running,
            )
            return func

        return register

    # -- lifespan: startup and shutdown hooks, resources -----------------------------------
    def on_startup(self, hook: HookT) -> HookT:
        """Register a function to run once per worker process before its first task.

        An ``async def`` or a plain ``def`` with no parameters; it runs after the hooks and
        resources registered before it. A hook that raises stops the worker from starting
        (``StartupFailedError``: the CLI prints one line with your file and line, exit 3); what had
        started is closed again.

        Args:
            hook: The function.

        Returns:
            ``hook`` unchanged (a decorator).

        Raises:
            ConfigurationError: ``hook`` takes parameters, is a generator, or is registered
                twice.
        """
        return self.lifespan.on_startup(hook)

    def on_shutdown(self, hook: HookT) -> HookT:
        """Register a function to run once per worker process after its last task ended.

        An ``async def`` or a plain ``def`` with no parameters; it runs after the drain, before
        the hooks and resources registered before it. A hook that raises is logged; the others
        still run.

        Args:
            hook: The function.

        Returns:
            ``hook`` unchanged (a decorator).

        Raises:
            ConfigurationError: As ``on_startup``.
        """
        return self.lifespan.on_shutdown(hook)

    def resource(self, provider: ProviderT) -> ProviderT:
        """Register a resource that handlers reach with ``ctx.use(provider)``.

        The provider is a generator function (``async def`` or ``def``, no parameters) that opens
        something, yields it once, and closes it after the ``yield``. It is opened once per worker
        process in registration order, before the first task, and closed after the drain in reverse
        order; handlers reach it with ``ctx.use(provider)``, typed as the provider yields it.

        Args:
            provider: The generator function.

        Returns:
            ``provider`` unchanged (a decorator).

        Raises:
            ConfigurationError: ``provider`` is not a generator function, takes parameters,
                or is registered twice.
        """
        return self.lifespan.resource(provider)

    def use(self, provider: Provider[_T]) -> _T:
        """The open resource of ``provider`` (``ctx.use`` in a handler).

        Args:
            provider: A function registered with ``@app.resource``.

        Returns:
            What it yielded.

        Raises:
            ResourceUnavailableError: ``provider`` is not registered, or the lifespan is not
                open (no worker, ``TestBroker`` or ``async with app.lifespan`` runs it).
        """
        return self.lifespan.use(provider)

    def add_middleware(self, middleware: Middleware) -> None:
        """Run ``middleware``'s hooks around every handler run and every publish of this App.

        ``weclaw_mq.handlers.middleware`` says when each hook runs. Its ``before_*`` hooks run after
        those of middleware added before it, its ``after_*`` hooks before them. Add it at import,
        before a worker starts.

        Args:
            middleware: An instance of a ``Middleware`` subclass.

        Raises:
            ConfigurationError: Not a ``Middleware``, or added twice.
        """
        self.middleware.add(middleware)

    def schedule(
        self,
        name: str,
        *,
        queue: str,
        cron: str | None = None,
        every_s: float | None = None,
        tz: str = "UTC",
        missed: MissedPolicy = "skip",
        grace_s: float = DEFAULT_GRACE_S,
        payload: Payload = None,
    ) -> Schedule:
        """Publish a task to ``queue`` on every tick of a cron expression or an interval.

        A scheduler (``weclaw-mq scheduler MODULE:APP``, or workers run with ``--schedules``)
        fires the ticks; however many replicas run, one holds the lease and each tick is
        published once, under a task id made of the name and the tick, so the handler's guard
        runs it once even when a replica died between the publish and its record.

        Args:
            name: Unique in this App: letters, digits and ``_.:-``, at most 100.
            queue: The handler queue each tick's task goes to.
            cron: A five-field cron expression, evaluated in ``tz``.
            every_s: Or an interval in seconds (ticks at multiples of it since the epoch).
            tz: The IANA time zone of ``cron``.
            missed: What to do with ticks no scheduler fired on time: ``"skip"`` them, or
                ``"catch_up"``: run the latest of them once, late.
            grace_s: How late a tick may fire and still count as on time.
            payload: The task, or a function of the tick's time returning it; default
                ``{"schedule": name, "tick": "<ISO 8601>"}``.

        Returns:
            The schedule.

        Raises:
            ConfigurationError: A name used before or not allowed, neither or both of
                ``cron`` and ``every_s``, a cron expression or time zone that does not parse,
                an unknown ``missed``, or a fixed ``payload`` that the handler of ``queue``
                (registered before this call) refuses.
        """
        if name in self._schedules:
            raise ConfigurationError(f"schedule {name!r} is registered twice")
        planned = Schedule(
            name,
            queue,
            cron=cron,
            every_s=every_s,
            tz=tz,
            missed=missed,
            grace_s=grace_s,
            payload=payload,
        )
        spec = self._handlers.get(queue)
        if spec is not None and not callable(payload):
            try:
                spec.parse(
                    encode_payload(planned.task_for(planned.last_at_or_before(datetime.now(UTC))))
                )
            except Exception as e:
                raise ConfigurationError(
                    f"schedule {name!r}: the handler of {queue!r} refuses its payload: {e}"
                ) from e
        if spec is not None and not spec.idempotent:
            warnings.warn(
                f"schedule {name!r}: the handler of {queue!r} is not guarded (idempotent="
                "False): a tick published twice (a scheduler killed between its publish and its "
                "record) would run twice",
                stacklevel=2,
            )
        self._schedules[name] = planned
        return planned

    @property
    def schedules(self) -> Mapping[str, Schedule]:
        """The schedules registered with ``schedule``, by name (read-only)."""
        return MappingProxyType(self._schedules)

    @property
    def handlers(self) -> Mapping[str, HandlerSpec]:
        """The registered handlers by queue name (read-only)."""
        return MappingProxyType(self._handlers)

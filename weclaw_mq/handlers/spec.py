"""A registered handler: the user's function plus everything decided about it at import time."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from weclaw_mq.contract.lifetime import DEFAULT_TTL_S, check_ttl
from weclaw_mq.contract.naming import validate_queue_name
from weclaw_mq.errors import ConfigurationError, InvalidPayload, UndecodableBody
from weclaw_mq.handlers.notifications import NotifyTarget
from weclaw_mq.policy.breaker import Breaker
from weclaw_mq.policy.costs import Cap
from weclaw_mq.policy.failures import describe
from weclaw_mq.policy.fair_share import Fair, tenant_text
from weclaw_mq.policy.fallback import Fallback
from weclaw_mq.policy.limits import DEFER_LADDER_MS, KeyFunc, Limit
from weclaw_mq.policy.priority import QUORUM, Priority, check_queue_type, parse_priority
from weclaw_mq.policy.retry import RetryPolicy, delay_queue_set
from weclaw_mq.wire.topology import QueueSpec

# An ``async def`` (run on the event loop) or a plain ``def`` (run in the worker's threads).
HandlerFunc = Callable[..., Awaitable[Any]] | Callable[..., Any]


@dataclass(frozen=True)
class HandlerSpec:
    queue: str
    func: HandlerFunc
    adapter: TypeAdapter[Any]
    model: type[BaseModel] | None  # the task's pydantic model, when it is one
    takes_context: bool
    retry: RetryPolicy
    timeout_s: float
    delivery_limit: int
    max_length: int | None
    idempotent: bool
    # The lifetime of a task published without its own ttl_s (weclaw_mq.contract.lifetime).
    ttl_s: float = DEFAULT_TTL_S
    # Where the final state of each task is announced (``notify=``), or None.
    notify: NotifyTarget | None = None
    # The priority of a task published to this queue without one.
    priority: Priority = Priority.NORMAL
    # Takes priorities above NORMAL (``priorities=True``, or a default above NORMAL): only
    # such a handler gets lanes where the broker has no usable priorities (``topology``).
    priorities: bool = False
    queue_type: str = QUORUM
    # Per-key concurrency and rate limits (``limit=``; weclaw_mq.policy.limits).
    limits: tuple[Limit, ...] = ()
    # Pauses the queue in a worker after repeated upstream failures (weclaw_mq.policy.breaker).
    breaker: Breaker | None = None
    # A plain ``def``: each call runs in one of the worker's threads (worker.sync_threads).
    is_sync: bool = False
    # Whose bill a task is on (``tenant=``: a function of the task), and that tenant's daily
    # cap (``cap=``; weclaw_mq.policy.costs).
    tenant: KeyFunc | None = None
    cap: Cap | None = None
    # The models its attempts call, best first (``fallback=``; weclaw_mq.policy.fallback).
    fallback: Fallback | None = None
    # Shares its workers fairly between tenants (``fair=``; weclaw_mq.policy.fair_share),
    # with the function naming a task's tenant.
    fair: Fair | None = None
    fair_key: KeyFunc | None = None
    # Runs may outlive the broker's consumer timeout (``long_running=``; worker.long_runs).
    long_running: bool = False

    @property
    def name(self) -> str:
        return getattr(self.func, "__qualname__", repr(self.func))

    def queue_spec(self) -> QueueSpec:
        return QueueSpec(
            name=self.queue,
            # The policy's delays (the first always: the guard parks duplicates there), the
            # step queues that serve any other delay (weclaw_mq.policy.delays), and for a limited
            # handler the ladder its held-back tasks are deferred to (weclaw_mq.policy.limits).
            retry_delays_ms=tuple(
                dict.fromkeys(
                    (*delay_queue_set(self.retry), *(DEFER_LADDER_MS if self.limits else ()))
                )
            ),
            delivery_limit=self.delivery_limit,
            max_length=self.max_length,
            results=None if self.notify is None else self.notify.queue_spec(),
            queue_type=self.queue_type,
            priorities=self.priorities,
            fair_lanes=self.fair.lanes if self.fair is not None else 1,
            parks_until_midnight=self.cap is not None and self.cap.action == "park",
        )

    def tenant_of(self, task: Any) -> str:
        """The fair-share tenant of ``task`` (validated), as the fair book keys it.

        Raises:
            ConfigurationError: The key function failed or gave no str or int.
        """
        assert self.fair_key is not None
        try:
            value = self.fair_key(task)
        except Exception as e:
            raise ConfigurationError(
                f"the fair-share key of {self.queue!r} raised {describe(e)}"
            ) from e
        return tenant_text(value)

    def parse(self, body: bytes) -> Any:
        """Decode and validate in one pass, telling undecodable from invalid."""
        try:
            return self.adapter.validate_json(body)
        except ValidationError as e:
            if any(err["type"] == "json_invalid" for err in e.errors()):
                raise UndecodableBody(_first_error(e)) from e
            raise InvalidPayload(_first_error(e)) from e
        except Exception as e:
            # pydantic wraps only ValueError and AssertionError raised in a validator; a
            # validator raising anything else (KeyError, TypeError, RecursionError...) is
            # still this body failing the model, and no retry can fix it.
            raise InvalidPayload(f"a validator raised {describe(e)}") from e


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_sync(func: HandlerFunc, queue: str) -> bool:
    """An ``async def`` runs on the event loop, a plain function or method in a thread; a
    generator, or a callable that is neither, is refused."""
    if inspect.iscoroutinefunction(func):
        return False
    if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        raise ConfigurationError(
            f"handler for {queue!r} is a generator: a handler returns its result (stream "
            "partial output with ctx.emit)"
        )
    if not (inspect.isfunction(func) or inspect.ismethod(func)):
        raise ConfigurationError(
            f"handler for {queue!r} must be an 'async def' or a plain 'def' function, got {func!r}"
        )
    return True


# The worker calls ``func(task)`` or ``func(task, ctx)``: a second parameter that is not the
# context (``def add(x, y)``, Celery style) would get a Context and fail on every run.
_SIGNATURE_HELP = (
    "a handler takes one payload argument and an optional `ctx: Context`, as in "
    "`async def handle(task: MyTask, ctx: Context)`"
)
# Unannotated second parameters taken for the context by their name.
_CONTEXT_NAMES = frozenset({"ctx", "context", "_ctx", "_context", "_"})


def _is_context(annotation: Any) -> bool:
    # By name, not isinstance: weclaw_mq.context sits in a layer above this one.
    return any(
        c.__module__ == "weclaw_mq.context" and c.__qualname__ == "Context"
        for c in getattr(annotation, "__mro__", ())
    )


def _check_signature(
    func: HandlerFunc, queue: str, hints: dict[str, Any]
) -> list[inspect.Parameter]:
    """The handler's (task) or (task, ctx) parameters; any other signature is refused with
    what to write instead."""
    all_params = list(inspect.signature(func).parameters.values())
    params = [p for p in all_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    payload_like = [p.name for p in params if not _is_context(hints.get(p.name))]
    if (
        any(p.kind is p.VAR_POSITIONAL for p in all_params)
        or len(params) > 2
        or (len(params) == 2 and not _takes_context(params[1], hints))
    ):
        names = " and ".join(f"`{n}`" for n in payload_like) or "the values"
        raise ConfigurationError(
            f"handler for {queue!r} ({_name(func)}) takes {_shown(all_params)}, got "
            f"{len(params)} parameters: {_SIGNATURE_HELP}; put {names} in a pydantic model "
            "and take that as the payload"
        )
    if not params:
        raise ConfigurationError(
            f"handler for {queue!r} ({_name(func)}) takes {_shown(all_params)}, got 0 "
            f"parameters: {_SIGNATURE_HELP}"
        )
    required_kw = [p.name for p in all_params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if required_kw:
        raise ConfigurationError(
            f"handler for {queue!r} ({_name(func)}) has required keyword-only parameters "
            f"{', '.join(required_kw)} that no task fills: {_SIGNATURE_HELP}; give them "
            "defaults or put them in the payload's model"
        )
    return params


def _takes_context(param: inspect.Parameter, hints: dict[str, Any]) -> bool:
    annotation = hints.get(param.name)
    if annotation is None or annotation is Any:
        return param.name in _CONTEXT_NAMES or annotation is Any
    return _is_context(annotation)


def _name(func: HandlerFunc) -> str:
    return getattr(func, "__qualname__", repr(func))


def _shown(params: list[inspect.Parameter]) -> str:
    # Names only: with postponed annotations str(p) would quote every type.
    stars: dict[inspect._ParameterKind, str] = {
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.VAR_KEYWORD: "**",
    }
    return "(" + ", ".join(stars.get(p.kind, "") + p.name for p in params) + ")"


def _first_error(e: ValidationError) -> str:
    errors = e.errors(include_url=False)
    head = errors[0]
    loc = ".".join(str(p) for p in head["loc"]) or "<body>"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {head['msg']}{more}"


def build_spec(
    func: HandlerFunc,
    *,
    queue: str,
    retry: RetryPolicy,
    timeout_s: float,
    delivery_limit: int,
    max_length: int | None,
    idempotent: bool,
    ttl_s: float = DEFAULT_TTL_S,
    notify: NotifyTarget | None = None,
    priority: Priority | str = Priority.NORMAL,
    queue_type: str = QUORUM,
    limits: tuple[Limit, ...] = (),
    breaker: Breaker | None = None,
    priorities: bool = False,
    tenant: KeyFunc | None = None,
    cap: Cap | None = None,
    fallback: Fallback | None = None,
    fair: Fair | bool | None = None,
    long_running: bool = False,
) -> HandlerSpec:
    """Check the function and options now, so a mistake fails at import and not at 3 a.m."""
    validate_queue_name(queue)
    is_sync = _is_sync(func, queue)
    hints = _type_hints(func)
    params = _check_signature(func, queue, hints)
    _check_run_options(queue, timeout_s, delivery_limit, max_length, ttl_s, priorities)
    _check_long_running(queue, long_running, idempotent)
    _check_policies(queue, limits, breaker, tenant, cap, fallback)
    fair, fair_key = _fair_share(queue, fair, tenant)
    annotation = hints.get(params[0].name, Any)
    adapter = _adapter(queue, annotation)
    return HandlerSpec(
        queue=queue,
        func=func,
        adapter=adapter,
        model=annotation if _is_model(annotation) else None,
        takes_context=len(params) == 2,
        retry=retry,
        timeout_s=timeout_s,
        delivery_limit=delivery_limit,
        max_length=max_length,
        idempotent=idempotent,
        ttl_s=float(ttl_s),
        notify=notify,
        priority=parse_priority(priority),
        priorities=priorities or parse_priority(priority) is not Priority.NORMAL,
        queue_type=check_queue_type(queue_type),
        limits=limits,
        breaker=breaker,
        is_sync=is_sync,
        tenant=tenant,
        cap=cap,
        fallback=fallback,
        fair=fair,
        fair_key=fair_key,
        long_running=long_running,
    )


def _type_hints(func: HandlerFunc) -> dict[str, Any]:
    try:
        return typing.get_type_hints(func)
    except Exception as e:  # an unresolvable forward reference
        raise ConfigurationError(f"cannot resolve the type hints of {func!r}: {e}") from e


def _check_run_options(
    queue: str,
    timeout_s: float,
    delivery_limit: int,
    max_length: int | None,
    ttl_s: float,
    priorities: bool,
) -> None:
    """Refuse a run option out of its range: the timeout, the delivery limit, the length
    bound, the tasks' lifetime, the priorities flag."""
    if timeout_s <= 0:
        raise ConfigurationError(f"timeout_s for {queue!r} must be > 0, got {timeout_s}")
    if delivery_limit < 1:
        raise ConfigurationError(f"delivery_limit for {queue!r} must be >= 1")
    if max_length is not None and max_length < 1:
        raise ConfigurationError(f"max_length for {queue!r} must be >= 1")
    check_ttl(ttl_s, f"ttl_s for {queue!r}")
    if not isinstance(priorities, bool):
        raise ConfigurationError(f"priorities for {queue!r} must be True or False")


def _check_long_running(queue: str, long_running: bool, idempotent: bool) -> None:
    """A long run is resumed by whoever gets its watch copy: only the guard makes that safe."""
    if not isinstance(long_running, bool):
        raise ConfigurationError(f"long_running for {queue!r} must be True or False")
    if long_running and not idempotent:
        raise ConfigurationError(
            f"long_running for {queue!r} needs the guard (idempotent=True): its watch copy "
            "would otherwise run it a second time beside the first"
        )


def _check_policies(
    queue: str,
    limits: tuple[Limit, ...],
    breaker: Breaker | None,
    tenant: KeyFunc | None,
    cap: Cap | None,
    fallback: Fallback | None,
) -> None:
    """Refuse a policy of the wrong type, and per-model limits where no attempt names a model."""
    if breaker is not None and not isinstance(breaker, Breaker):
        raise ConfigurationError(f"breaker for {queue!r} must be a Breaker, got {breaker!r}")
    if tenant is not None and not callable(tenant):
        raise ConfigurationError(f"tenant for {queue!r} must be a function of the task")
    if cap is not None and not isinstance(cap, Cap):
        raise ConfigurationError(f"cap for {queue!r} must be a Cap, got {cap!r}")
    if fallback is not None and not isinstance(fallback, Fallback):
        raise ConfigurationError(f"fallback for {queue!r} must be a Fallback, got {fallback!r}")
    if (
        any(limit.per_model for limit in limits)
        and fallback is None
        and (cap is None or cap.model is None)
    ):
        raise ConfigurationError(
            f"a per_model limit of {queue!r} counts per model: give the handler fallback= (or "
            "a cap= with a model) so each attempt has one"
        )


def _fair_share(
    queue: str, fair: Fair | bool | None, tenant: KeyFunc | None
) -> tuple[Fair | None, KeyFunc | None]:
    """``fair=`` as a ``Fair`` or None, and the function naming a task's tenant for it."""
    if fair is True:
        fair = Fair()
    elif fair is False:
        fair = None
    if fair is not None and not isinstance(fair, Fair):
        raise ConfigurationError(f"fair for {queue!r} must be a Fair or True, got {fair!r}")
    fair_key = None if fair is None else (fair.key or tenant)
    if fair is not None and fair_key is None:
        raise ConfigurationError(
            f"fair for {queue!r} needs to know a task's tenant: give tenant= (a function of "
            "the task) or Fair(key=...)"
        )
    return fair, fair_key


def _adapter(queue: str, annotation: Any) -> TypeAdapter[Any]:
    try:
        return TypeAdapter(annotation)
    except Exception as e:
        raise ConfigurationError(
            f"handler for {queue!r}: pydantic cannot validate {annotation!r}: {e}"
        ) from e

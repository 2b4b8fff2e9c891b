"""An App's lifespan: startup and shutdown hooks, and the resources its handlers use.

One ordered list of steps, in the order they were registered: a startup hook runs, a resource
is opened (its provider runs up to its ``yield``, whose value handlers then reach with
``ctx.use(provider)``), a shutdown hook is remembered. Closing unwinds that list in reverse:
shutdown hooks run and resources resume after their ``yield``, last registered first. A step
that fails at startup unwinds only what had started before it, and the start fails with one
``StartupFailedError`` that names the step and the user's file and line.

A worker opens the lifespan before it connects and closes it after its drain (once per worker
process: ``--processes 4`` opens it four times, once in each); the test kit's ``TestBroker``
opens it on enter; anything else (a web app that publishes and wants the same clients) opens
it with ``async with app.lifespan``. Opened again while open, it only counts: the outermost
close unwinds it. Two opens at once (a web app's lifespan and a ``TestBroker`` in one process)
take turns: the second waits for the first to finish starting, then only counts, so every
resource starts once and closes once.

Resources are keyed by their provider function, not by their type: two resources of one type
(two database pools) need no registry of names, and ``use`` returns the provider's yield type.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from weclaw_mq.errors import ConfigurationError, ResourceUnavailableError, StartupFailedError
from weclaw_mq.policy.failures import describe, user_frames

log = logging.getLogger("weclaw_mq.worker")

_T = TypeVar("_T")

# A resource's provider: an ``async def`` or a plain ``def`` generator with no parameters,
# yielding the resource once (code after the ``yield`` closes it).
Provider = Callable[[], AsyncIterator[_T]] | Callable[[], Iterator[_T]]
# A startup or shutdown hook: an ``async def`` or a plain ``def`` with no parameters.
Hook = Callable[[], Awaitable[None]] | Callable[[], None]
HookT = TypeVar("HookT", bound=Callable[[], Any])
ProviderT = TypeVar("ProviderT", bound=Callable[[], Any])


@dataclass(frozen=True)
class _Step:
    kind: Literal["startup", "shutdown", "resource"]
    func: Callable[[], Any]

    @property
    def name(self) -> str:
        return f"{self.kind} {getattr(self.func, '__qualname__', repr(self.func))}"


class Lifespan:
    """The startup hooks, shutdown hooks and resources of one App, in registration order.

    An async context manager: ``async with app.lifespan:`` opens it (unless already open) and
    closes it on exit.
    """

    def __init__(self) -> None:
        self._steps: list[_Step] = []
        self._values: dict[Callable[[], Any], Any] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._opened = 0  # how many opens the open lifespan counts
        # Opens and closes take turns (one lock per event loop: an App may outlive a loop).
        self._turns: asyncio.Lock | None = None
        self._turns_loop: asyncio.AbstractEventLoop | None = None

    # -- registration -------------------------------------------------------------------
    def on_startup(self, hook: HookT) -> HookT:
        """Register ``hook`` to run once at start, after the steps registered before it."""
        self._add("startup", hook, generator=False)
        return hook

    def on_shutdown(self, hook: HookT) -> HookT:
        """Register ``hook`` to run once at stop, before the steps registered before it."""
        self._add("shutdown", hook, generator=False)
        return hook

    def resource(self, provider: ProviderT) -> ProviderT:
        """Register a resource: a generator (async or plain) with no parameters that yields it
        once and closes it after the ``yield``."""
        self._add("resource", provider, generator=True)
        return provider

    def _add(
        self, kind: Literal["startup", "shutdown", "resource"], func: Any, *, generator: bool
    ) -> None:
        what = "@app.resource" if generator else f"@app.on_{kind}"
        if not callable(func):
            raise ConfigurationError(f"{what} takes a function, got {func!r}")
        is_generator = inspect.isasyncgenfunction(func) or inspect.isgeneratorfunction(func)
        if generator and not is_generator:
            raise ConfigurationError(
                f"{what} takes a generator function that yields the resource once "
                f"('async def {getattr(func, '__name__', 'provider')}(): ... yield client'), "
                f"got {func!r}"
            )
        if not generator and is_generator:
            raise ConfigurationError(
                f"{what} takes a plain function; a generator is a resource (@app.resource)"
            )
        required = [
            p
            for p in inspect.signature(func).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            raise ConfigurationError(
                f"{what} {func.__qualname__} must take no parameters, it takes "
                f"{', '.join(p.name for p in required)} (reach a resource with app.use)"
            )
        if any(step.func is func for step in self._steps):
            raise ConfigurationError(f"{func.__qualname__} is registered twice")
        if self._stack is not None:
            raise ConfigurationError(
                f"{what} {func.__qualname__}: the lifespan is open already; register hooks "
                "and resources at import, before a worker starts"
            )
        self._steps.append(_Step(kind, func))

    @property
    def empty(self) -> bool:
        """Whether nothing is registered (opening it then costs nothing)."""
        return not self._steps

    @property
    def is_open(self) -> bool:
        return self._stack is not None

    # -- use ----------------------------------------------------------------------------
    def use(self, provider: Provider[_T]) -> _T:
        """The open resource that ``provider`` yielded.

        Args:
            provider: A function registered with ``@app.resource``.

        Returns:
            What it yielded, as typed by its annotation.

        Raises:
            ResourceUnavailableError: ``provider`` is not registered, or the lifespan is not
                open (or it was registered after a step that failed to start).
        """
        try:
            return cast("_T", self._values[provider])
        except (KeyError, TypeError):
            pass
        name = getattr(provider, "__qualname__", repr(provider))
        if not any(s.func is provider and s.kind == "resource" for s in self._steps):
            raise ResourceUnavailableError(
                f"{name} is not a resource of this App: register it with @app.resource"
            ) from None
        raise ResourceUnavailableError(
            f"resource {name} is not open: a worker, a TestBroker or 'async with "
            "app.lifespan' opens it"
        ) from None

    # -- open and close -----------------------------------------------------------------
    def _turn(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._turns is None or self._turns_loop is not loop:
            self._turns, self._turns_loop = asyncio.Lock(), loop
        return self._turns

    async def open(self) -> None:
        """Run every step in order, unless open already (then only count this open); an
        open that comes while another is starting waits for it, then counts.

        Raises:
            StartupFailedError: A step raised; the steps before it were unwound.
        """
        async with self._turn():
            await self._open()

    async def _open(self) -> None:
        if self._stack is not None:
            self._opened += 1
            return
        stack = contextlib.AsyncExitStack()
        for step in self._steps:
            try:
                await self._start(step, stack)
            except BaseException as e:
                try:
                    await stack.aclose()  # every close logs its own failure
                finally:
                    self._values.clear()
                if not isinstance(e, Exception):
                    raise  # a cancel or an interrupt: not the step's failure
                raise StartupFailedError(
                    f"{step.name} failed: {describe(e)}", user_frames(e)
                ) from e
        self._stack = stack
        self._opened = 1

    async def _start(self, step: _Step, stack: contextlib.AsyncExitStack) -> None:
        func = step.func
        if step.kind == "startup":
            await _call(func)
        elif step.kind == "shutdown":
            stack.push_async_callback(self._shut_down, step)
        elif inspect.isasyncgenfunction(func):
            opened = contextlib.asynccontextmanager(func)()
            self._values[func] = await opened.__aenter__()
            stack.push_async_callback(self._close, step, opened)
        else:
            held = contextlib.contextmanager(func)()
            self._values[func] = held.__enter__()
            stack.push_async_callback(self._close, step, held)

    async def _close(
        self,
        step: _Step,
        opened: contextlib.AbstractAsyncContextManager[Any]
        | contextlib.AbstractContextManager[Any],
    ) -> None:
        # Each on its own: a close that raises is logged, and the next resource's generator
        # resumes after its yield as usual, not with that exception thrown into it.
        self._values.pop(step.func, None)
        try:
            if isinstance(opened, contextlib.AbstractAsyncContextManager):
                await opened.__aexit__(None, None, None)
            else:
                opened.__exit__(None, None, None)
        except Exception:
            log.exception("%s failed to close", step.name)

    @staticmethod
    async def _shut_down(step: _Step) -> None:
        try:
            await _call(step.func)
        except Exception:
            # The others still run: one failing hook must not keep a pool open.
            log.exception("%s failed", step.name)

    async def close(self) -> None:
        """Close what ``open`` opened, last first; a no-op unless this is the outermost open.

        A resource or hook that fails while closing is logged; the rest still close.
        """
        async with self._turn():
            await self._close_outermost()

    async def _close_outermost(self) -> None:
        if self._stack is None:
            return
        self._opened -= 1
        if self._opened > 0:
            return
        stack, self._stack = self._stack, None
        await stack.aclose()  # every close logs its own failure

    async def __aenter__(self) -> Lifespan:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _call(func: Callable[[], Any]) -> None:
    outcome = func()
    if inspect.isawaitable(outcome):
        await outcome

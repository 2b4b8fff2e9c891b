"""An App's lifespan in isolation (``handlers.lifespan``): registration is checked at import,
steps open in order and close in reverse, a failing step unwinds only what had started, and
``use`` answers the provider's value only while open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from weclaw_mq import App, ConfigurationError
from weclaw_mq.errors import ResourceUnavailableError, StartupFailedError


class Pool:
    def __init__(self, name: str) -> None:
        self.name = name


def test_registration_refuses_what_cannot_work() -> None:
    app = App("t")

    async def pool() -> AsyncIterator[Pool]:
        yield Pool("p")

    def plain() -> Pool:
        return Pool("p")

    def needs(x: int) -> None:
        return None

    with pytest.raises(ConfigurationError, match="generator function"):
        app.resource(plain)
    with pytest.raises(ConfigurationError, match="a generator is a resource"):
        app.on_startup(pool)
    with pytest.raises(ConfigurationError, match="must take no parameters, it takes x"):
        app.on_shutdown(needs)
    app.resource(pool)
    with pytest.raises(ConfigurationError, match="registered twice"):
        app.resource(pool)


async def test_steps_open_in_order_and_close_in_reverse() -> None:
    app = App("t")
    log: list[str] = []

    @app.on_startup
    def first() -> None:
        log.append("startup first")

    @app.resource
    async def db() -> AsyncIterator[Pool]:
        log.append("open db")
        yield Pool("db")
        log.append("close db")

    @app.resource
    def cache() -> Iterator[Pool]:  # a plain generator works as well
        log.append("open cache")
        yield Pool("cache")
        log.append("close cache")

    @app.on_shutdown
    async def last() -> None:
        log.append(f"shutdown, db still {app.use(db).name}")

    async with app.lifespan:
        assert app.use(db).name == "db" and app.use(cache).name == "cache"
        async with app.lifespan:  # opened again while open: only counted
            pass
        assert app.use(db).name == "db"
    assert log == [
        "startup first",
        "open db",
        "open cache",
        "shutdown, db still db",
        "close cache",
        "close db",
    ]
    with pytest.raises(ResourceUnavailableError, match="is not open"):
        app.use(db)


async def test_a_failing_startup_unwinds_only_what_started_and_names_the_users_line() -> None:
    app = App("t")
    log: list[str] = []

    @app.resource
    async def db() -> AsyncIterator[Pool]:
        log.append("open db")
        yield Pool("db")
        log.append("close db")

    @app.on_startup
    def load_model() -> None:
        raise KeyError("missing")

    @app.resource
    async def never() -> AsyncIterator[Pool]:
        log.append("open never")
        yield Pool("never")

    with pytest.raises(StartupFailedError) as failed:
        await app.lifespan.open()

    assert str(failed.value) == (
        "startup test_a_failing_startup_unwinds_only_what_started_and_names_the_users_line"
        ".<locals>.load_model failed: KeyError: 'missing'"
    )
    assert isinstance(failed.value.__cause__, KeyError)
    assert failed.value.where[0].startswith(f'File "{__file__}", line ')
    assert failed.value.where[-1] == '  raise KeyError("missing")'
    assert log == ["open db", "close db"]
    assert not app.lifespan.is_open


async def test_a_failing_close_is_logged_and_the_others_still_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App("t")
    closed: list[str] = []

    @app.resource
    async def a() -> AsyncIterator[Pool]:
        yield Pool("a")
        closed.append("a")

    @app.resource
    async def b() -> AsyncIterator[Pool]:
        yield Pool("b")
        raise OSError("the pool would not close")

    @app.on_shutdown
    def boom() -> None:
        raise RuntimeError("shutdown hook failed")

    async with app.lifespan:
        pass
    assert closed == ["a"]
    messages = [r.getMessage() + str(r.exc_info[1]) for r in caplog.records if r.exc_info]
    assert any("shutdown hook failed" in m for m in messages), messages
    assert any("would not close" in m for m in messages), messages


def test_use_says_which_provider_is_not_a_resource() -> None:
    app = App("t")

    async def stray() -> AsyncIterator[Pool]:
        yield Pool("x")

    with pytest.raises(ResourceUnavailableError, match="stray is not a resource of this App"):
        app.use(stray)


async def test_registering_while_open_is_refused() -> None:
    app = App("t")
    async with app.lifespan:
        with pytest.raises(ConfigurationError, match="the lifespan is open already"):

            @app.on_startup
            def late() -> None:
                return None


async def test_two_opens_at_once_start_each_resource_once_and_the_last_close_closes_it() -> None:
    app = App("t")
    log: list[str] = []
    started = asyncio.Event()

    @app.resource
    async def pool() -> AsyncIterator[Pool]:
        log.append("open")
        await started.wait()  # still starting when the second open comes
        yield Pool("p")
        log.append("close")

    # A web app's lifespan and a TestBroker opening one App in one process, together.
    first = asyncio.create_task(app.lifespan.open())
    second = asyncio.create_task(app.lifespan.open())
    await asyncio.sleep(0)  # one turn of the loop: each open runs until it waits
    started.set()
    await asyncio.gather(first, second)
    assert log == ["open"]
    opened = app.use(pool)
    await app.lifespan.close()
    assert app.use(pool) is opened and log == ["open"]  # the other opener still uses it
    await app.lifespan.close()
    assert log == ["open", "close"] and not app.lifespan.is_open

"""weclaw_mq's pytest plugin, loaded by pytest wherever weclaw_mq is installed (entry point
``pytest11``). Its fixtures all start with ``weclaw_``:

- ``weclaw_test_broker``: a factory; ``broker = await weclaw_test_broker(app)`` opens a
  ``TestBroker`` for ``app`` (and any more apps given), closed after the test. Needs
  pytest-asyncio (in ``weclaw-mq[testing]``).
- ``weclaw_rabbitmq_url``, ``weclaw_redis_url`` (session): a real service to test against,
  found as ``weclaw_mq.testing.services`` says (the URL in the environment, else a
  testcontainers container where Docker runs, else the local default); a failure saying how
  to get one when there is none.

Nothing heavy is imported when pytest loads the plugin: the test broker and the service
checks are imported by the fixtures that use them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, AsyncExitStack, ExitStack
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from weclaw_mq.app import App
    from weclaw_mq.testing.broker import TestBroker

BrokerFactory = Callable[..., Awaitable["TestBroker"]]


@pytest.fixture(scope="session")
def weclaw_rabbitmq_url() -> Iterator[str]:
    """The AMQP URL of a RabbitMQ to test against."""
    from weclaw_mq.testing import services

    yield from _service(services.rabbitmq)


@pytest.fixture(scope="session")
def weclaw_redis_url() -> Iterator[str]:
    """The URL of a Redis to test against."""
    from weclaw_mq.testing import services

    yield from _service(services.redis)


def _service(find: Callable[[], AbstractContextManager[str]]) -> Iterator[str]:
    from weclaw_mq.testing.services import ServiceMissing

    with ExitStack() as stack:
        missing: str | None = None
        try:
            url = stack.enter_context(find())
        except ServiceMissing as e:
            missing = str(e)
        if missing is not None:
            # Outside the except block: one line, without the exception it came from.
            pytest.fail(missing, pytrace=False)
        yield url


async def _open_brokers() -> AsyncIterator[BrokerFactory]:
    """``await weclaw_test_broker(app, *more_apps, concurrency=None)``: an open ``TestBroker``
    for the apps, closed (and the apps given back their own broker and stores) after the
    test."""
    from weclaw_mq.testing.broker import TestBroker

    async with AsyncExitStack() as stack:

        async def open_broker(app: App, *more: App, **options: Any) -> TestBroker:
            return await stack.enter_async_context(TestBroker(app, *more, **options))

        yield open_broker


def _needs_pytest_asyncio() -> BrokerFactory:
    pytest.fail(
        "weclaw_test_broker is async and needs pytest-asyncio: "
        "pip install 'weclaw-mq[testing]' (or pytest-asyncio)",
        pytrace=False,
    )


# Without pytest-asyncio the fixture says what is missing, and nothing else breaks.
weclaw_test_broker: Any
if importlib.util.find_spec("pytest_asyncio") is not None:
    import pytest_asyncio

    weclaw_test_broker = pytest_asyncio.fixture(_open_brokers, name="weclaw_test_broker")
else:
    weclaw_test_broker = pytest.fixture(_needs_pytest_asyncio, name="weclaw_test_broker")

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

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ..app import App
    from .broker import TestBroker

BrokerFactory = Callable[..., Awaitable["TestBroker"]]


@pytest.fixture(scope="session")
def weclaw_rabbitmq_url() -> Iterator[str]:
    """The AMQP URL of a RabbitMQ to test against."""
    from . import services

    try:
        with services.rabbitmq() as url:
            yield url
    except services.ServiceMissing as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def weclaw_redis_url() -> Iterator[str]:
    """The URL of a Redis to test against."""
    from . import services

    try:
        with services.redis() as url:
            yield url
    except services.ServiceMissing as e:
        pytest.fail(str(e), pytrace=False)


async def _brokers() -> AsyncIterator[BrokerFactory]:
    from contextlib import AsyncExitStack

    from .broker import TestBroker

    async with AsyncExitStack() as stack:

        async def open_broker(app: App, *more: App, **options: Any) -> TestBroker:
            return await stack.enter_async_context(TestBroker(app, *more, **options))

        yield open_broker


try:
    import pytest_asyncio
except ImportError:  # the fixture then says what is missing, and nothing else breaks

    @pytest.fixture
    def weclaw_test_broker() -> BrokerFactory:
        pytest.fail(
            "weclaw_test_broker is async and needs pytest-asyncio: "
            "pip install 'weclaw-mq[testing]' (or pytest-asyncio)",
            pytrace=False,
        )
else:

    @pytest_asyncio.fixture
    async def weclaw_test_broker() -> AsyncIterator[BrokerFactory]:
        """``await weclaw_test_broker(app, *more_apps, concurrency=None)``: an open
        ``TestBroker`` for the apps, closed (and the apps given back their own broker and
        stores) after the test."""
        async for factory in _brokers():
            yield factory

"""The LLM layer's shared state in Redis for one App: the limits' counter (``Limiter``), the
cost ledger and the models' health. Opened and closed with the App's lifespan (a worker opens
it once per process, before its first delivery, and closes it after its drain), each only
when a handler needs it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.llm.limiting import Limiter
from weclaw_mq.settings import Settings
from weclaw_mq.state.cost_ledger import CostLedger, ledger_of
from weclaw_mq.state.model_health import ModelHealth, health_of


class ModelResources:
    """An App's limiter, cost ledger and models' health: None until opened, and each None
    when no handler of the App needs it.

    Args:
        name: The App's name (its ledger's and models' keys), read when it opens.
        settings: The App's settings.
        prices: Whether the App has prices (its runs are costed), read when it opens.
        handlers: The App's handlers, read when the lifespan opens (all registered by then).
        store: The App's task store, read when the lifespan opens.
    """

    def __init__(
        self,
        name: Callable[[], str],
        settings: Settings,
        prices: Callable[[], bool],
        handlers: Callable[[], Iterable[HandlerSpec]],
        store: Callable[[], Any],
    ) -> None:
        self._name = name
        self._settings = settings
        self._prices = prices
        self._handlers = handlers
        self._store = store
        # Off for the test kit (``weclaw_mq.testing``), which runs no LLM feature (no Redis).
        self.used = True
        self.limiter: Limiter | None = None
        self.ledger: CostLedger | None = None
        self.health: ModelHealth | None = None

    async def opened(self) -> AsyncIterator[ModelResources]:
        """The lifespan's resource: open what the handlers need, close it at the end."""
        if not self.used:
            yield self
            return
        specs = list(self._handlers())
        store = self._store()
        settings = self._settings
        if self._prices():
            self.ledger = ledger_of(
                store,
                self._name(),
                usage_ttl_s=settings.result_ttl_s,
                days_kept=settings.cost_days_kept,
            )
        if any(s.fallback is not None for s in specs):
            self.health = health_of(store, self._name())
        if any(s.limits or s.cap is not None for s in specs):  # a cap reserves there
            self.limiter = Limiter.open(settings)
        try:
            yield self
        finally:
            limiter, self.limiter = self.limiter, None
            self.ledger = self.health = None
            if limiter is not None:
                await limiter.close()

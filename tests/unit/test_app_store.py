"""How an App gets its TaskStore: its own from settings, or the one it is given."""

from __future__ import annotations

import pytest

import weclaw_mq
from weclaw_mq import App, ConfigurationError, MemoryTaskStore, Settings, TaskStore


def test_result_store_is_still_importable_as_the_task_store_protocol() -> None:
    assert weclaw_mq.ResultStore is TaskStore
    assert {"TaskStore", "MemoryTaskStore", "ResultStore"} <= set(dir(weclaw_mq))


def test_a_given_store_serves_claims_and_records() -> None:
    store = MemoryTaskStore()
    app = App("t", store=store)
    assert app.store is store and app.results is store


def test_with_results_off_the_store_serves_claims_only() -> None:
    store = MemoryTaskStore()
    app = App("t", settings=Settings(results_enabled=False), store=store)
    assert app.store is store
    assert app.results is None


def test_with_results_off_and_no_guarded_handler_no_store_is_opened() -> None:
    app = App("t", settings=Settings(results_enabled=False))

    @app.handler("plain", idempotent=False)
    async def plain(task: dict[str, int]) -> None:
        return None

    assert app.store is None


async def test_result_store_is_the_former_name_of_store() -> None:
    store = MemoryTaskStore()
    with pytest.deprecated_call():
        app = App("t", result_store=store)
    assert app.store is store
    with pytest.raises(ConfigurationError):
        App("t", store=store, result_store=MemoryTaskStore())
    await app.close()

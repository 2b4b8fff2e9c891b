"""A store method's docstring is written once, on the protocol it implements.

``MemoryTaskStore`` and ``RedisTaskStore`` (and the stream stores, ``MemoryStreamStore`` and
``RedisStreamStore``) name the protocols they implement as their bases, and keep no copy of
those methods' docstrings: the API page shows the protocol's (mkdocs.yml
loads griffe-inherited-docstrings; tests/unit/test_docstring_style.py reads them the same way),
and the page's markdown copy (docs/site_files.py) gets it from ``inspect.getdoc``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from weclaw_mq.state.memory import MemoryTaskStore
from weclaw_mq.state.protocol import RecordsSoon, TaskStore
from weclaw_mq.state.redis import RedisTaskStore
from weclaw_mq.state.reuse import FingerprintStore
from weclaw_mq.state.task_index import TaskIndex
from weclaw_mq.state.workflow_records import HasWorkflows
from weclaw_mq.streaming.memory import MemoryStreamStore
from weclaw_mq.streaming.protocol import StreamStore
from weclaw_mq.streaming.redis import RedisStreamStore

PROTOCOLS = (TaskStore, TaskIndex, FingerprintStore, RecordsSoon, HasWorkflows, StreamStore)
STORES = (MemoryTaskStore, RedisTaskStore)
STREAM_STORES = (MemoryStreamStore, RedisStreamStore)


def _methods(protocol: type) -> list[str]:
    return [
        name
        for name in vars(protocol)
        if not name.startswith("_") and callable(vars(protocol)[name])
    ]


def implemented() -> Iterator[tuple[type, type, str]]:
    """(store, protocol, method name) of each protocol method a store implements."""
    for store in STORES + STREAM_STORES:
        for protocol in PROTOCOLS:
            if protocol in store.__mro__:
                for name in _methods(protocol):
                    yield store, protocol, name


def _own(store: type, name: str) -> object:
    """The function the store runs for ``name`` (defined on it or on a class it inherits)."""
    for cls in store.__mro__:
        if name in vars(cls):
            return vars(cls)[name]
    raise AttributeError(name)


@pytest.mark.parametrize("store", STORES, ids=lambda s: s.__name__)
def test_each_store_names_the_protocols_it_implements(store: type) -> None:
    bases = set(store.__mro__)
    assert {TaskStore, TaskIndex, FingerprintStore, HasWorkflows} <= bases
    assert (RecordsSoon in bases) is (store is RedisTaskStore)


@pytest.mark.parametrize("store", STREAM_STORES, ids=lambda s: s.__name__)
def test_each_stream_store_names_stream_store_as_its_base(store: type) -> None:
    assert StreamStore in store.__mro__


@pytest.mark.parametrize(
    ("store", "protocol", "name"),
    list(implemented()),
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_a_store_method_shows_the_protocols_docstring_and_keeps_no_copy(
    store: type, protocol: type, name: str
) -> None:
    function = _own(store, name)
    defined_on = next(cls for cls in store.__mro__ if name in vars(cls))
    assert defined_on not in PROTOCOLS, f"{store.__name__}.{name} is the protocol's stub"
    function = getattr(function, "__wrapped__", function)  # holding: a contextmanager
    assert function.__doc__ is None, f"{defined_on.__name__}.{name} repeats a docstring"
    written = inspect.getdoc(vars(protocol)[name])
    assert written, f"{protocol.__name__}.{name} has no docstring"
    assert inspect.getdoc(getattr(store, name)) == written

"""``weclaw_mq.__all__`` is the common path (what a handler, a worker and a producer need);
the error tree lives in ``weclaw_mq.errors``, and every name the package exported before stays
importable from it, as the very same object."""

from __future__ import annotations

import inspect

import weclaw_mq
from weclaw_mq import errors

# What the package exported before the front door shrank (weclaw_mq 0.1.0).
EXPORTED_BEFORE = {
    "BatchPublishError",
    "BrokerUnavailableError",
    "ConfigurationError",
    "ConfirmTimeoutError",
    "ConnectionLostError",
    "IdempotencyConflictError",
    "InvalidPriorityError",
    "MessageEncodingError",
    "PayloadError",
    "PayloadTooLargeError",
    "PayloadValidationError",
    "PublishFailedError",
    "PublishNackedError",
    "ResultStore",
    "ResultTimeoutError",
    "StateCommandError",
    "StateUnavailableError",
    "StreamLimitError",
    "StreamWriteError",
    "TopologyConflictError",
    "UnroutableError",
}


def test_the_front_door_is_the_common_path() -> None:
    names = set(weclaw_mq.__all__)
    assert {"App", "Context", "Worker", "Settings", "Reject", "Retry", "WeclawMQError"} <= names
    assert {"RetryPolicy", "Priority", "Limit", "Breaker", "TaskStore", "StreamStore"} <= names
    assert len(names) <= 25, sorted(names)
    # Of the error tree, only its root: the rest is weclaw_mq.errors.
    tree = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, Exception)}
    assert names & tree == {"WeclawMQError"}


def test_every_name_exported_before_is_still_importable_as_the_same_object() -> None:
    for name in EXPORTED_BEFORE - {"ResultStore"}:
        assert getattr(weclaw_mq, name) is getattr(errors, name), name
    assert weclaw_mq.ResultStore is weclaw_mq.TaskStore
    for name in weclaw_mq.__all__:
        assert hasattr(weclaw_mq, name), name

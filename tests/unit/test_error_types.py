"""The error types written into ``x-weclaw-error-type``: a pinned, documented list.

These names are part of the wire format (docs/reference/errors.md): operators filter dead
letters on them. Changing one here means changing docs/reference/errors.md and telling
operators; moving or renaming a class must not change any.
"""

from __future__ import annotations

import pytest

from weclaw_mq import errors
from weclaw_mq.admin.dlq_message import read_dead_letter
from weclaw_mq.contract import headers as h
from weclaw_mq.errors import ConfigurationError, HandlerTimeout, WeclawMQError
from weclaw_mq.policy.breaker import UpstreamDown
from weclaw_mq.policy.failures import error_class, error_type, stable_error_type, stable_error_types
from weclaw_mq.policy.signals import Reject, Retry

# docs/reference/errors.md's table, in its order.
DOCUMENTED = [
    "weclaw_mq.Reject",
    "weclaw_mq.Retry",
    "weclaw_mq.UpstreamDown",
    "weclaw_mq.UndecodableBody",
    "weclaw_mq.InvalidPayload",
    "weclaw_mq.UnserialisableResult",
    "weclaw_mq.HandlerTimeout",
    "weclaw_mq.HandlerAbandoned",
    "weclaw_mq.WorkerCrashLoop",
    "weclaw_mq.TaskExpired",
    "weclaw_mq.BudgetExceeded",
    "weclaw_mq.ResultNotStored",
    "weclaw_mq.WorkerError",
    "weclaw_mq.WeclawMQError",
    "weclaw_mq.ConfigurationError",
    "weclaw_mq.InvalidPriorityError",
    "weclaw_mq.StartupFailedError",
    "weclaw_mq.ResourceUnavailableError",
    "weclaw_mq.PayloadError",
    "weclaw_mq.PayloadTooLargeError",
    "weclaw_mq.PayloadValidationError",
    "weclaw_mq.MessageEncodingError",
    "weclaw_mq.IdempotencyConflictError",
    "weclaw_mq.TopologyConflictError",
    "weclaw_mq.ResultTimeoutError",
    "weclaw_mq.StateUnavailableError",
    "weclaw_mq.StateCommandError",
    "weclaw_mq.StreamLimitError",
    "weclaw_mq.StreamWriteError",
    "weclaw_mq.StepError",
    "weclaw_mq.PublishFailedError",
    "weclaw_mq.BrokerUnavailableError",
    "weclaw_mq.PublishNackedError",
    "weclaw_mq.UnroutableError",
    "weclaw_mq.ConfirmTimeoutError",
    "weclaw_mq.ConnectionLostError",
    "weclaw_mq.BatchPublishError",
    "weclaw_mq.OutboxError",
    "weclaw_mq.OutboxFullError",
    "weclaw_mq.OutboxUnusableError",
]


def _ours() -> list[type[BaseException]]:
    tree = [
        v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, WeclawMQError)
    ]
    return [Reject, Retry, UpstreamDown, *tree]


def test_stable_error_types_lists_ours_and_never_a_users_subclass() -> None:
    class Mine(HandlerTimeout):
        error_type = "mine.Timeout"  # a user's class, defined outside weclaw_mq

    assert stable_error_types() == frozenset(DOCUMENTED)
    assert "mine.Timeout" not in stable_error_types()


def test_every_exception_of_ours_has_its_own_documented_error_type() -> None:
    names = []
    for kind in _ours():
        own = kind.__dict__.get("error_type")
        assert isinstance(own, str), f"{kind.__name__} has no error_type of its own"
        names.append(own)
    assert len(set(names)) == len(names), "two classes share an error type"
    assert sorted(names) == sorted(DOCUMENTED)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (HandlerTimeout("late"), "weclaw_mq.HandlerTimeout"),
        (Reject("no"), "weclaw_mq.Reject"),
        (Retry("busy"), "weclaw_mq.Retry"),
        (RuntimeError("down"), "RuntimeError"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
    ],
)
def test_the_error_type_is_the_stable_name_not_the_module_path(
    error: BaseException, expected: str
) -> None:
    assert error_type(error) == expected


def test_a_users_subclass_of_our_error_is_named_by_its_own_class() -> None:
    class QuotaSpent(ConfigurationError):
        pass

    assert error_type(QuotaSpent("x")) == "QuotaSpent"


def test_a_users_class_with_an_error_type_attribute_is_not_taken_for_ours() -> None:
    class ApiError(Exception):
        error_type = "rate_limit"

    assert error_type(ApiError("x")) == "ApiError"


def test_the_module_path_is_kept_beside_it_for_people() -> None:
    assert error_class(RuntimeError()) == "builtins.RuntimeError"
    assert error_class(HandlerTimeout()) == f"{HandlerTimeout.__module__}.HandlerTimeout"


@pytest.mark.parametrize(
    ("written", "stable"),
    [
        # Written before stable names: module.QualifiedName.
        ("builtins.RuntimeError", "RuntimeError"),
        ("weclaw_mq.process.HandlerTimeout", "weclaw_mq.HandlerTimeout"),
        ("weclaw_mq.handler.UndecodableBody", "weclaw_mq.UndecodableBody"),
        ("weclaw_mq.signals.Reject", "weclaw_mq.Reject"),
        ("myapp.llm.Client.RateLimited", "RateLimited"),
        # Stable names read as themselves.
        ("RuntimeError", "RuntimeError"),
        ("weclaw_mq.HandlerTimeout", "weclaw_mq.HandlerTimeout"),
        ("", ""),
    ],
)
def test_an_old_style_error_type_reads_as_the_stable_name(written: str, stable: str) -> None:
    assert stable_error_type(written) == stable


def test_a_dead_letter_from_before_stable_names_is_read_with_the_stable_name() -> None:
    letter = read_dead_letter(
        "t-1",
        {h.DEAD_LETTER_REASON: "rejected", h.ERROR_TYPE: "weclaw_mq.signals.Reject"},
        b"{}",
    )
    assert letter.error_type == "weclaw_mq.Reject"
    assert letter.headers[h.ERROR_TYPE] == "weclaw_mq.signals.Reject"  # shown as it came

"""The exception tree: what one ``except`` catches, and which failures stored nothing."""

from __future__ import annotations

import pytest

from weclaw_mq import errors
from weclaw_mq.errors import (
    STORED_NOTHING,
    BrokerUnavailableError,
    ConfirmTimeoutError,
    ConnectionLostError,
    PublishFailedError,
    PublishNackedError,
)


def test_an_unavailable_broker_is_a_publish_that_failed() -> None:
    with pytest.raises(PublishFailedError):
        raise BrokerUnavailableError("no broker", queue="q", task_id="t-1")


def test_an_unavailable_broker_raised_by_a_connect_names_no_task() -> None:
    error = BrokerUnavailableError("cannot connect to RabbitMQ at amqp://h:5672/")
    assert error.queue is None and error.task_id is None
    assert str(error) == "cannot connect to RabbitMQ at amqp://h:5672/"


def test_failures_that_may_have_stored_the_task_are_not_listed_as_storing_nothing() -> None:
    assert BrokerUnavailableError in STORED_NOTHING
    assert PublishNackedError in STORED_NOTHING
    for maybe_stored in (ConfirmTimeoutError, ConnectionLostError):
        assert not issubclass(maybe_stored, STORED_NOTHING)


def test_every_error_derives_from_the_root() -> None:
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, errors.WeclawMQError), value

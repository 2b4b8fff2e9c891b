"""Which model an attempt of a fallback chain calls (``policy.fallback.choose``), and what a
``Fallback`` refuses at import."""

from __future__ import annotations

import pytest

from weclaw_mq import ConfigurationError
from weclaw_mq.policy.fallback import Fallback, choose

CHAIN = Fallback(["a", "b", "c"])


def test_a_new_task_gets_the_first_model_that_is_up() -> None:
    assert choose(CHAIN, [], {}, 1000) == "a"
    assert choose(CHAIN, [], {"a": 2000}, 1000) == "b"
    assert choose(CHAIN, [], {"a": 500}, 1000) == "a"  # its down time has passed: back first


def test_a_retry_moves_down_the_list_then_starts_over_when_all_were_tried() -> None:
    assert choose(CHAIN, ["a"], {}, 0) == "b"
    assert choose(CHAIN, ["a", "b"], {}, 0) == "c"
    assert choose(CHAIN, ["a", "b", "c"], {}, 0) == "a"
    assert choose(CHAIN, ["a", "b", "c"], {"a": 10}, 0) == "b"


def test_every_model_down_answers_the_wait_until_the_first_is_back() -> None:
    assert choose(CHAIN, [], {"a": 3000, "b": 1500, "c": 9000}, 1000) == 500


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"models": []}, "a list of model names"),
        ({"models": "a"}, "a list of model names"),
        ({"models": ["a", "a"]}, "repeat a name"),
        ({"models": ["a"], "failures": 0}, "failures must be an int >= 1"),
        ({"models": ["a"], "cool_down_s": 0}, "cool_down_s must be a number of seconds > 0"),
    ],
)
def test_a_chain_that_cannot_work_is_refused(options: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        Fallback(**options)  # type: ignore[arg-type]

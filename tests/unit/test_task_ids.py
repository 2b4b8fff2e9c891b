"""The one rule for caller-chosen task ids, shared by the example API and ``weclaw-mq publish``."""

from __future__ import annotations

import re

import pytest

from weclaw_mq.contract.task_ids import TASK_ID_PATTERN, validate_task_id
from weclaw_mq.errors import ConfigurationError


@pytest.mark.parametrize(
    "good",
    ["a", "0", "order-42", "user:7.task_1", "A" * 128, "3f2b9c1e-6d1a-4c7e-9f00-1b2c3d4e5f60"],
)
def test_short_ids_of_a_queue_names_alphabet_are_task_ids(good: str) -> None:
    assert validate_task_id(good) == good
    assert re.fullmatch(TASK_ID_PATTERN, good)


@pytest.mark.parametrize(
    "bad",
    ["", "has space", "-leading-dash", ".dot", "a" * 129, "brace{tag}", "é", "a\nb", 42, None],
)
def test_anything_else_is_refused_saying_the_rule(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="1 to 128 of letters, digits"):
        validate_task_id(bad)
    if isinstance(bad, str):
        assert re.fullmatch(TASK_ID_PATTERN, bad) is None

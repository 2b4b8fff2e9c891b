"""What a caller-chosen task id may look like, in one place for every front door.

A task id becomes the AMQP ``message_id`` and part of Redis keys (``naming``), so producers
that take one from outside (the example API's ``Idempotency-Key``, ``weclaw-mq publish
--task-id``) accept only a short id of a queue name's alphabet: 1 to 128 characters, letters,
digits and ``_.:-``, starting with a letter or digit. ``App.publish`` itself takes any id AMQP
can carry (``message.check_encodable``): existing callers' ids are not narrowed, and what
names a task after it was published (``App.cancel``) takes the same ids (``check_task_id``).
"""

from __future__ import annotations

import re

from weclaw_mq.contract.message import check_task_id_encodable
from weclaw_mq.errors import ConfigurationError, MessageEncodingError

# A string (FastAPI's ``Header(pattern=...)`` wants one) and its compiled twin below.
TASK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$"
TASK_ID_RULE = "1 to 128 of letters, digits and '_.:-', starting with a letter or digit"
_TASK_ID_RE = re.compile(TASK_ID_PATTERN)


def validate_task_id(task_id: object) -> str:
    """``task_id`` if it matches ``TASK_ID_PATTERN``, else ``ConfigurationError`` saying why."""
    if not isinstance(task_id, str) or not _TASK_ID_RE.fullmatch(task_id):
        raise ConfigurationError(f"task id {task_id!r} must be {TASK_ID_RULE}")
    return task_id


def check_task_id(task_id: object) -> None:
    """``ConfigurationError`` saying why, unless ``App.publish`` could have published a task
    under ``task_id`` (a str, not empty, not over AMQP's 255 bytes, printable)."""
    if task_id == "":
        raise ConfigurationError("the task id is empty")
    try:
        check_task_id_encodable(task_id)
    except MessageEncodingError as e:
        raise ConfigurationError(str(e)) from None

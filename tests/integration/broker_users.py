"""RabbitMQ users of one test's own on the tests' broker, made and removed with rabbitmqctl
(on the node that serves WECLAW_MQ_AMQP_URL: tests.broker_ctl).

Names are unique per call (``weclaw-test-<hex>``) and every user is deleted on every exit
path; no other user (guest above all) is ever changed.
"""

from __future__ import annotations

import contextlib
import shlex
import uuid
from collections.abc import Iterator
from urllib.parse import quote, urlsplit, urlunsplit

from tests.broker_ctl import broker_ctl
from weclaw_mq.admin.permissions import Grant, set_permissions_line, vhost_of


def url_as(broker_url: str, user: str, password: str) -> str:
    """``broker_url`` with these credentials in place of its own."""
    parts = urlsplit(broker_url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def apply_line(line: str, user: str) -> None:
    """Run a ``rabbitmqctl set_permissions`` line, only ever for ``user`` (one of ours)."""
    args = shlex.split(line)
    assert args[:2] == ["rabbitmqctl", "set_permissions"] and user in args, line
    broker_ctl(*args[1:])


@contextlib.contextmanager
def broker_user(
    broker_url: str, grant: Grant | None = None, *, password: str | None = None
) -> Iterator[tuple[str, str]]:
    """(user name, its URL): a new user on the test broker's vhost with ``grant`` (none yet
    when None: apply a printed line with ``apply_line``)."""
    user = f"weclaw-test-{uuid.uuid4().hex[:10]}"
    password = password or uuid.uuid4().hex
    broker_ctl("add_user", user, password)
    try:
        if grant is not None:
            apply_line(set_permissions_line(user, vhost_of(broker_url), grant), user)
        yield user, url_as(broker_url, user, password)
    finally:
        broker_ctl("delete_user", user)

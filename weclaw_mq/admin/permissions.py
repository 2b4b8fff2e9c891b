"""The least RabbitMQ permissions each role of one app needs, as ``rabbitmqctl`` lines.

RabbitMQ grants a user three regular expressions per vhost, matched against resource names:
configure (declare, delete), write (publish to an exchange, bind a queue) and read (consume,
get, purge). What each of our roles does (checked on RabbitMQ 3.10 by
``tests/integration/test_permissions.py``):

- operator (``weclaw-mq declare``, the DLQ tools): declares every queue of the app (a queue
  with a dead-letter target also needs read on it), reads the DLQs, publishes copies back
  (requeue, the DLQ's rotation);
- worker: reads its work queues (and their priority lanes) only; publishes retries, parked
  duplicates and dead letters; needs no configure when the topology exists
  (``topology.declare`` then checks each queue with a passive declare, which RabbitMQ allows
  without any permission);
- producer: publishes only.

Every publish of ours goes through the default exchange, or (a task parked for a delay)
through the fanout exchange of one of the vhost's shared delay queues
(``topology.delay_exchanges``, named as the queue). RabbitMQ checks a publish against the
exchange alone (``amq.default``), never the queue the routing key names: a user who may
publish may publish to ANY queue of the vhost (a delay queue's exchange, too, dead-letters by
the routing key to any queue bound to the return exchange). Reads are limited per queue
here; writes are limited only by giving each app (or each trust
domain) its own vhost.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import unquote, urlsplit

from weclaw_mq.contract.naming import RETURN_EXCHANGE, UNROUTABLE
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.wire.topology import delay_exchanges, ladder_declarations, queue_declarations

# The default exchange's name in permission checks.
DEFAULT_EXCHANGE_RESOURCE = "amq.default"
NOTHING = "^$"  # matches no resource name (RabbitMQ's documented way to grant nothing)


class Role(StrEnum):
    WORKER = "worker"
    PRODUCER = "producer"
    OPERATOR = "operator"


@dataclass(frozen=True)
class Grant:
    configure: str
    write: str
    read: str


def any_of(names: Iterable[str]) -> str:
    """A regex matching exactly these names (escaped), or nothing when there are none."""
    unique = sorted(set(names))
    if not unique:
        return NOTHING
    return "^(" + "|".join(re.escape(n) for n in unique) + ")$"


def grant(role: Role, specs: Iterable[HandlerSpec]) -> Grant:
    specs = list(specs)
    # Q and its priority lanes: the lanes of an unknown version, which are every lane any
    # version may have (a worker consumes each lane its broker gets).
    work = [lane for s in specs for lane in s.queue_spec().lane_queues(None)]
    # Delayed publishes and parked tasks go through the delay queues' exchanges.
    publish = any_of(
        [DEFAULT_EXCHANGE_RESOURCE, *(x for s in specs for x in delay_exchanges(s.queue_spec()))]
    )
    if role is Role.PRODUCER:
        return Grant(configure=NOTHING, write=publish, read=NOTHING)
    if role is Role.WORKER:
        return Grant(configure=NOTHING, write=publish, read=any_of(work))
    # The vhost's shared ladder too: its queues, their exchanges, the return exchange and its
    # alternate exchange (declared, bound and dead-lettered to by ``weclaw-mq declare``).
    every = [name for s in specs for name, _ in queue_declarations(s.queue_spec())]
    every += [name for name, _ in ladder_declarations(s.queue_spec() for s in specs)]
    every += [RETURN_EXCHANGE, UNROUTABLE]
    return Grant(
        configure=any_of(every),
        write=any_of([DEFAULT_EXCHANGE_RESOURCE, *every]),
        # The DLQ tools read the DLQs; and RabbitMQ asks read on a queue declared with a
        # dead-letter target (all of ours but the DLQ), beside write on that exchange.
        # Binding a delay queue to its exchange (same name) asks write on the queue and read
        # on the exchange: both in ``every``.
        read=any_of(every),
    )


def vhost_of(amqp_url: str) -> str:
    """The vhost an AMQP URL names ('/' when its path is empty, as aio-pika reads it)."""
    path = urlsplit(amqp_url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def set_permissions_line(user: str, vhost: str, g: Grant) -> str:
    args = ["rabbitmqctl", "set_permissions", "-p", vhost, user, g.configure, g.write, g.read]
    return " ".join(shlex.quote(a) for a in args)

"""Every name weclaw_mq gives on the broker and in Redis, derived from the handler queue ``Q``.

Ops tools find all queues and keys of a handler from its queue name alone, so no other module
builds a name by hand.
"""

from __future__ import annotations

import re

from weclaw_mq.errors import ConfigurationError

DLQ_SUFFIX = ".dlq"
RETRY_INFIX = ".retry."
# Where a handler with ``notify=True`` announces its tasks' final states (a work queue for the
# notification service, so not a reserved suffix: a handler consumes ``Q.results``).
RESULTS_SUFFIX = ".results"
# Lane queues of the higher priorities: ``Q.lane.high``, ``Q.lane.urgent`` (the NORMAL lane is
# Q itself). No handler queue may hold ".lane.", ".retry." or end in ".dlq", and a lane name
# ends in ".lane.<level>": so no derived name of one handler equals a name of another.
LANE_INFIX = ".lane."

# Redis key prefixes (the guard and the result store build keys only through these).
REDIS_PREFIX = "weclaw_mq"
GUARD_KEY_PREFIX = f"{REDIS_PREFIX}:guard"
STATE_KEY_PREFIX = f"{REDIS_PREFIX}:state"
LATEST_KEY_PREFIX = f"{REDIS_PREFIX}:latest"
DONE_CHANNEL_PREFIX = f"{REDIS_PREFIX}:done"
STREAM_KEY_PREFIX = f"{REDIS_PREFIX}:stream"
INBOX_KEY_PREFIX = f"{REDIS_PREFIX}:inbox"
INBOX_TRACE_KEY_PREFIX = f"{REDIS_PREFIX}:inbox-trace"
LIMIT_KEY_PREFIX = f"{REDIS_PREFIX}:limit"
CANCEL_KEY_PREFIX = f"{REDIS_PREFIX}:cancel"
BODY_KEY_PREFIX = f"{REDIS_PREFIX}:body"
# A task's timeline: one event per record write (state.task_index).
TIMELINE_KEY_PREFIX = f"{REDIS_PREFIX}:timeline"
# A task's memoized steps in one queue (ctx.step, state.steps): beside its record, same TTL.
STEPS_KEY_PREFIX = f"{REDIS_PREFIX}:steps"
# A long run's watch (worker.long_runs): the generation of its live watch copy, or minus it
# once the run ended (state.watches).
WATCH_KEY_PREFIX = f"{REDIS_PREFIX}:watch"
# A workflow (weclaw_mq.workflows): its plan and progress, and its parts' ends, hash-tagged
# on the workflow id; and the one sorted set of workflow deadlines every worker sweeps.
WORKFLOW_KEY_PREFIX = f"{REDIS_PREFIX}:workflow"
WORKFLOW_PARTS_KEY_PREFIX = f"{REDIS_PREFIX}:workflow-parts"
WORKFLOW_DEADLINES_KEY = f"{REDIS_PREFIX}:workflow-deadlines"
# One per worker process (its task store): a guard claim names it, and lapses with it.
HEARTBEAT_KEY_PREFIX = f"{REDIS_PREFIX}:alive"
# One channel for every cancel request (weclaw_mq.state.cancel_records): each worker holds one
# subscription, not one per task it runs, and a PUBLISH reaches every node of a cluster.
CANCEL_CHANNEL = f"{REDIS_PREFIX}:cancels"

# The broker names shared by every handler of a vhost (``topology.ladder_declarations``):
#
#     weclaw_mq.delay.<delay>     a delay queue (x-message-ttl) and the fanout exchange in front
#     weclaw_mq.return            the direct exchange a delay queue dead-letters to; every work
#                                 queue (and lane) is bound to it by its own name
#     weclaw_mq.unroutable        its alternate exchange (fanout), bound to the parking queue
#     weclaw_mq.unroutable.dlq    the parking queue: a delayed task whose queue is gone; read
#                                 and requeued by the DLQ tools as the DLQ of "weclaw_mq.unroutable"
#     weclaw_mq.midnight          a task parked until the next UTC midnight (a tenant past its
#                                 daily cap), in one hop: a queue (per-message TTL) and the
#                                 fanout exchange in front; declared for handlers with such a cap
#
# No handler queue may start with "weclaw_mq.", so none of these is a handler's name.
SHARED_PREFIX = "weclaw_mq."
# The queue names of a workflow's own record (``App.status(workflow id)``): names no handler
# may have (the shared prefix), so a workflow's record never meets a task's.
CHAIN_RECORD_QUEUE = f"{SHARED_PREFIX}chain"
GROUP_RECORD_QUEUE = f"{SHARED_PREFIX}group"
LADDER_INFIX = "delay."
RETURN_EXCHANGE = f"{SHARED_PREFIX}return"
UNROUTABLE = f"{SHARED_PREFIX}unroutable"
# Every message in it is due at the same instant (the next UTC midnight), so per-message TTLs
# hold none behind another (RabbitMQ expires only at the head).
MIDNIGHT_QUEUE = f"{SHARED_PREFIX}midnight"


def is_shared_name(name: str) -> bool:
    """Whether ``name`` is one of the vhost's shared queues or exchanges (the delay ladder, the
    return exchange, the parking queue), which every app on the vhost uses: nothing of ours
    deletes them with an app's own queues."""
    return name.startswith(SHARED_PREFIX)


# Names we add beside Q must still fit AMQP's 255-byte limit.
_MAX_QUEUE_NAME = 200
_QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]*$")


def validate_queue_name(name: str) -> str:
    if not name or len(name.encode()) > _MAX_QUEUE_NAME:
        raise ConfigurationError(f"queue name {name!r} must be 1 to {_MAX_QUEUE_NAME} bytes long")
    if name.startswith("amq."):
        raise ConfigurationError(f"queue name {name!r}: names starting with 'amq.' are reserved")
    if not _QUEUE_NAME_RE.match(name):
        raise ConfigurationError(
            f"queue name {name!r} may hold only letters, digits and '_.:-', "
            "and must start with a letter or digit"
        )
    if name.startswith(SHARED_PREFIX):
        raise ConfigurationError(
            f"queue name {name!r}: names starting with '{SHARED_PREFIX}' are weclaw_mq's "
            "shared queues (the delay ladder, the parking queue); pick another name"
        )
    if name.endswith(DLQ_SUFFIX) or RETRY_INFIX in name or LANE_INFIX in name:
        raise ConfigurationError(
            f"queue name {name!r} looks like one of weclaw_mq's own derived queues "
            f"('{DLQ_SUFFIX}' / '{RETRY_INFIX}' / '{LANE_INFIX}'); pick another name"
        )
    return name


def dlq_name(queue: str) -> str:
    return f"{queue}{DLQ_SUFFIX}"


def delay_label(delay_ms: int) -> str:
    """``5000`` -> ``5s``, ``250`` -> ``250ms``: readable in the management UI."""
    if delay_ms % 1000 == 0:
        return f"{delay_ms // 1000}s"
    return f"{delay_ms}ms"


def ladder_queue_name(delay_ms: int) -> str:
    """The vhost's shared delay queue for ``delay_ms``, and the fanout exchange in front of
    it: a task is parked there with its lane as routing key and dead-letters back by it
    through ``RETURN_EXCHANGE`` (``topology.delay_queue_arguments``)."""
    return f"{SHARED_PREFIX}{LADDER_INFIX}{delay_label(delay_ms)}"


def parking_queue_name() -> str:
    """Where the shared ladder puts a task whose queue is gone: the DLQ of ``UNROUTABLE``."""
    return dlq_name(UNROUTABLE)


def retry_queue_name(queue: str, delay_ms: int) -> str:
    """The per-lane delay queue of ``queue`` (a handler queue or one of its lanes) of
    versions before the per-handler ones (``delay_queue_name``): it dead-letters back to
    ``queue`` by its x-dead-letter-routing-key. No longer declared nor published to; one left
    from an older version keeps returning what it holds, ``weclaw-mq stats`` still shows it
    and ``weclaw-mq migrate`` deletes it once empty."""
    return f"{queue}{RETRY_INFIX}{delay_label(delay_ms)}"


# The delay queues of handler queue Q shared by all its lanes, of the version before the
# vhost's shared ladder: ``Q.retry.lanes.<delay>`` (a queue and a fanout exchange of that
# name). ".retry." is reserved in handler names, so these can be no other handler's names,
# nor a per-lane ``<lane>.retry.<delay>`` (a delay label holds no dot).
SHARED_DELAY_INFIX = f"{RETRY_INFIX}lanes."


def delay_queue_name(queue: str, delay_ms: int) -> str:
    """The previous version's delay queue of handler queue ``queue`` for ``delay_ms`` (shared
    by its lanes; a fanout exchange of that name in front). No longer declared nor published
    to: it dead-letters what it still holds back by the task's routing key through the default
    exchange, ``weclaw-mq stats`` shows it and ``weclaw-mq migrate`` deletes it once empty."""
    return f"{queue}{SHARED_DELAY_INFIX}{delay_label(delay_ms)}"


def results_queue_name(queue: str) -> str:
    """The default results queue of ``queue`` (``notify=True``)."""
    return f"{queue}{RESULTS_SUFFIX}"


def lane_queue_name(queue: str, level: str) -> str:
    """The queue of priority ``level`` ("normal", "high", "urgent") of handler queue Q:
    NORMAL is Q itself, so producers and queues from before priorities keep working."""
    return queue if level == "normal" else f"{queue}{LANE_INFIX}{level}"


# The fair-share lanes of a handler with ``fair=`` (weclaw_mq.policy.fair_share): lane 0 is
# Q itself, lane i > 0 is ``Q.lane.f<i>``.
FAIR_LANE_MARK = "f"


def fair_lane_name(queue: str, index: int) -> str:
    """Fair-share lane ``index`` of handler queue Q: Q itself for 0, so a handler that turns
    fairness on keeps its queue and its producers that know nothing of it."""
    return queue if index == 0 else f"{queue}{LANE_INFIX}{FAIR_LANE_MARK}{index}"


def fair_lane_index(lane: str, queue: str) -> int | None:
    """The index of fair lane ``lane`` of Q (0 for Q), None for any other name."""
    if lane == queue:
        return 0
    mark = f"{queue}{LANE_INFIX}{FAIR_LANE_MARK}"
    digits = lane[len(mark) :] if lane.startswith(mark) else ""
    return int(digits) if digits.isdigit() and digits[0] != "0" else None


def source_lane(routing_key: str | None, queue: str) -> str:
    """The lane of handler queue ``queue`` a delivery came from: its routing key when that
    names one of Q's lanes (a lane is published to, and dead-lettered back to, by its own
    name through the default exchange), else Q."""
    if routing_key and routing_key.startswith(f"{queue}{LANE_INFIX}"):
        level = routing_key[len(queue) + len(LANE_INFIX) :]
        if level in ("high", "urgent") or fair_lane_index(routing_key, queue):
            return routing_key
    return queue


def handler_queue_of(name: str) -> str:
    """The handler queue Q a lane queue belongs to (Q itself for Q)."""
    head, sep, _ = name.partition(LANE_INFIX)
    return head if sep else name


# -- Redis keys of one task --------------------------------------------------------------
# A task's state lives per (queue, task id): a pipeline whose stages share a task id keeps one
# record and one guard key per stage. Layout, for queue Q and task id T:
#
#     weclaw_mq:guard:<len(Q)>:Q:{T}     the idempotency claim / done marker
#     weclaw_mq:state:<len(Q)>:Q:{T}     the task's record in Q (hash: status, state)
#     weclaw_mq:latest:{T}               the name of T's most recently written record
#     weclaw_mq:done:{T}                 pub/sub channel: some record of T became final
#     weclaw_mq:cancel:{T}               the cancel marker: a set of queues (or "*") whose
#                                        deliveries of T are acked unrun
#     weclaw_mq:body:<len(Q)>:Q:{T}      the fingerprint of the body first published as T to
#                                        Q with a task id of the caller's (state.reuse)
#     weclaw_mq:steps:<len(Q)>:Q:{T}     the task's memoized steps in Q (hash: one field per
#                                        step and occurrence; state.steps), expiring with
#                                        the record (every record write renews its TTL)
#
# Unambiguous whatever the characters: Q is read by its byte length, T runs from the brace
# after Q to the last character, so ("a:b", "c") and ("a", "b:c") never share a key. The
# braces are a Redis Cluster hash tag: every key of T hashes on (the start of) T alone, so
# one script may touch all of them on one node. That holds as long as Q has no '{' (which
# validate_queue_name guarantees for every handler queue) and the tag is not empty: Redis
# hashes a key whose tag is "{}" whole, so an empty T or one starting with '}' would spread
# its keys over the cluster (CROSSSLOT). Those ids, and ids starting with '{' (so that the
# layout stays unambiguous), get one more '{' in front of T: "{{}x}" for "}x", whose tag
# is "{". Every other id's keys are as they always were.


def _tagged(task_id: str) -> str:
    """``{T}``, T's hash tag, never empty (see above)."""
    if task_id[:1] in ("", "{", "}"):
        return f"{{{{{task_id}}}"
    return f"{{{task_id}}}"


def _task_key(prefix: str, queue: str, task_id: str) -> str:
    return f"{prefix}:{len(queue.encode())}:{queue}:{_tagged(task_id)}"


def guard_key(queue: str, task_id: str) -> str:
    return _task_key(GUARD_KEY_PREFIX, queue, task_id)


def heartbeat_key(worker_id: str) -> str:
    """The key that says a worker (one task store) is alive: its claims hold while it lasts."""
    return f"{HEARTBEAT_KEY_PREFIX}:{worker_id}"


def state_key(queue: str, task_id: str) -> str:
    return _task_key(STATE_KEY_PREFIX, queue, task_id)


def body_key(queue: str, task_id: str) -> str:
    """The fingerprint of the body first published as (queue, task id) (``state.reuse``)."""
    return _task_key(BODY_KEY_PREFIX, queue, task_id)


def steps_key(queue: str, task_id: str) -> str:
    """The task's memoized steps in ``queue`` (``ctx.step``): per queue, as its record is, so
    two pipeline stages sharing a task id never replay each other's steps."""
    return _task_key(STEPS_KEY_PREFIX, queue, task_id)


def watch_key(queue: str, task_id: str) -> str:
    """A long run's watch generation in ``queue`` (``state.watches``): beside its guard key,
    in its slot, so the claim reads it in the same step."""
    return _task_key(WATCH_KEY_PREFIX, queue, task_id)


def latest_key(task_id: str) -> str:
    return f"{LATEST_KEY_PREFIX}:{_tagged(task_id)}"


def done_channel(task_id: str) -> str:
    """Pub/sub channel that wakes ``result()`` waiters when a record of the task is final."""
    return f"{DONE_CHANNEL_PREFIX}:{_tagged(task_id)}"


def stream_key(task_id: str) -> str:
    """The task's event stream (a Redis Stream): attempt markers, chunks, the final event.
    Per task id, not per queue: ``app.stream`` is read by task id, like ``status``."""
    return f"{STREAM_KEY_PREFIX}:{_tagged(task_id)}"


# -- Redis keys of one session (a user or a conversation) ---------------------------------
#
#     weclaw_mq:inbox:{S}          the session's pending events (a Redis Stream)
#     weclaw_mq:inbox-trace:{S}    what the inbox lost: entries dropped when it was full
#
# Hash-tagged on the session id S like a task's keys on T: one script touches both.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9_.:@\-]{1,200}")


def validate_session_id(session_id: object) -> str:
    """A session id names Redis keys and travels in an AMQP header: 1 to 200 of letters,
    digits and ``_.:@-`` (no braces, which would break the key's hash tag)."""
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        raise ConfigurationError(
            f"session id {session_id!r} must be 1 to 200 of letters, digits and '_.:@-'"
        )
    return session_id


def session_id_or_none(value: object) -> str | None:
    """``value`` when it is a valid session id, else None, quietly (a header of a foreign
    publisher: ``validate_session_id`` says what is wrong with it)."""
    return value if isinstance(value, str) and SESSION_ID_RE.fullmatch(value) else None


def inbox_key(session_id: str) -> str:
    return f"{INBOX_KEY_PREFIX}:{{{session_id}}}"


def inbox_trace_key(session_id: str) -> str:
    return f"{INBOX_TRACE_KEY_PREFIX}:{{{session_id}}}"


def timeline_key(task_id: str) -> str:
    """The task's timeline (a list): one short JSON event per record write, of every queue,
    capped and expiring with the records; in the task's slot, so the record's own script
    appends to it."""
    return f"{TIMELINE_KEY_PREFIX}:{_tagged(task_id)}"


def cancel_key(task_id: str) -> str:
    """The set of queues (``*``: all) in which task ``task_id`` was cancelled."""
    return f"{CANCEL_KEY_PREFIX}:{_tagged(task_id)}"


# -- Redis keys of the worker registry (state.worker_registry, read by ``weclaw-mq inspect``) --
#
#     weclaw_mq:workers:{workers}       the index: every live worker's id, scored by the Redis
#                                       time (ms) its record lapses at
#     weclaw_mq:worker:{workers}:<W>    worker W's record (JSON: host, pid, queues, what it
#                                       runs now), expiring a few beats after its last
#
# Not the guard's ``heartbeat_key`` (one per task store, which claims name). Every key of the
# registry carries the one hash tag ``{workers}``: on a Redis Cluster they share a slot, so one
# script writes a record with its index entry, and one MGET reads every record.

# The worker registry's index: every live worker's id, scored by the Redis time (ms) at which
# its record lapses.
WORKER_INDEX_KEY = f"{REDIS_PREFIX}:workers:{{workers}}"
# One worker's record in the registry, beside the index in its slot.
WORKER_KEY_PREFIX = f"{REDIS_PREFIX}:worker:{{workers}}"


def worker_key(worker_id: str) -> str:
    """One worker's record in the worker registry (JSON: its host, pid, queues and the tasks
    it runs), written every ``worker_beat_s`` and lapsing three beats after the last."""
    return f"{WORKER_KEY_PREFIX}:{worker_id}"


# -- Redis keys of schedules (state.schedule_book, scheduling.scheduler) ----------------------
#
#     weclaw_mq:scheduler:{schedules}:<A>       app A's scheduler lease: the token of the one
#                                               scheduler that fires A's ticks, expiring
#     weclaw_mq:schedule:{schedules}:<A>:<S>    schedule S of app A (a hash): the last tick
#                                               handled, its task id, counts, paused
#
# One hash tag for all: on a Redis Cluster the lease and every schedule's record share a slot,
# so one script checks the lease and marks a tick (a scheduler that lost its lease marks
# nothing). A few writes per tick: no hot key.

SCHEDULER_LEASE_KEY_PREFIX = f"{REDIS_PREFIX}:scheduler:{{schedules}}"
SCHEDULE_KEY_PREFIX = f"{REDIS_PREFIX}:schedule:{{schedules}}"


def scheduler_lease_key(app: str) -> str:
    """The lease of app ``app``'s scheduler: the token of the replica that fires its ticks."""
    return f"{SCHEDULER_LEASE_KEY_PREFIX}:{app}"


def schedule_key(app: str, name: str) -> str:
    """Schedule ``name`` of app ``app``: its last handled tick, task id, counts and pause."""
    return f"{SCHEDULE_KEY_PREFIX}:{app}:{name}"


# -- Redis keys of costs (state.cost_ledger) ---------------------------------------------------
#
#     weclaw_mq:usage:{T}                  task T's model calls (a list of JSON: queue, attempt,
#                                          model, tenant, tokens, cost), beside T's records
#     weclaw_mq:costs:{costs}:<A>:<day>    app A's totals of one UTC day (a hash: cost in
#                                          millionths and tokens per tenant and per model,
#                                          cost and runs per queue)
#     weclaw_mq:cap:<A>:<day>:{t=<T>}:*    tenant T's reservations against its daily cap
#                                          (a token limit's keys: starts, tokens, total, ...)
#
# A day's totals share one hash tag: one HGETALL per day reads them; a few increments per
# model call, not per delivery.

USAGE_KEY_PREFIX = f"{REDIS_PREFIX}:usage"
COSTS_KEY_PREFIX = f"{REDIS_PREFIX}:costs:{{costs}}"


def usage_key(task_id: str) -> str:
    """Task ``task_id``'s model calls and their costs, every attempt's, in its own slot."""
    return f"{USAGE_KEY_PREFIX}:{_tagged(task_id)}"


def costs_key(app: str, day: str) -> str:
    """App ``app``'s cost and token totals of UTC day ``day`` (``YYYY-MM-DD``)."""
    return f"{COSTS_KEY_PREFIX}:{app}:{day}"


CAP_KEY_PREFIX = f"{REDIS_PREFIX}:cap"


def cap_keys(app: str, tenant: str, day: str) -> tuple[str, str, str, str, str]:
    """The (slots, starts, tokens, total, blocked) keys of tenant ``tenant``'s reservations
    against its cap on UTC day ``day``: a token limit's keys (``llm.limiting``), in one slot."""
    tag = "t=" + tenant.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    base = f"{CAP_KEY_PREFIX}:{len(app.encode())}:{app}:{day}:{{{tag}}}"
    return (f"{base}:slots", f"{base}:starts", f"{base}:tokens", f"{base}:total", f"{base}:blocked")


# -- Redis keys of model fallbacks (state.model_health) -----------------------------------------
#
#     weclaw_mq:models:{models}:<A>    app A's models' health (a hash: <model>:until, the epoch
#                                      ms it is down until; <model>:fails, failures in a row)

MODELS_KEY_PREFIX = f"{REDIS_PREFIX}:models:{{models}}"


def models_key(app: str) -> str:
    """App ``app``'s models' health: until when each is down, and its failures in a row."""
    return f"{MODELS_KEY_PREFIX}:{app}"


# -- Redis keys of fair share (state.fair_book) ----------------------------------------------
#
#     weclaw_mq:fair:{Q}:<Q>                    hash, per fair lane i: "r:<i>" its ready tasks
#                                               as a worker last counted them, "c:<i>" the
#                                               tasks landed that count covers, "l:<i>" the
#                                               tasks producers saw land there in all
#     weclaw_mq:fair:{Q}:<Q>:flying             sorted set: batches assigned, not yet landed
#                                               ("<lane>:<tasks>:<batch>:<i>", by deadline)
#     weclaw_mq:fair:{Q}:<Q>:tenant:<tenant>    hash: the tenant's "lane", its batch on its
#                                               way ("m") and its latest task's place ("p")
#
# In handler queue Q's own slot: a producer's assignment is one script over them.
FAIR_KEY_PREFIX = f"{REDIS_PREFIX}:fair"


def fair_key(queue: str) -> str:
    """Handler queue ``queue``'s fair lanes: how many tasks wait in each."""
    return f"{FAIR_KEY_PREFIX}:{{{queue}}}:{queue}"


def fair_flying_key(queue: str) -> str:
    """Handler queue ``queue``'s batches assigned to fair lanes and not yet landed there."""
    return f"{fair_key(queue)}:flying"


def fair_tenant_key(queue: str, tenant: str) -> str:
    """Where ``tenant``'s tasks of handler queue ``queue`` go, and whether any still wait.
    (``:tenant:``, not the earlier ``:t:`` string keys, which a day's TTL ends.)"""
    return f"{fair_key(queue)}:tenant:{tenant}"


def queue_key_pattern(prefix: str, queue: str) -> str:
    """A SCAN pattern for every key under ``prefix`` of ``queue`` (e.g. its guard keys)."""
    return f"{prefix}:{len(queue.encode())}:{queue}:{{*"


def task_keys(queue: str, task_id: str) -> list[str]:
    """The keys (queue, task id) owned as released (the wire snapshot holds this list), for
    cleanup by tests and operator scripts; beside them now its ``steps_key`` and
    ``watch_key``."""
    return [
        guard_key(queue, task_id),
        state_key(queue, task_id),
        latest_key(task_id),
        body_key(queue, task_id),
    ]


# -- Redis keys of the task index (state.task_index, state.redis_index) -------------------------
#
#     weclaw_mq:tasks:{tasks}               every indexed task, scored by the time (ms) its
#                                           first record in a queue was written
#     weclaw_mq:tasks:{tasks}:q:<Q>         the same, of handler queue Q only
#     weclaw_mq:tasks:{tasks}:s:<status>    the tasks whose record became <status>, for the
#                                           sparse statuses (dead_lettered, expired, cancelled)
#     weclaw_mq:tasks:{tasks}:queues        the queues that have an index (for the trim)
#
# A member is ``index_member(Q, T)``: "<len(Q)>:Q:T", read back by ``index_entry``. Every key
# of the index carries the one hash tag ``{tasks}``: on a Redis Cluster they share a slot, so
# one script adds an entry to all of them and one trims them together (the cost: that slot's
# node takes every index write, one O(log n) ZADD per task, far below what one node serves).
TASK_INDEX_KEY = f"{REDIS_PREFIX}:tasks:{{tasks}}"
TASK_INDEX_QUEUES_KEY = f"{TASK_INDEX_KEY}:queues"


def task_index_queue_key(queue: str) -> str:
    """The index of handler queue ``queue``'s tasks."""
    return f"{TASK_INDEX_KEY}:q:{queue}"


def task_index_status_key(status: str) -> str:
    """The index of the tasks whose record became ``status`` (a sparse status)."""
    return f"{TASK_INDEX_KEY}:s:{status}"


def index_member(queue: str, task_id: str) -> str:
    """(queue, task id) as a member of the task index."""
    return f"{len(queue.encode())}:{queue}:{task_id}"


def index_entry(member: str) -> tuple[str, str]:
    """(queue, task id) of an ``index_member``.

    Raises:
        ValueError: ``member`` is not one.
    """
    size, _, rest = member.partition(":")
    data = rest.encode()
    length = int(size)
    if data[length : length + 1] != b":":
        raise ValueError(f"not a task index member: {member!r}")
    return data[:length].decode(), data[length + 1 :].decode()


# -- Redis keys of a handler's limits (weclaw_mq.policy.limits) -----------------------------------
#
#     weclaw_mq:limit:<len(Q)>:Q:<i>:{k=<key>}:slots    running holders (sorted by lease end)
#     weclaw_mq:limit:<len(Q)>:Q:<i>:{k=<key>}:starts   recent starts (sorted by start time)
#     weclaw_mq:limit:<len(Q)>:Q:<i>:{k=<key>}:tokens   a token limit's tokens per recent start
#                                                       (a hash: holder -> tokens)
#     weclaw_mq:limit:<len(Q)>:Q:<i>:{k=<key>}:total    their sum
#     weclaw_mq:limit:<len(Q)>:Q:<i>:{k=<key>}:blocked  set while a 429's Retry-After runs
#
# <i> is the limit's position in the handler's ``limit=`` list; a global limit (no key
# function) has the tag {*}. '%', '{' and '}' in a key are %-escaped, so the tag is never
# empty and is always the whole key: every key of one limit and key hashes to one cluster slot.


def _limit_base(queue: str, index: int, key: str | None) -> str:
    if key is None:
        tag = "*"
    else:
        tag = "k=" + key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return f"{LIMIT_KEY_PREFIX}:{len(queue.encode())}:{queue}:{index}:{{{tag}}}"


def limit_keys(queue: str, index: int, key: str | None) -> tuple[str, str]:
    """The (slots, starts) keys of limit ``index`` of ``queue`` for ``key`` (None: global)."""
    base = _limit_base(queue, index, key)
    return f"{base}:slots", f"{base}:starts"


def workflow_key(workflow_id: str) -> str:
    """A workflow's plan and progress (a hash), in its id's hash slot."""
    return f"{WORKFLOW_KEY_PREFIX}:{_tagged(workflow_id)}"


def workflow_parts_key(workflow_id: str) -> str:
    """A group's parts that ended, by part index (a hash), in its id's hash slot."""
    return f"{WORKFLOW_PARTS_KEY_PREFIX}:{_tagged(workflow_id)}"


def token_keys(queue: str, index: int, key: str | None) -> tuple[str, str, str]:
    """The (tokens, total, blocked) keys of a token limit, in the slot of its ``limit_keys``."""
    base = _limit_base(queue, index, key)
    return f"{base}:tokens", f"{base}:total", f"{base}:blocked"

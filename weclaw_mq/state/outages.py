"""Redis failing, as the task store reports it: an outage (``StateUnavailableError``: waiting
helps) or a command Redis refuses (``StateCommandError``: the same command fails again)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from weclaw_mq.config.tls import describe_refusal
from weclaw_mq.errors import ConfigurationError, StateCommandError, StateUnavailableError

_T = TypeVar("_T")

# Redis's error replies that mean "not now" (a failover under way, memory full, a script still
# running, a dataset loading): waiting helps. Every other error reply is deterministic.
_TRANSIENT_REPLIES = frozenset(
    {
        *("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY"),
        *("OOM", "NOREPLICAS", "MISCONF", "MOVED", "ASK"),
    }
)


def state_unavailable(e: BaseException) -> StateUnavailableError | StateCommandError:
    """The error to raise for redis-py's ``e``: ``StateCommandError`` when Redis answered the
    command with a deterministic error (waiting will not help), else ``StateUnavailableError``."""
    if is_command_error(e):
        return StateCommandError(
            f"Redis refused a task-state command ({type(e).__name__}: {e}): not an outage, "
            "the same command fails again until its cause is fixed (a bug, an invalid "
            "setting, a missing ACL permission)"
        )
    refused = describe_refusal(e, "redis")
    if refused is not None:  # not an outage: waiting will not help, the settings must change
        return StateUnavailableError(f"cannot connect to Redis for task states: {refused}")
    return StateUnavailableError(
        f"Redis did not answer for task states ({type(e).__name__}: {e}); "
        "check WECLAW_MQ_REDIS_URL and that Redis is up"
    )


def is_state_failure(e: BaseException) -> bool:
    """Redis failing or not answering, as redis-py raises it (``REDIS_FAILURES``), checked
    without importing redis-py: a redis-py error exists only once redis-py was loaded."""
    if isinstance(e, (OSError, TimeoutError)):
        return True
    exceptions = sys.modules.get("redis.exceptions")
    return exceptions is not None and isinstance(e, exceptions.RedisError)


def is_command_error(e: BaseException) -> bool:
    """Did Redis answer with an error that the same command would meet again (a script error,
    "invalid expire time", WRONGTYPE, NOPERM)? Checked without importing redis-py."""
    exceptions = sys.modules.get("redis.exceptions")
    if exceptions is None or not isinstance(e, exceptions.ResponseError):
        return False
    code = getattr(e, "status_code", None) or str(e).split(" ", 1)[0]
    return code not in _TRANSIENT_REPLIES


async def answered(command: Awaitable[_T]) -> _T:
    """Await a Redis command of ours, its failure raised as ``state_unavailable`` says."""
    try:
        return await command
    except Exception as e:
        if is_state_failure(e):
            raise state_unavailable(e) from e
        raise


def redis_store(store: object, needs: str) -> Any:
    """``store`` when it is the Redis task store (a ``RedisTaskStore``), else a
    ``ConfigurationError`` saying what ``needs`` Redis. Asked without importing redis-py: a
    ``RedisTaskStore`` exists only once its module was loaded."""
    module = sys.modules.get("weclaw_mq.state.redis")
    if module is None or not isinstance(store, module.RedisTaskStore):
        kind = type(store).__name__ if store is not None else "off (results off, no guard)"
        raise ConfigurationError(
            f"{needs} in Redis (WECLAW_MQ_REDIS_URL): this App's task store is {kind}"
        )
    return store

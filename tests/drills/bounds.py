"""The bounds the drills assert, one constant each, and the words the README quotes them in.

The README's drill table states these very numbers (see ``bound_texts``, which ``make drill``
prints with the table): a bound changes here, in the assertion and in the report at once.
"""

from __future__ import annotations

# kill -9 of a worker: a killed worker's duplicates are the tasks it had in flight, at most
# its concurrency (= its prefetch); the drill runs it with that concurrency.
KILL9_CONCURRENCY = 8
KILL9_KILLS = 3
KILL9_DUPLICATES_PER_KILL = KILL9_CONCURRENCY

# Blackhole and paused broker: aiormq declares a silent peer dead after (heartbeat + 1) * 3 s
# without a frame, checked every heartbeat / 2 s (at least 1 s); 2 s of scheduling slack for
# a loaded 2-core machine on top.
HEARTBEAT_S = 2
HEARTBEAT_STUCK_AFTER_S = (HEARTBEAT_S + 1) * 3
HEARTBEAT_CHECK_TICK_S = max(1, HEARTBEAT_S // 2)
HEARTBEAT_SLACK_S = 2
HEARTBEAT_DETECT_BOUND_S = HEARTBEAT_STUCK_AFTER_S + HEARTBEAT_CHECK_TICK_S + HEARTBEAT_SLACK_S

# Memory alarm: every publish raises ConfirmTimeoutError at its confirm timeout; 1.5 s of
# scheduling slack on top.
ALARM_CONFIRM_TIMEOUT_S = 2.0
ALARM_SLACK_S = 1.5
ALARM_PUBLISH_BOUND_S = ALARM_CONFIRM_TIMEOUT_S + ALARM_SLACK_S

# Connection cuts: the exception types a publish during a cut may raise (by class name; the
# README names them).
CUT_ERROR_TYPES = ("ConnectionLostError",)

# make drill: how many times in a row the cluster failover drill runs.
CLUSTER_DRILL_RUNS_DEFAULT = 5


def heartbeat_bound_text() -> str:
    return (
        f"bound ({HEARTBEAT_S}+1)*3 + {HEARTBEAT_CHECK_TICK_S} s check tick + "
        f"{HEARTBEAT_SLACK_S} s slack = {HEARTBEAT_DETECT_BOUND_S} s"
    )


def alarm_bound_text() -> str:
    return (
        f"bound {ALARM_PUBLISH_BOUND_S:g} s = confirm timeout {ALARM_CONFIRM_TIMEOUT_S:g} s "
        f"+ {ALARM_SLACK_S:g} s slack"
    )


def kill9_bound_text(kills: int) -> str:
    return f"bound {KILL9_DUPLICATES_PER_KILL} per kill (in flight at the kill), x{kills} kills"


def bound_texts() -> list[str]:
    """One line per asserted bound, printed under the drill table."""
    return [
        f"kill -9: duplicates {kill9_bound_text(KILL9_KILLS)}",
        f"heartbeat (blackhole, paused broker): noticed within the {heartbeat_bound_text()}",
        f"memory alarm: every publish raised ConfirmTimeoutError within the {alarm_bound_text()}",
        f"connection cuts: a publish returned (and is in the queue) or raised one of "
        f"{', '.join(CUT_ERROR_TYPES)}",
    ]

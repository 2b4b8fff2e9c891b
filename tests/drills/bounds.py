"""The bounds the drills assert, one constant each, and the words the docs quote them in.

The drill table of docs/design/guarantees.md states these very numbers (see ``bound_texts``,
which ``make drill`` prints with the table): a bound changes here, in the assertion and in the
report at once.
"""

from __future__ import annotations

# kill -9 of a worker: a killed worker's duplicates are the tasks it had in flight, at most
# its concurrency (= its prefetch); the drill runs it with that concurrency.
KILL9_CONCURRENCY = 8
KILL9_KILLS = 3
KILL9_DUPLICATES_PER_KILL = KILL9_CONCURRENCY

# kill -9 of a guarded worker: its claims lapse with its heartbeat (guard_heartbeat_ttl_s), not
# its lease, so a queue drains about as fast with the guard on as with it off, same kills.
GUARD_RECOVERY_RATIO_BOUND = 1.3
GUARD_RECOVERY_KILLS = 5

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
# docs/design/guarantees.md names them).
CUT_ERROR_TYPES = ("ConnectionLostError",)

# Redis Sentinel failover (kill -9 of the primary): the Sentinels declare the primary down
# after down-after-milliseconds without an answer, agree (quorum 2 of 3), elect a leader and
# promote the replica; redis-py asks them again at its next connection. Measured 2-5 s on a
# loaded 2-core machine; 15 s is the asserted bound (a Sentinel may wait up to
# failover-timeout before it retries a failed election, so a bad draw costs seconds).
SENTINEL_DOWN_AFTER_MS = 1000
SENTINEL_FAILOVER_BOUND_S = 15.0
# Redis replicates asynchronously: a write the primary acknowledged in the last instant before
# its death may not have reached the replica. The guard's writes in that instant are at most
# those of the deliveries in flight, one worker's concurrency: a lost done marker lets that
# task run again if its message comes back, a lost result leaves its status at an earlier one.
SENTINEL_DRILL_CONCURRENCY = 8
SENTINEL_LOST_WRITES_BOUND = SENTINEL_DRILL_CONCURRENCY
# Long runs under the same failover: every run is in flight at the kill. A run's step is
# called again after it only if its record was lost: written in the last instant before the
# primary died and not yet on the replica (at most one per run: steps are 0.3 s apart), or
# not written because Redis was down when the call returned (that attempt fails, the next
# calls it again). So at most 2 extra calls per run in flight.
SENTINEL_LONG_RUNS = 12
SENTINEL_LONG_RUN_WATCH_S = 1.0
SENTINEL_LONG_RUN_HEARTBEAT_S = 1.0
SENTINEL_LONG_RUN_EXTRA_STEPS_PER_RUN = 2
SENTINEL_LONG_RUN_EXTRA_STEPS_BOUND = SENTINEL_LONG_RUNS * SENTINEL_LONG_RUN_EXTRA_STEPS_PER_RUN

# kill -9 of workers mid long run: the watch copy comes back within one watch period of the
# death, and claims once the worker's heartbeat lapsed (else it parks once more), so a run a
# kill hit resumes within watch + heartbeat TTL; 1.5 s of slack for the copy's delivery and
# the run's start on a loaded 2-core machine.
LONG_RUN_WATCH_S = 1.0
LONG_RUN_HEARTBEAT_S = 1.0
LONG_RUN_RESUME_SLACK_S = 1.5
LONG_RUN_RESUME_BOUND_S = LONG_RUN_WATCH_S + LONG_RUN_HEARTBEAT_S + LONG_RUN_RESUME_SLACK_S

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


def guard_recovery_bound_text() -> str:
    return (
        f"bound {GUARD_RECOVERY_RATIO_BOUND:g}x the drain time with the guard off, same kills "
        f"(x{GUARD_RECOVERY_KILLS})"
    )


def sentinel_failover_bound_text() -> str:
    return (
        f"bound {SENTINEL_FAILOVER_BOUND_S:g} s; down after {SENTINEL_DOWN_AFTER_MS} ms, "
        "quorum 2 of 3 Sentinels"
    )


def sentinel_lost_writes_bound_text() -> str:
    return (
        f"bound {SENTINEL_LOST_WRITES_BOUND} each: the writes in flight at the kill "
        f"(concurrency {SENTINEL_DRILL_CONCURRENCY}) may miss the replica"
    )


def long_run_resume_bound_text() -> str:
    return (
        f"bound {LONG_RUN_RESUME_BOUND_S:g} s = watch {LONG_RUN_WATCH_S:g} s + heartbeat "
        f"{LONG_RUN_HEARTBEAT_S:g} s + {LONG_RUN_RESUME_SLACK_S:g} s slack"
    )


def sentinel_long_run_extra_steps_bound_text() -> str:
    return (
        f"bound {SENTINEL_LONG_RUN_EXTRA_STEPS_BOUND} = {SENTINEL_LONG_RUN_EXTRA_STEPS_PER_RUN} "
        f"per run in flight x {SENTINEL_LONG_RUNS}: a step record lost with the primary, and "
        "the call that returned while Redis was down"
    )


def bound_texts() -> list[str]:
    """One line per asserted bound, printed under the drill table."""
    return [
        f"kill -9: duplicates {kill9_bound_text(KILL9_KILLS)}",
        f"kill -9, guard on vs off: drain time within the {guard_recovery_bound_text()}",
        f"heartbeat (blackhole, paused broker): noticed within the {heartbeat_bound_text()}",
        f"memory alarm: every publish raised ConfirmTimeoutError within the {alarm_bound_text()}",
        f"connection cuts: a publish returned (and is in the queue) or raised one of "
        f"{', '.join(CUT_ERROR_TYPES)}",
        f"Redis primary kill -9 (Sentinel): writes accepted again within the "
        f"{sentinel_failover_bound_text()}; results missing and duplicates "
        f"{sentinel_lost_writes_bound_text()}",
        f"long runs, kill -9 of workers: every run hit resumed within the "
        f"{long_run_resume_bound_text()}; extra step calls within the runs in flight at the "
        f"kills",
        f"Redis primary kill -9 (Sentinel) under long runs: each ended once, extra step calls "
        f"{sentinel_long_run_extra_steps_bound_text()}",
    ]

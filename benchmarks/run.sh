#!/usr/bin/env bash
# The benchmark's single entry point (what 'make bench' runs).
#
#   benchmarks/run.sh            full run, 5 repeats (about 10-12 minutes on 2 cores)
#   benchmarks/run.sh --smoke    tiny counts, one repeat (under a minute once the venv exists)
#   benchmarks/run.sh --help     every option (--scale, --repeats, --cases, ...)
#
# Then the feature benchmarks: benchmarks/stream_cost.py (make bench-stream),
# benchmarks/notify_cost.py (notify=True against off; about a minute, tiny with --smoke),
# benchmarks/priority.py (make bench-priority), benchmarks/limits_cost.py (a per-key limit
# against none; about 60 s, tiny with --smoke), benchmarks/task_index_cost.py (the task
# index on vs off, and a page of a million; a few minutes, tiny with --smoke) and
# benchmarks/step_cost.py (a memoized step's round trips and CPU, a long run's publishes; about
# a minute, tiny with --smoke).
#
# The peers (FastStream, Dramatiq) live in benchmarks/.venv, never in the project's .venv.
# That venv is created on first use and re-installed only when requirements.txt or
# pyproject.toml is newer than its stamp.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
venv="$here/.venv"
stamp="$venv/.installed"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    echo "benchmarks: creating $venv" >&2
    "$python" -m venv "$venv"
fi
if [[ ! -f "$stamp" || "$here/requirements.txt" -nt "$stamp" || "$root/pyproject.toml" -nt "$stamp" ]]; then
    echo "benchmarks: installing weclaw_mq (editable) and the peers into $venv" >&2
    "$venv/bin/python" -m pip install --disable-pip-version-check -q \
        -e "$root" -r "$here/requirements.txt"
    touch "$stamp"
fi
# Bytecode for everything a contender imports, as a deployed worker has it (pip compiles a
# wheel's modules at install). Without it a process started under PYTHONDONTWRITEBYTECODE
# (or from an editable install's fresh source) compiles every module it imports, and the
# compiler's garbage stays in its heap: +2 MiB of idle RSS for weclaw_mq's own modules, far
# more when the venv's packages were installed without bytecode. Only stale files are
# recompiled, so this is quick after the first run; a --smoke run (whose figures are not
# kept) skips it, as its first compile of a new venv takes longer than the smoke itself.
if [[ " $* " != *" --smoke "* ]]; then
    "$venv/bin/python" -m compileall -q -j 0 "$venv/lib" "$root/weclaw_mq" "$here"/*.py "$here/contenders" >/dev/null || true
fi

cd "$root"
status=0
"$venv/bin/python" -m benchmarks.bench "$@" || status=$?
# Feature benchmarks (each its own module and make target) run after the comparison, with
# --smoke passed on; --help is the comparison's alone.
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then
    exit "$status"
fi
feature_args=()
notify_args=()
limits_args=()
if [[ " $* " == *" --smoke "* ]]; then
    feature_args+=(--smoke)
    notify_args=(--n 100 --rounds 1)
    limits_args=(--n 100 --rounds 1 --concurrency 10)
fi
"$venv/bin/python" -m benchmarks.stream_cost "${feature_args[@]}" || status=$?
# What result notifications cost a worker (also alone: make bench-notify).
"$venv/bin/python" -m benchmarks.notify_cost "${notify_args[@]}" || status=$?
# URGENT behind a NORMAL backlog, and what lanes cost (also alone: make bench-priority).
"$venv/bin/python" -m benchmarks.priority "${feature_args[@]}" || status=$?
# What a per-key limit costs the guarded consume path (also alone: make bench-limits).
"$venv/bin/python" -m benchmarks.limits_cost "${limits_args[@]}" || status=$?
# What the task index costs the consume path, and a page of a million (make bench-task-index).
"$venv/bin/python" -m benchmarks.task_index_cost "${feature_args[@]}" || status=$?
# What a memoized step and a long run cost (make bench-steps).
"$venv/bin/python" -m benchmarks.step_cost "${feature_args[@]}" || status=$?
exit "$status"

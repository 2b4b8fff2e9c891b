#!/usr/bin/env bash
# 'make test-ends': the tests on the two ends of the ranges pyproject.toml declares, each in a
# venv of its own under .venv-ends/ (the locked .venv is what 'make test' runs on).
#
#   tests/dependency_ends.sh lowest   every direct dependency at the lowest version its range
#                                     allows (uv's lowest-direct), the rest at the lock's versions
#   tests/dependency_ends.sh newest   everything at the newest version the ranges allow (what a
#                                     fresh 'pip install weclaw_mq' gets today), mypy included
#
# Both run the unit tests (not the docs site's two: mkdocs pins its own versions) and the core
# integration tests on the broker and Redis that 'make test' uses. A failure at the lowest end
# means a floor in pyproject.toml is wrong; at the newest, that something moved upstream: fix
# it, then 'make lock'.
set -euo pipefail
cd "$(dirname "$0")/.."

END=${1:?usage: tests/dependency_ends.sh lowest|newest}
UV=.venv/bin/uv
LOCK=requirements/dev.lock
VENV=.venv-ends/$END
EXTRAS="--extra console --extra otel --extra reload --extra uvloop --extra examples --extra postgres"
# The tests' own tools, at the lock's versions at both ends.
TOOLS="pytest pytest-asyncio pytest-timeout pytest-xdist httpx hypothesis selenium pyyaml jsonschema import-linter opentelemetry-sdk"
INTEGRATION="test_promises test_idempotency test_retry_and_dead_letter test_outcomes test_settlement
	test_streams test_cancel test_workflows test_schedules test_token_limits test_sync_handlers
	test_publishing test_dlq_ops test_task_stores test_wire_compat_broker test_console_http
	test_postgres_outbox test_sync_client"

[ -x "$UV" ] || { echo "test-ends needs .venv with uv: run 'make install' first"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$VENV"
"$UV" venv -q -p "$(.venv/bin/python -c 'import sys; print(sys.executable)')" "$VENV"
export VIRTUAL_ENV=$PWD/$VENV

case "$END" in
lowest)
	# The lock's versions of everything that is not a direct dependency, so that only the
	# floors move; OpenTelemetry's packages must match the api's floor, so they are left free.
	direct=$(.venv/bin/python - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = list(project["dependencies"])
for extra in ("console", "otel", "reload", "uvloop", "examples", "postgres"):
    deps += project["optional-dependencies"][extra]
print(" ".join(sorted({re.split(r"[<>=\[ ;]", d)[0].lower() for d in deps})))
PY
)
	grep '==' "$LOCK" | while IFS= read -r line; do
		name=$(printf '%s' "${line%%==*}" | tr 'A-Z_' 'a-z-')
		case " $direct " in *" $name "*) continue ;; esac
		# A direct dependency's own parts (pydantic-core, psycopg-binary, typer-slim) follow it.
		for d in $direct; do case "$name" in "$d"-*) continue 2 ;; esac; done
		case "$name" in opentelemetry-*) continue ;; esac
		printf '%s\n' "$line"
	done >"$tmp/others.txt"
	"$UV" pip compile -q pyproject.toml $EXTRAS --resolution lowest-direct \
		-c "$tmp/others.txt" -o "$tmp/lowest.txt"
	"$UV" pip install -q -r "$tmp/lowest.txt"
	"$UV" pip install -q --no-deps -e .
	"$UV" pip install -q -c "$tmp/lowest.txt" -c "$tmp/others.txt" $TOOLS
	;;
newest)
	"$UV" pip install -q -e '.[dev]'
	;;
*)
	echo "usage: tests/dependency_ends.sh lowest|newest"
	exit 2
	;;
esac

echo "the $END end: $("$UV" pip freeze 2>/dev/null | grep -iE '^(aio-pika|pydantic|redis|typer|croniter|prometheus.client|starlette|psycopg|sqlalchemy)==' | tr '\n' ' ')"
status=0
if [ "$END" = newest ]; then
	"$VENV/bin/mypy" || status=1
fi
files=()
for f in $INTEGRATION; do files+=("tests/integration/$f.py"); done
# The docs' own tests read the site's tools (mkdocs, griffe), which these venvs do not install:
# left out by name, not skipped ('make test' runs them).
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow" \
	--ignore tests/unit/test_docs_site.py --ignore tests/unit/test_docs_code_blocks.py \
	--ignore tests/unit/test_docstring_style.py tests/unit "${files[@]}" || status=1
exit $status

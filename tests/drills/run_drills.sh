#!/usr/bin/env bash
# 'make drill': every fault drill, the cluster failover one included, and the tests marked
# slow (a minute or more each, left out of 'make test'), then the table of counts
# (published, confirmed, processed, lost, duplicated) from these very runs.
#
#   tests/drills/run_drills.sh                 all drills, the cluster drill 5 times in a row
#   WECLAW_CLUSTER_DRILL_RUNS=1 tests/drills/run_drills.sh -k cluster    the cluster drill once
#
# Extra arguments go to pytest. The drills start private RabbitMQ nodes of their own
# (ops/cluster/cluster.sh: s1 and the cluster c1..c3, named weclaw-<node>-<run id>@localhost,
# on free ports, in pytest's temporary folder for this run) and never touch the machine's
# default broker on 5672; the kill -9 worker drill uses the default broker like the rest of
# the test suite. pytest stops every node it started, whatever way it ends
# (tests/private_servers.py), so two runs side by side never meet.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

PYTEST=${PYTEST:-.venv/bin/pytest}
export WECLAW_CLUSTER_DRILL=1
# docs/design/guarantees.md's claim is "5 runs in a row": the default here (tests/drills/bounds.py says so too).
export WECLAW_CLUSTER_DRILL_RUNS=${WECLAW_CLUSTER_DRILL_RUNS:-5}

# With the slow tests 'make test' leaves out (the benchmark's smoke run, the recovery race).
exec "$PYTEST" -m "drill or slow" tests/drills tests/integration -q -rfE -p no:cacheprovider "$@"

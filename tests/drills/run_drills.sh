#!/usr/bin/env bash
# 'make drill': every fault drill, the cluster failover one included, then the table of counts
# (published, confirmed, processed, lost, duplicated) from these very runs.
#
#   tests/drills/run_drills.sh                 all drills, the cluster drill once
#   WECLAW_CLUSTER_DRILL_RUNS=5 tests/drills/run_drills.sh -k cluster    the 5-in-a-row bar
#
# Extra arguments go to pytest. The drills start private RabbitMQ nodes of their own
# (ops/cluster/cluster.sh: weclaw-s1 on 5680, weclaw-c1..c3 on 5681-5683) and never touch the
# machine's default broker on 5672; the kill -9 worker drill uses the default broker like the
# rest of the test suite. Nodes this script finds stopped are stopped again at the end, even
# if a drill's own cleanup failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

PYTEST=${PYTEST:-.venv/bin/pytest}
CLUSTER_SH=ops/cluster/cluster.sh
export WECLAW_CLUSTER_DRILL=1
export WECLAW_CLUSTER_DRILL_RUNS=${WECLAW_CLUSTER_DRILL_RUNS:-1}

was_running=$(bash "$CLUSTER_SH" status 2>/dev/null | awk '$2 == "running" {print $1}')

"$PYTEST" -m drill tests/drills -q -rfE -p no:cacheprovider "$@"
status=$?

# Safety net: nothing started for this run may outlive it.
for node in c3 c2 c1 s1; do
	name="weclaw-$node@localhost"
	if bash "$CLUSTER_SH" pid "$node" >/dev/null 2>&1 && ! grep -qx "$name" <<<"$was_running"; then
		echo "[drill] $name still runs after the drills: stopping it" >&2
		bash "$CLUSTER_SH" node-stop "$node" || true
	fi
done
exit $status

#!/usr/bin/env bash
# Local RabbitMQ nodes for the fault drills: a 3-node cluster and one private single node, each
# with its own node name, ports, data folder and Erlang cookie, so nothing here ever touches
# the machine's default node (rabbit@<host> on 5672).
#
#   ops/cluster/cluster.sh start          start c1..c3 and join c2, c3 to c1
#   ops/cluster/cluster.sh stop           stop the three cluster nodes (data kept)
#   ops/cluster/cluster.sh destroy        stop every node of ours and delete the base folder
#   ops/cluster/cluster.sh status         what runs, where, and the cluster's view of itself
#   ops/cluster/cluster.sh single-start   start the private single node s1
#   ops/cluster/cluster.sh single-stop    stop it (data kept)
#   ops/cluster/cluster.sh node-start c2  start one node (e.g. a cluster member killed by a drill)
#   ops/cluster/cluster.sh node-stop c2   stop one node
#   ops/cluster/cluster.sh pid c2         the OS pid of a running node's beam process
#   ops/cluster/cluster.sh name c2        the node's Erlang name (weclaw-c2[-ID]@localhost)
#   ops/cluster/cluster.sh port c2        the node's AMQP port
#   ops/cluster/cluster.sh url c2|cluster the AMQP URL of a node, or the cluster's comma list
#   ops/cluster/cluster.sh ctl|diag|queues c1 ARGS...
#                                         rabbitmqctl / rabbitmq-diagnostics / rabbitmq-queues
#                                         against one of our nodes (its cookie, never 5672's)
#
# Environment (the defaults suit a person running this by hand; the test suite sets all three
# so that each pytest run has nodes nobody else can collide with):
#   WECLAW_CLUSTER_DIR    base folder of everything the nodes write: data, logs, erl_crash.dump,
#                         the Erlang cookie, each node's ports (default /tmp/weclaw-mq-cluster)
#   WECLAW_CLUSTER_ID     suffix of the node names, weclaw-s1-ID@localhost (default none:
#                         weclaw-s1@localhost); letters, digits, '_' and '-'
#   WECLAW_CLUSTER_PORTS  a number N: s1 gets AMQP port N, c1..c3 N+1..N+3, distribution port
#                         AMQP + 20000 (default 5680, the table below); or 'auto': free ports
#                         picked when a node first starts
#   WECLAW_CLUSTER_START_TIMEOUT_S (default 120), RABBITMQ_BIN (default /usr/lib/rabbitmq/bin)
#   WECLAW_CLUSTER_NOFILE a number N: nodes started now run with 'ulimit -n N' (the file
#                         descriptor limit; default: this shell's). 1024, the usual default,
#                         is what the file-handle drill needs (tests/drills/test_file_handles_drill.py)
#   WECLAW_CLUSTER_TLS_DIR, WECLAW_CLUSTER_TLS_PORT
#                         both set: each node started also listens for AMQP over TLS on
#                         127.0.0.1:PORT, with DIR/ca.pem, DIR/server.pem, DIR/server.key, and
#                         requires a client certificate signed by that CA (the TLS tests;
#                         one node per base folder then, as the port is fixed)
#
# | node | name (no ID)        | AMQP | distribution |
# |------|---------------------|------|--------------|
# | s1   | weclaw-s1@localhost | 5680 | 25680        |
# | c1   | weclaw-c1@localhost | 5681 | 25681        |
# | c2   | weclaw-c2@localhost | 5682 | 25682        |
# | c3   | weclaw-c3@localhost | 5683 | 25683        |
#
# A node's ports are chosen when it first starts and written to BASE/<node>/ports; a restart
# (node-start after a kill) reuses them, so its URL never changes. No management plugin, so
# AMQP and distribution are the only ports a node listens on. The CLI tools get their own
# distribution port from the kernel; epmd (4369) is the machine's, shared, and never stopped
# here: unique node names are what keep two sets of nodes apart in it.
#
# Measured with Debian's 3.10.8 on 2 cores: single node 4-6 s; cluster 23 s from nothing (the
# three boot side by side, then two joins), 13-16 s when the nodes already hold their data.
#
# The binaries under /usr/lib/rabbitmq/bin are called directly: the /usr/sbin wrappers switch
# to the rabbitmq user and its cookie. Debian's /etc/rabbitmq files name the default node and
# its 5672 listener, so every node here gets its own config and env files instead.
set -euo pipefail

BASE=${WECLAW_CLUSTER_DIR:-/tmp/weclaw-mq-cluster}
CLUSTER_ID=${WECLAW_CLUSTER_ID:-}
PORTS=${WECLAW_CLUSTER_PORTS:-5680}
BIN=${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
START_TIMEOUT_S=${WECLAW_CLUSTER_START_TIMEOUT_S:-120}
NOFILE=${WECLAW_CLUSTER_NOFILE:-}
STOP_TIMEOUT_S=60
CLUSTER_NODES=(c1 c2 c3)
HOME_DIR="$BASE/home"

# CLI tools open an Erlang distribution port of their own. 0..0 lets the kernel pick a free
# one: a fixed range would be shared with every other checkout's CLI calls (and the default
# node's 35672-35682), and run out when several drills hold a CLI open at once.
export RABBITMQ_CTL_DIST_PORT_MIN=0
export RABBITMQ_CTL_DIST_PORT_MAX=0
export ERL_EPMD_ADDRESS=127.0.0.1

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] ERROR: %s\n' "$*" >&2; exit 1; }

case "$CLUSTER_ID" in
*[!A-Za-z0-9_-]*) die "WECLAW_CLUSTER_ID='$CLUSTER_ID': only letters, digits, '_' and '-'" ;;
esac
case "$PORTS" in
auto) ;;
'' | *[!0-9]*) die "WECLAW_CLUSTER_PORTS='$PORTS': a port number or 'auto'" ;;
*) [ "$PORTS" -ge 1024 ] && [ "$PORTS" -le 45532 ] || die "WECLAW_CLUSTER_PORTS=$PORTS: 1024..45532" ;;
esac

node_index() {
	case "$1" in
	s1) echo 0 ;; c1) echo 1 ;; c2) echo 2 ;; c3) echo 3 ;;
	*) die "unknown node '$1' (expected s1, c1, c2 or c3)" ;;
	esac
}
node_dir() { echo "$BASE/$1"; }
ports_file() { echo "$(node_dir "$1")/ports"; }

# "AMQP DIST" of node $1: what it was first started with, else what it would start with.
node_ports() {
	local n=$1 index
	index=$(node_index "$n")
	if [ -s "$(ports_file "$n")" ]; then
		cat "$(ports_file "$n")"
	elif [ "$PORTS" = auto ]; then
		die "weclaw-$n has no ports yet: with WECLAW_CLUSTER_PORTS=auto they are picked at its first start"
	else
		echo "$((PORTS + index)) $((PORTS + index + 20000))"
	fi
}
amqp_port() { local p; p=$(node_ports "$1") && echo "${p% *}"; }
dist_port() { local p; p=$(node_ports "$1") && echo "${p#* }"; }
node_name() { node_index "$1" >/dev/null && echo "weclaw-$1${CLUSTER_ID:+-$CLUSTER_ID}@localhost"; }
pid_file() { echo "$(node_dir "$1")/rabbitmq.pid"; }
node_url() {
	local port
	port=$(amqp_port "$1") || exit 1
	echo "amqp://guest:guest@127.0.0.1:$port/"
}

ensure_cookie() {
	mkdir -p "$HOME_DIR"
	if [ ! -s "$HOME_DIR/.erlang.cookie" ]; then
		# 32 random capital letters, shared by every node of ours. (Not 'tr </dev/urandom |
		# head': under pipefail the SIGPIPE that ends tr would fail the script.)
		python3 -c 'import secrets, string; print("".join(secrets.choice(string.ascii_uppercase) for _ in range(32)), end="")' \
			>"$HOME_DIR/.erlang.cookie"
	fi
	chmod 400 "$HOME_DIR/.erlang.cookie"
}

# The environment every rabbitmq binary sees for node $1.
node_env() {
	local n=$1 dir
	dir=$(node_dir "$n")
	export HOME="$HOME_DIR"
	export RABBITMQ_NODENAME
	RABBITMQ_NODENAME=$(node_name "$n")
	export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
	export RABBITMQ_NODE_PORT
	RABBITMQ_NODE_PORT=$(amqp_port "$n")
	export RABBITMQ_DIST_PORT
	RABBITMQ_DIST_PORT=$(dist_port "$n")
	export RABBITMQ_MNESIA_BASE="$dir/mnesia"
	export RABBITMQ_LOG_BASE="$dir/log"
	export RABBITMQ_PID_FILE="$dir/rabbitmq.pid"
	export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins"
	export RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf"
	export RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config"
	export RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf"
	# A VM that cannot start (a port taken, a bad config) writes its crash dump here, never
	# into the folder this script was called from.
	export ERL_CRASH_DUMP="$dir/log/erl_crash.dump"
	# Distribution on loopback only, like the default node.
	export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

ctl() {
	local n=$1
	shift
	(node_env "$n" && cd "$(node_dir "$n")" && "$BIN/rabbitmqctl" -n "$(node_name "$n")" "$@")
}

prepare_node() {
	local n=$1 dir
	dir=$(node_dir "$n")
	mkdir -p "$dir/mnesia" "$dir/log"
	echo '[].' >"$dir/enabled_plugins" # no management plugin: no 15672 clash
	cat >"$dir/rabbitmq.conf" <<-EOF
		listeners.tcp.1 = 127.0.0.1:$(amqp_port "$n")
		loopback_users.guest = true
		log.file.level = info
		log.console = false
	EOF
	if [ -n "${WECLAW_CLUSTER_TLS_DIR:-}" ]; then
		local tls=$WECLAW_CLUSTER_TLS_DIR
		cat >>"$dir/rabbitmq.conf" <<-EOF
			listeners.ssl.1 = 127.0.0.1:${WECLAW_CLUSTER_TLS_PORT:?WECLAW_CLUSTER_TLS_DIR needs WECLAW_CLUSTER_TLS_PORT}
			ssl_options.cacertfile = $tls/ca.pem
			ssl_options.certfile = $tls/server.pem
			ssl_options.keyfile = $tls/server.key
			ssl_options.verify = verify_peer
			ssl_options.fail_if_no_peer_cert = true
		EOF
	fi
	# An env file of our own, so Debian's (NODENAME=rabbit@localhost) is never read.
	echo "# weclaw-mq drill node $n" >"$dir/rabbitmq-env.conf"
}

# The pid of node $1's beam process, if it runs (the pid file alone may be stale after kill -9).
running_pid() {
	local n=$1 file pid
	file=$(pid_file "$n")
	[ -s "$file" ] || return 1
	pid=$(tr -dc '0-9' <"$file")
	[ -n "$pid" ] || return 1
	# The node name is not on the beam command line, only in its environment.
	[ -r "/proc/$pid/environ" ] || return 1
	tr '\0' '\n' <"/proc/$pid/environ" | grep -qx -- "RABBITMQ_NODENAME=$(node_name "$n")" || return 1
	echo "$pid"
}

port_in_use() { ss -ltnH "sport = :$1" 2>/dev/null | grep -q .; }

# Two free TCP ports on 127.0.0.1 (AMQP, distribution), picked at random below the kernel's
# ephemeral range, so no outgoing connection is handed one before the node binds it, and
# never one another node of this base folder already holds.
pick_free_ports() {
	local taken
	taken=$(cat "$BASE"/*/ports 2>/dev/null | tr '\n' ' ')
	# shellcheck disable=SC2086 # one argument per port
	python3 - $taken <<-'EOF'
		import random, socket, sys
		try:
		    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
		except (OSError, ValueError, IndexError):
		    low = 32768
		# Ports of well-known services that may be down right now and back soon.
		avoid = {4369, 5672, 6379, 15672, 25672, *range(5680, 5684), *range(25680, 25684)}
		avoid |= {int(p) for p in sys.argv[1:]}
		picked = []
		for port in random.sample(range(max(1024, low - 12000), low), 2000):
		    if port in avoid:
		        continue
		    with socket.socket() as s:
		        try:
		            s.bind(("127.0.0.1", port))
		        except OSError:
		            continue
		    picked.append(port)
		    if len(picked) == 2:
		        break
		if len(picked) < 2:
		    sys.exit("no two free ports found")
		print(*picked)
	EOF
}

# Launch node $1 in the background (its own session, so it outlives this script).
launch_node() {
	local n=$1 dir ports
	dir=$(node_dir "$n")
	if running_pid "$n" >/dev/null; then
		log "$(node_name "$n") already runs (pid $(running_pid "$n"))"
		return 0
	fi
	mkdir -p "$dir/mnesia" "$dir/log"
	if [ ! -s "$(ports_file "$n")" ]; then
		if [ "$PORTS" = auto ]; then
			ports=$(pick_free_ports) || die "no free ports for $(node_name "$n")"
		else
			ports=$(node_ports "$n")
		fi
		echo "$ports" >"$(ports_file "$n")"
	fi
	for port in "$(amqp_port "$n")" "$(dist_port "$n")"; do
		if port_in_use "$port"; then
			die "port $port is taken by another process; $(node_name "$n") cannot start (ss -ltnp 'sport = :$port'; WECLAW_CLUSTER_PORTS=auto picks free ones)"
		fi
	done
	ensure_cookie
	prepare_node "$n"
	rm -f "$(pid_file "$n")"
	log "starting $(node_name "$n") on 127.0.0.1:$(amqp_port "$n") (data in $dir)"
	(
		node_env "$n"
		cd "$dir"
		if [ -n "$NOFILE" ]; then ulimit -n "$NOFILE"; fi
		exec setsid "$BIN/rabbitmq-server" >>"$dir/log/stdout.log" 2>&1 </dev/null
	) &
	# The launcher (the rabbitmq-server script, parent of the VM): known at once, before the
	# VM writes its pid file, so whoever started the node can always find and stop it.
	echo "$!" >"$dir/launcher.pid"
}

# Wait until node $1 runs the rabbit application, or fail with the log tail.
await_node() {
	local n=$1 deadline
	deadline=$((SECONDS + START_TIMEOUT_S))
	while [ ! -s "$(pid_file "$n")" ]; do
		if [ "$SECONDS" -ge "$deadline" ]; then
			fail_start "$n" "no pid file after ${START_TIMEOUT_S} s"
		fi
		if ! launcher_runs "$n"; then
			fail_start "$n" "its VM exited while booting"
		fi
		sleep 0.5
	done
	local left=$((deadline - SECONDS))
	[ "$left" -gt 5 ] || left=5
	if ! ctl "$n" wait --timeout "$left" "$(pid_file "$n")" >/dev/null 2>&1; then
		fail_start "$n" "not running within ${START_TIMEOUT_S} s"
	fi
	log "$(node_name "$n") is running (pid $(running_pid "$n" || echo '?'))"
}

launcher_runs() {
	local file pid
	file="$(node_dir "$1")/launcher.pid"
	[ -s "$file" ] || return 0 # started by an older version of this script: cannot tell
	pid=$(tr -dc '0-9' <"$file")
	[ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

fail_start() {
	local n=$1 why=$2 dir
	dir=$(node_dir "$n")
	log "$(node_name "$n") did not start: $why. Last lines of its logs:"
	tail -n 15 "$dir/log/stdout.log" >&2 2>/dev/null || true
	tail -n 15 "$dir/log/$(node_name "$n").log" >&2 2>/dev/null || true
	die "$(node_name "$n") did not start ($why); logs in $dir/log"
}

stop_node() {
	local n=$1 pid
	if ! pid=$(running_pid "$n"); then
		log "$(node_name "$n") is not running"
		rm -f "$(pid_file "$n")"
		return 0
	fi
	log "stopping $(node_name "$n") (pid $pid)"
	# A drill may have left it paused (SIGSTOP): a stopped VM cannot answer 'stop'.
	kill -CONT "$pid" 2>/dev/null || true
	# With the pid file, 'stop' returns only once the VM has exited.
	(
		node_env "$n"
		timeout "$STOP_TIMEOUT_S" "$BIN/rabbitmqctl" -n "$(node_name "$n")" stop "$(pid_file "$n")" \
			>/dev/null 2>&1
	) || true
	if kill -0 "$pid" 2>/dev/null && running_pid "$n" >/dev/null; then
		log "$(node_name "$n") did not stop within ${STOP_TIMEOUT_S} s; sending SIGKILL to pid $pid"
		kill -9 "$pid" 2>/dev/null || true
	fi
	rm -f "$(pid_file "$n")"
}

# Running members as seen by node $1 (one per line).
running_members() {
	ctl "$1" cluster_status --formatter json 2>/dev/null |
		python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin).get("running_nodes", [])))'
}

disk_members() {
	ctl "$1" cluster_status --formatter json 2>/dev/null |
		python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin).get("disk_nodes", [])))'
}

join_to_c1() {
	local n=$1
	if disk_members c1 | grep -qx "$(node_name "$n")"; then
		return 0
	fi
	log "joining $(node_name "$n") to $(node_name c1)"
	# A node that never was a member holds nothing worth keeping: reset makes the join legal.
	quiet_ctl "$n" stop_app
	quiet_ctl "$n" reset
	quiet_ctl "$n" join_cluster "$(node_name c1)"
	quiet_ctl "$n" start_app
}

# ctl with its chatter (feature-flag warnings and the like) shown only when it fails.
quiet_ctl() {
	local out
	if ! out=$(ctl "$@" 2>&1); then
		printf '%s\n' "$out" >&2
		die "rabbitmqctl -n $(node_name "$1") ${*:2} failed"
	fi
}

await_cluster() {
	local deadline count
	deadline=$((SECONDS + START_TIMEOUT_S))
	while true; do
		count=$(running_members c1 | grep -c . || true)
		[ "$count" -ge 3 ] && break
		if [ "$SECONDS" -ge "$deadline" ]; then
			ctl c1 cluster_status >&2 || true
			die "cluster_status shows $count running node(s), not 3, after ${START_TIMEOUT_S} s"
		fi
		sleep 1
	done
	log "cluster of 3 running nodes: $(running_members c1 | tr '\n' ' ')"
}

cmd_start() {
	local started=$SECONDS
	# All at once: members of an existing cluster wait for each other at boot, and three
	# cold starts side by side are faster than one after another.
	for n in "${CLUSTER_NODES[@]}"; do launch_node "$n"; done
	for n in "${CLUSTER_NODES[@]}"; do await_node "$n"; done
	for n in c2 c3; do join_to_c1 "$n"; done
	await_cluster
	log "cluster ready in $((SECONDS - started)) s; URLs: $(cluster_urls)"
}

cmd_stop() {
	# Reverse order: c1 stops last and so holds the freshest view of the membership.
	for n in c3 c2 c1; do stop_node "$n"; done
}

cmd_destroy() {
	for n in c3 c2 c1 s1; do stop_node "$n"; done
	case "$BASE" in
	/ | "" | /tmp | "$HOME") die "refusing to delete '$BASE'" ;;
	esac
	rm -rf "$BASE"
	log "deleted $BASE"
}

cmd_status() {
	for n in s1 "${CLUSTER_NODES[@]}"; do
		if pid=$(running_pid "$n"); then
			printf '%-22s running  pid %-8s amqp 127.0.0.1:%s\n' "$(node_name "$n")" "$pid" "$(amqp_port "$n")"
		else
			printf '%-22s stopped\n' "$(node_name "$n")"
		fi
	done
	if running_pid c1 >/dev/null; then
		echo "cluster members running (seen by c1): $(running_members c1 | tr '\n' ' ')"
	fi
}

cluster_urls() {
	local urls=()
	for n in "${CLUSTER_NODES[@]}"; do urls+=("$(node_url "$n")"); done
	(IFS=,; echo "${urls[*]}")
}

main() {
	[ -x "$BIN/rabbitmq-server" ] || die "no RabbitMQ at $BIN (Debian: apt-get install rabbitmq-server)"
	local cmd=${1:-}
	shift || true
	case "$cmd" in
	start) cmd_start ;;
	stop) cmd_stop ;;
	destroy) cmd_destroy ;;
	status) cmd_status ;;
	single-start)
		launch_node s1
		await_node s1
		;;
	single-stop) stop_node s1 ;;
	node-start)
		launch_node "${1:?node-start needs a node: c1, c2, c3 or s1}"
		await_node "$1"
		;;
	node-stop) stop_node "${1:?node-stop needs a node}" ;;
	pid) running_pid "${1:?pid needs a node}" || die "$(node_name "$1") is not running" ;;
	name) node_name "${1:?name needs a node}" ;;
	port) amqp_port "${1:?port needs a node}" ;;
	ctl | diag | queues)
		# A rabbitmq CLI tool against one of our nodes, with that node's cookie and env.
		local node=${1:?$cmd needs a node}
		shift
		local tool=rabbitmqctl
		[ "$cmd" = diag ] && tool=rabbitmq-diagnostics
		[ "$cmd" = queues ] && tool=rabbitmq-queues
		(node_env "$node" && cd "$(node_dir "$node")" && exec "$BIN/$tool" -n "$(node_name "$node")" "$@")
		;;
	url)
		if [ "${1:-}" = cluster ]; then cluster_urls; else node_url "${1:?url needs a node}"; fi
		;;
	*)
		sed -n '2,/^[^#]/{/^#/p}' "$0" >&2
		exit 2
		;;
	esac
}

main "$@"

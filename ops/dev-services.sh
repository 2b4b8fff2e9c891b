#!/usr/bin/env bash
# RabbitMQ and Redis for development and CI: makes both answer on the URLs weclaw_mq uses,
# WECLAW_MQ_AMQP_URL and WECLAW_MQ_REDIS_URL (from the environment, else ./.env, else the
# defaults amqp://guest:guest@localhost:5672/ and redis://localhost:6379/0).
#
#   ops/dev-services.sh up       use what already answers; start what does not (see below)
#   ops/dev-services.sh down     stop exactly what 'up' started here; never a server it found running
#   ops/dev-services.sh status   what answers, and what 'up' started
#
# How 'up' gets a service that does not answer (on this machine only; a remote URL is checked,
# never started):
#   1. a Docker engine answers ('docker info') and the URL uses the port docker-compose.yml
#      publishes (5672, 6379): 'docker compose up -d <service>', then its healthcheck;
#   2. else the server package, installed first with apt-get when missing and running as root:
#      - RabbitMQ on 5672 as root: the system node, 'rabbitmq-server -detached' (as CI always did);
#      - any other port, or not root: a private server of this script, its data, logs and pid
#        files in the state folder: redis-server on that port; RabbitMQ as a node of its own
#        (unique node name, own cookie, config, free distribution port, no plugins);
#   3. else one line per missing piece saying what to install, and exit status 1.
#
# State folder: $WECLAW_DEV_SERVICES_DIR, default .dev-services/ in the repository. One
# subfolder per service 'up' started, holding a record: kind, port, node name, and each pid with
# its start time. 'down' signals a recorded pid only while it is the same process (same start
# time), so a reused pid or a server started by anyone else is never touched.
#
# Environment: WECLAW_DEV_SERVICES_DIR, WECLAW_DEV_SERVICES_RABBITMQ_TIMEOUT_S (120),
# WECLAW_DEV_SERVICES_REDIS_TIMEOUT_S (30), WECLAW_DEV_SERVICES_DOCKER_TIMEOUT_S (180),
# WECLAW_DEV_SERVICES_RABBITMQ_BIN (folder of Debian's unwrapped rabbitmq-server script,
# default /usr/lib/rabbitmq/bin), WECLAW_DEV_SERVICES_SYSTEM_PORT (5672: the port the system
# node serves), WECLAW_DEV_SERVICES_RABBITMQCTL (rabbitmqctl: the command that reaches the
# system node). Passwords in URLs are never printed.
#
# A system node that runs but does not answer the AMQP handshake (overloaded, out of file
# handles) is reported and left alone: 'up' starts, and records, only what was not running.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${WECLAW_DEV_SERVICES_DIR:-$ROOT/.dev-services}
RABBITMQ_TIMEOUT_S=${WECLAW_DEV_SERVICES_RABBITMQ_TIMEOUT_S:-120}
REDIS_TIMEOUT_S=${WECLAW_DEV_SERVICES_REDIS_TIMEOUT_S:-30}
DOCKER_TIMEOUT_S=${WECLAW_DEV_SERVICES_DOCKER_TIMEOUT_S:-180}
STOP_TIMEOUT_S=60
SYSTEM_PORT=${WECLAW_DEV_SERVICES_SYSTEM_PORT:-5672}
# Word-split on purpose: a command and its arguments (e.g. a node name for another node).
read -r -a RABBITMQCTL <<<"${WECLAW_DEV_SERVICES_RABBITMQCTL:-rabbitmqctl}"
DEFAULT_AMQP_URL=amqp://guest:guest@localhost:5672/
DEFAULT_REDIS_URL=redis://localhost:6379/0
# The ports docker-compose.yml publishes.
COMPOSE_AMQP_PORT=5672
COMPOSE_REDIS_PORT=6379

# Folder of the rabbitmq-server script private nodes run. Debian's /usr/sbin scripts switch to
# the rabbitmq user and the system node's files; the unwrapped ones are in /usr/lib/rabbitmq/bin.
# A function, not a variable: apt-get may install the package while this script runs.
rmq_bin() {
	if [ -n "${WECLAW_DEV_SERVICES_RABBITMQ_BIN:-}" ]; then
		echo "$WECLAW_DEV_SERVICES_RABBITMQ_BIN"
	elif [ -d /usr/lib/rabbitmq/bin ]; then
		echo /usr/lib/rabbitmq/bin
	else
		dirname "$(command -v rabbitmq-server 2>/dev/null || echo /nonexistent/x)"
	fi
}

log() { printf '[dev-services] %s\n' "$*"; }
err() { printf '[dev-services] ERROR: %s\n' "$*" >&2; }
die() {
	err "$*"
	exit 1
}

# Small helpers in Python (python3 is a prerequisite of the project anyway): URL parsing,
# redaction, protocol-level probes, free ports, .env lookup, random cookies.
PY_HELPER='
import ipaddress, os, secrets, socket, string, sys
from urllib.parse import unquote, urlsplit

DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671, "redis": 6379, "rediss": 6379}

def is_local(host):
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)

def parse(url, kind):
    p = urlsplit(url.strip())
    host = p.hostname or "localhost"
    port = p.port or DEFAULT_PORTS.get(p.scheme, 0)
    if kind == "amqp":
        vhost = unquote(p.path[1:]) if len(p.path) > 1 else "/"
    else:
        vhost = p.path[1:] or "0"
    # Where a private server listens: the literal address, else loopback.
    try:
        bind = str(ipaddress.ip_address(host))
    except ValueError:
        bind = "127.0.0.1"
    for value in (p.scheme, host, str(port), unquote(p.username or ""),
                  unquote(p.password or ""), vhost, "1" if is_local(host) else "0", bind):
        print(value)

def redact(urls):
    out = []
    for url in urls.split(","):
        p = urlsplit(url.strip())
        if p.password is not None:
            netloc = p.netloc.rsplit("@", 1)
            user = netloc[0].split(":", 1)[0]
            p = p._replace(netloc=user + ":***@" + netloc[1])
        out.append(p.geturl())
    print(",".join(out))

def probe(kind, host, port, timeout):
    # A protocol answer, not only an open port: a half-booted broker or another program on
    # the port must not count as "answers".
    try:
        with socket.create_connection((host, int(port)), timeout=float(timeout)) as s:
            s.settimeout(float(timeout))
            if kind in ("amqps", "rediss"):
                return True  # TLS: an accepted connection is all we check
            if kind == "amqp":
                s.sendall(b"AMQP\x00\x00\x09\x01")
                data = s.recv(8)
                # Frame type 1 (connection.start), or the header of a version it prefers.
                return data[:1] == b"\x01" or data.startswith(b"AMQP")
            s.sendall(b"PING\r\n")
            data = s.recv(64)
            # +PONG, or -NOAUTH/-WRONGPASS from a server that wants a password; -LOADING
            # means it is not ready yet.
            return data.startswith(b"+PONG") or (data[:1] == b"-" and not data.startswith(b"-LOADING"))
    except OSError:
        return False

def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(port)))
        except OSError:
            return False
    return True

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        print(s.getsockname()[1])

def dotenv(path, key):
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError:
        return
    for line in lines:
        line = line.strip()
        if line.startswith("export "):
            line = line[7:].lstrip()
        name, sep, value = line.partition("=")
        if sep and name.strip().lower() == key.lower():
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"\x27":
                value = value[1:-1]
            print(value)

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "parse":
    parse(*args)
elif cmd == "redact":
    redact(*args)
elif cmd == "probe":
    sys.exit(0 if probe(*args) else 1)
elif cmd == "port-free":
    sys.exit(0 if port_free(*args) else 1)
elif cmd == "free-port":
    free_port()
elif cmd == "dotenv":
    dotenv(*args)
elif cmd == "cookie":
    print("".join(secrets.choice(string.ascii_uppercase) for _ in range(32)), end="")
elif cmd == "token":
    print(secrets.token_hex(3))
'
py() { python3 -c "$PY_HELPER" "$@"; }

# -- configuration ---------------------------------------------------------------------------

# The URL weclaw_mq would use: the environment, else ./.env (as weclaw_mq/config/environment.py reads it).
configured_url() {
	local name=$1 default=$2 value=${!1:-}
	if [ -z "$value" ] && [ -f "$ROOT/.env" ]; then
		value=$(py dotenv "$ROOT/.env" "$name")
	fi
	echo "${value:-$default}"
}

AMQP_URL=$(configured_url WECLAW_MQ_AMQP_URL "$DEFAULT_AMQP_URL")
REDIS_URL=$(configured_url WECLAW_MQ_REDIS_URL "$DEFAULT_REDIS_URL")

# Fields of one URL into U_* variables.
parse_url() {
	local out
	out=$(py parse "$1" "$2") || return 1
	{
		read -r U_SCHEME
		read -r U_HOST
		read -r U_PORT
		read -r U_USER
		read -r U_PASS
		read -r U_VHOST
		read -r U_LOCAL
		read -r U_BIND
	} <<<"$out"
}

redact() { py redact "$1"; }

# Does a server answer, asked three times a second apart? A server that is restarting right
# now (someone else's, on a shared machine) must not be taken for a missing one and replaced.
answers_settled() {
	local try
	for try in 1 2 3; do
		py probe "$@" 3 && return 0
		[ "$try" = 3 ] || sleep 1
	done
	return 1
}

# -- processes -------------------------------------------------------------------------------

# Start time of a process (field 22 of /proc/<pid>/stat, after the command name, which may
# hold spaces), so a pid that was reused by another program is never taken for ours.
start_time() {
	local stat fields
	stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	read -r -a fields <<<"${stat##*) }"
	# A zombie (killed, not yet reaped by its parent) has exited: not alive.
	case "${fields[0]}" in Z | X) return 1 ;; esac
	echo "${fields[19]}"
}

# "pid:starttime" of a running process.
pid_tag() {
	local st
	st=$(start_time "$1") || return 1
	echo "$1:$st"
}

# True while the process of a tag is the very process it was recorded for.
tag_alive() {
	local tag=$1
	[ -n "$tag" ] || return 1
	[ "$(start_time "${tag%%:*}" 2>/dev/null || true)" = "${tag#*:}" ]
}

# Stop recorded processes: SIGTERM to the first live one (the server; the others are its
# wrapper), wait for all to exit, SIGKILL what is left after STOP_TIMEOUT_S.
stop_tags() {
	local tag deadline left
	for tag in "$@"; do
		if tag_alive "$tag"; then
			kill -CONT "${tag%%:*}" 2>/dev/null || true
			kill -TERM "${tag%%:*}" 2>/dev/null || true
			break
		fi
	done
	deadline=$((SECONDS + STOP_TIMEOUT_S))
	while :; do
		left=()
		for tag in "$@"; do tag_alive "$tag" && left+=("$tag"); done
		[ "${#left[@]}" -eq 0 ] && return 0
		[ "$SECONDS" -ge "$deadline" ] && break
		sleep 0.2
	done
	for tag in "${left[@]}"; do
		log "pid ${tag%%:*} did not exit within ${STOP_TIMEOUT_S} s of SIGTERM: SIGKILL"
		if tag_alive "$tag"; then kill -KILL "${tag%%:*}" 2>/dev/null || true; fi
	done
	sleep 0.5
	for tag in "$@"; do tag_alive "$tag" && return 1; done
	return 0
}

# -- records ---------------------------------------------------------------------------------

# A record is KEY=VALUE lines in <instance dir>/record; read back without executing it.
record_get() {
	local file=$1/record key value
	[ -f "$file" ] || return 0
	while IFS='=' read -r key value; do
		if [ "$key" = "$2" ]; then
			echo "$value"
			return 0
		fi
	done <"$file"
}

record_set() {
	local dir=$1 key=$2 value=$3 file=$1/record
	{
		if [ -f "$file" ]; then grep -v "^$key=" "$file" || true; fi
		echo "$key=$value"
	} >"$file.new"
	mv "$file.new" "$file"
}

# Any recorded process (or the container) of an instance still running?
instance_alive() {
	local tag
	if [ "$(record_get "$1" kind)" = docker ]; then
		[ "$(docker inspect -f '{{.State.Running}}' "$(record_get "$1" container)" 2>/dev/null | tr -d '[:space:]')" = true ]
		return
	fi
	for tag in $(record_get "$1" pid) $(record_get "$1" wrapper); do
		tag_alive "$tag" && return 0
	done
	return 1
}

# fd 9 holds the lock. Bash cannot mark it close-on-exec, so every command that may leave a
# process behind (servers, apt-get, docker) runs with '9>&-'; else that process would hold the
# lock and the next 'up' or 'down' would wait for it.
lock_state() {
	mkdir -p "$STATE"
	if command -v flock >/dev/null 2>&1; then
		exec 9>"$STATE/.lock"
		if ! flock -n 9; then
			log "waiting for another ops/dev-services.sh to finish (lock $STATE/.lock)"
			flock -w 300 9 || die "another process holds $STATE/.lock for 300 s (see: fuser -v $STATE/.lock)"
		fi
	fi
}

# -- installing ------------------------------------------------------------------------------

can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

APT_UPDATED=0
apt_install() {
	export DEBIAN_FRONTEND=noninteractive
	if [ "$APT_UPDATED" = 0 ]; then
		log "apt-get update"
		apt-get update -qq 9>&- || return 1
		APT_UPDATED=1
	fi
	log "apt-get install $*"
	# Without systemd, a package's postinst may start its daemon from here: fd 9 closed.
	apt-get install -y -qq --no-install-recommends "$@" >/dev/null 9>&-
}

rabbitmq_installed() { [ -x "$(rmq_bin)/rabbitmq-server" ]; }
redis_installed() { command -v redis-server >/dev/null 2>&1; }

MISSING=()
missing() { MISSING+=("$1"); }

# -- Docker ----------------------------------------------------------------------------------

COMPOSE=()
docker_ready() {
	[ "${#COMPOSE[@]}" -gt 0 ] && return 0
	command -v docker >/dev/null 2>&1 || return 1
	timeout 20 docker info >/dev/null 2>&1 || return 1
	if docker compose version >/dev/null 2>&1; then
		COMPOSE=(docker compose)
	elif command -v docker-compose >/dev/null 2>&1; then
		COMPOSE=(docker-compose)
	else
		log "a Docker engine answers but neither 'docker compose' nor 'docker-compose' is installed"
		return 1
	fi
}

compose() { (cd "$ROOT" && "${COMPOSE[@]}" -f docker-compose.yml "$@" 9>&-); }

# Start a compose service and record its container; the caller waits for its healthcheck.
docker_start() {
	local service=$1 dir=$2 id
	log "starting $service with Docker: ${COMPOSE[*]} up -d $service"
	# docker-compose.yml's Redis requires WECLAW_REDIS_PASSWORD (default: its own): start it
	# with the URL's password instead, none for a URL without one (set but empty: no password).
	if [ "$service" = redis ]; then
		(export WECLAW_REDIS_PASSWORD="$U_PASS" && compose up -d "$service") || return 1
	else
		compose up -d "$service" || return 1
	fi
	id=$(compose ps -q "$service") || return 1
	[ -n "$id" ] || return 1
	mkdir -p "$dir"
	record_set "$dir" kind docker
	record_set "$dir" service "$service"
	record_set "$dir" container "$id"
}

docker_await() {
	local dir=$1 id state deadline
	id=$(record_get "$dir" container)
	deadline=$((SECONDS + DOCKER_TIMEOUT_S))
	while :; do
		state=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$id" 2>/dev/null) || state=gone
		state=$(echo "$state" | tr -d '[:space:]')
		case "$state" in
		healthy) return 0 ;;
		unhealthy | exited | dead | gone)
			err "container $id is $state; its last log lines:"
			docker logs --tail 20 "$id" >&2 2>&1 || true
			return 1
			;;
		esac
		if [ "$SECONDS" -ge "$deadline" ]; then
			err "container $id is not healthy after ${DOCKER_TIMEOUT_S} s (state: $state)"
			return 1
		fi
		sleep 1
	done
}

# -- RabbitMQ --------------------------------------------------------------------------------

# Launch a private node for port $2 in instance dir $1 (its own session, so a Ctrl-C in the
# terminal that ran 'make' does not stop it). The caller waits with rabbitmq_await.
rabbitmq_launch_private() {
	local dir=$1 port=$2 node dist
	if ! py port-free "$port"; then
		err "port $port is taken by a process that does not answer as RabbitMQ (see: ss -ltnp 'sport = :$port')"
		return 1
	fi
	node="weclaw-dev-$port-$(py token)@localhost"
	dist=$(py free-port)
	mkdir -p "$dir/mnesia" "$dir/log" "$dir/home"
	py cookie >"$dir/home/.erlang.cookie"
	chmod 400 "$dir/home/.erlang.cookie"
	echo '[].' >"$dir/enabled_plugins" # no plugins: no management listener on 15672
	echo "# private node of ops/dev-services.sh" >"$dir/rabbitmq-env.conf"
	local listen=$U_BIND:$port
	(
		umask 077
		{
			# Own config: Debian's /etc/rabbitmq/rabbitmq.conf names 5672.
			echo "listeners.tcp.1 = $listen"
			echo "log.file.level = info"
			echo "log.console = false"
			if [ "$U_USER:$U_PASS:$U_VHOST" = "guest:guest:/" ]; then
				echo "loopback_users.guest = true"
			else
				# The URL's credentials and vhost exist on this fresh node.
				echo "default_user = $U_USER"
				echo "default_pass = $U_PASS"
				echo "default_vhost = $U_VHOST"
				echo "default_permissions.configure = .*"
				echo "default_permissions.read = .*"
				echo "default_permissions.write = .*"
				echo "loopback_users = none"
			fi
		} >"$dir/rabbitmq.conf"
	)
	rm -f "$dir/rabbitmq.pid"
	record_set "$dir" kind private
	record_set "$dir" service rabbitmq
	record_set "$dir" port "$port"
	record_set "$dir" node "$node"
	log "starting a private RabbitMQ node $node on $listen (state in $dir)"
	(
		export HOME="$dir/home"
		export RABBITMQ_NODENAME="$node"
		export RABBITMQ_NODE_IP_ADDRESS="$U_BIND"
		export RABBITMQ_NODE_PORT="$port"
		export RABBITMQ_DIST_PORT="$dist"
		export RABBITMQ_MNESIA_BASE="$dir/mnesia"
		export RABBITMQ_LOG_BASE="$dir/log"
		export RABBITMQ_PID_FILE="$dir/rabbitmq.pid"
		export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins"
		export RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf"
		export RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config"
		# Own env file: Debian's names the system node (NODENAME=rabbit@localhost).
		export RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf"
		export ERL_CRASH_DUMP="$dir/erl_crash.dump"
		export ERL_EPMD_ADDRESS=127.0.0.1
		export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
		exec 9>&- # the state lock stays with this script
		server=$(rmq_bin)/rabbitmq-server
		if command -v setsid >/dev/null 2>&1; then
			exec setsid "$server" >>"$dir/log/stdout.log" 2>&1 </dev/null
		fi
		exec "$server" >>"$dir/log/stdout.log" 2>&1 </dev/null
	) &
	local wrapper=$!
	record_set "$dir" wrapper "$(pid_tag "$wrapper" || echo "$wrapper:gone")"
}

# What the system node says of itself: "serving" (its app runs), "stopped" (the Erlang node
# runs, its app does not), "down" (no node: rabbitmqctl's exit 69), "unknown" (no answer).
rabbitmq_system_state() {
	local out rc=0
	out=$(timeout 20 "${RABBITMQCTL[@]}" -q eval 'rabbit:is_running().' 2>/dev/null 9>&-) || rc=$?
	case "$rc:$(echo "$out" | tr -d '[:space:]')" in
	0:true) echo serving ;;
	0:false) echo stopped ;;
	69:*) echo down ;;
	*) echo unknown ;;
	esac
}

# The system node (root, its port): started the way Debian's package does it, after asking it
# whether it runs; recorded only once this script has started something.
rabbitmq_start_system() {
	local dir=$1 state
	state=$(rabbitmq_system_state)
	case "$state" in
	serving)
		err "the RabbitMQ system node runs but does not answer the AMQP handshake at $(redact "$AMQP_URL"): it is overloaded or out of file handles (check: rabbitmq-diagnostics status; rabbitmqctl eval 'file_handle_cache:info().'; delete queues nobody uses, or raise its ulimit -n); nothing was started or stopped"
		return 1
		;;
	unknown)
		err "nothing answers AMQP at $(redact "$AMQP_URL") and '${RABBITMQCTL[*]}' got no answer from the system node within 20 s: it may be booting or wedged (check: rabbitmq-diagnostics status); nothing was started or stopped"
		return 1
		;;
	stopped)
		# The Erlang node runs but its app was stopped ('rabbitmqctl stop_app'):
		# 'rabbitmq-server -detached' would refuse to start a second node.
		log "the RabbitMQ system node is up but not serving: rabbitmqctl start_app"
		timeout 60 "${RABBITMQCTL[@]}" start_app >/dev/null 9>&- || return 1
		mkdir -p "$dir"
		record_set "$dir" started app
		;;
	down)
		if ! py port-free "$U_PORT"; then
			err "port $U_PORT is taken by a process that does not answer as RabbitMQ, and no system node runs (see: ss -ltnp 'sport = :$U_PORT')"
			return 1
		fi
		log "RabbitMQ is installed but not running: rabbitmq-server -detached (the system node)"
		mkdir -p "$dir"
		rabbitmq-server -detached >>"$dir/stdout.log" 2>&1 </dev/null 9>&- || {
			tail -n 15 "$dir/stdout.log" >&2
			rm -rf "$dir"
			return 1
		}
		record_set "$dir" started node
		;;
	esac
	record_set "$dir" kind system
	record_set "$dir" service rabbitmq
	record_set "$dir" port "$U_PORT"
}

# Wait until the RabbitMQ of instance dir $1 answers AMQP; record its pids.
rabbitmq_await() {
	local dir=$1 kind deadline pid tag node
	kind=$(record_get "$dir" kind)
	log "waiting up to ${RABBITMQ_TIMEOUT_S} s for RabbitMQ at $(redact "$AMQP_URL")"
	deadline=$((SECONDS + RABBITMQ_TIMEOUT_S))
	if [ "$kind" = docker ]; then
		docker_await "$dir" || return 1
	fi
	while ! py probe amqp "$U_HOST" "$U_PORT" 2; do
		if [ "$kind" = private ] && [ -z "$(record_get "$dir" pid)" ] && [ -s "$dir/rabbitmq.pid" ]; then
			pid=$(tr -dc '0-9' <"$dir/rabbitmq.pid")
			if [ -n "$pid" ] && tag=$(pid_tag "$pid"); then
				record_set "$dir" pid "$tag"
			fi
		fi
		if [ "$kind" = private ] && ! instance_alive "$dir"; then
			err "the private RabbitMQ node exited while booting; last lines of its logs ($dir/log):"
			tail -n 15 "$dir/log/stdout.log" >&2 2>/dev/null || true
			return 1
		fi
		if [ "$SECONDS" -ge "$deadline" ]; then
			err "RabbitMQ did not answer within ${RABBITMQ_TIMEOUT_S} s; last log lines:"
			if [ "$kind" = private ]; then
				tail -n 15 "$dir/log/stdout.log" >&2 2>/dev/null || true
			else
				tail -n 15 /var/log/rabbitmq/*.log >&2 2>/dev/null || true
			fi
			return 1
		fi
		sleep 0.5
	done
	if [ "$kind" = private ] && [ -z "$(record_get "$dir" pid)" ]; then
		pid=$(tr -dc '0-9' <"$dir/rabbitmq.pid" 2>/dev/null || true)
		[ -n "$pid" ] && tag=$(pid_tag "$pid") && record_set "$dir" pid "$tag"
	fi
	if [ "$kind" = system ]; then
		pid=$(timeout 20 "${RABBITMQCTL[@]}" eval 'os:getpid().' 2>/dev/null | tr -dc '0-9' || true)
		node=$(timeout 20 "${RABBITMQCTL[@]}" eval 'node().' 2>/dev/null | tr -d "'\"[:space:]" || true)
		[ -n "$node" ] && record_set "$dir" node "$node"
		[ -n "$pid" ] && tag=$(pid_tag "$pid") && record_set "$dir" pid "$tag"
	fi
	log "RabbitMQ answers at $(redact "$AMQP_URL") (started: $(describe "$dir"))"
}

# -- Redis -----------------------------------------------------------------------------------

# A redis-server of ours on port $2, everything in instance dir $1 (ephemeral: no snapshots,
# no append-only file; the data is for development and tests).
redis_start() {
	local dir=$1 port=$2 bind pid tag deadline
	if ! py port-free "$port"; then
		err "port $port is taken by a process that does not answer as Redis (see: ss -ltnp 'sport = :$port')"
		return 1
	fi
	bind=$U_BIND
	[ "$U_HOST" = localhost ] && bind="127.0.0.1 -::1"
	mkdir -p "$dir"
	(
		umask 077
		{
			echo "port $port"
			echo "bind $bind"
			echo "daemonize yes"
			echo "pidfile \"$dir/redis.pid\""
			echo "logfile \"$dir/redis.log\""
			echo "dir \"$dir\""
			echo 'save ""'
			echo "appendonly no"
			if [ -n "$U_PASS" ]; then
				# In the config file, not on the command line where ps would show it.
				if [ -n "$U_USER" ] && [ "$U_USER" != default ]; then
					echo "user $U_USER on >$U_PASS ~* &* +@all"
				else
					echo "requirepass \"$U_PASS\""
				fi
			fi
		} >"$dir/redis.conf"
	)
	rm -f "$dir/redis.pid"
	record_set "$dir" kind private
	record_set "$dir" service redis
	record_set "$dir" port "$port"
	log "starting redis-server on $bind port $port (state in $dir)"
	# fd 9 (the state lock) closed: the daemon must not hold it.
	redis-server "$dir/redis.conf" >"$dir/stdout.log" 2>&1 </dev/null 9>&- || {
		err "redis-server did not start; its output and last log lines:"
		cat "$dir/stdout.log" >&2 2>/dev/null || true
		tail -n 15 "$dir/redis.log" >&2 2>/dev/null || true
		return 1
	}
	deadline=$((SECONDS + REDIS_TIMEOUT_S))
	while :; do
		if [ -z "$(record_get "$dir" pid)" ] && [ -s "$dir/redis.pid" ]; then
			pid=$(tr -dc '0-9' <"$dir/redis.pid")
			if [ -n "$pid" ] && tag=$(pid_tag "$pid"); then
				record_set "$dir" pid "$tag"
			fi
		fi
		py probe redis "$U_HOST" "$port" 2 && [ -n "$(record_get "$dir" pid)" ] && break
		if [ "$SECONDS" -ge "$deadline" ]; then
			err "Redis did not answer on port $port within ${REDIS_TIMEOUT_S} s; last lines of $dir/redis.log:"
			tail -n 15 "$dir/redis.log" >&2 2>/dev/null || true
			return 1
		fi
		sleep 0.2
	done
}

# Wait for a Redis started earlier (a container, or our server from a previous run).
redis_await() {
	local dir=$1 deadline
	if [ "$(record_get "$dir" kind)" = docker ]; then
		docker_await "$dir" || return 1
	fi
	log "waiting up to ${REDIS_TIMEOUT_S} s for Redis at $(redact "$REDIS_URL")"
	deadline=$((SECONDS + REDIS_TIMEOUT_S))
	until py probe redis "$U_HOST" "$U_PORT" 2; do
		if [ "$SECONDS" -ge "$deadline" ]; then
			err "Redis did not answer within ${REDIS_TIMEOUT_S} s"
			return 1
		fi
		sleep 0.2
	done
}

# -- up --------------------------------------------------------------------------------------

instance_dir() { echo "$STATE/$1-$2"; }

describe() {
	local dir=$1 kind
	kind=$(record_get "$dir" kind)
	case "$kind" in
	docker) echo "docker container $(record_get "$dir" container | cut -c1-12)" ;;
	system) echo "system node $(record_get "$dir" node) pid $(record_get "$dir" pid | cut -d: -f1)" ;;
	private)
		if [ "$(record_get "$dir" service)" = rabbitmq ]; then
			echo "private node $(record_get "$dir" node) pid $(record_get "$dir" pid | cut -d: -f1), state in $dir"
		else
			echo "private redis-server pid $(record_get "$dir" pid | cut -d: -f1), state in $dir"
		fi
		;;
	*) echo "unknown" ;;
	esac
}

# Stop and forget an instance this run launched but could not bring up.
abandon() {
	local dir=$1
	log "stopping what this run started for $(basename "$dir")"
	stop_instance "$dir" >/dev/null || true
}

# What to do about one service. Sets PENDING to an instance dir that still has to be awaited.
# $1 service (rabbitmq|redis), $2 URL, $3 probe kind (amqp|redis), $4 compose port, $5 package
PENDING=
ensure_begin() {
	local service=$1 url=$2 proto=$3 compose_port=$4 package=$5 name dir shown installed=0
	local -a urls
	PENDING=
	[ "$service" = rabbitmq ] && name=RabbitMQ || name=Redis
	shown=$(redact "$url")
	if [[ $url == *,* ]]; then
		# A cluster list: check only; its nodes are started by ops/cluster/cluster.sh or compose.
		local one
		IFS=, read -r -a urls <<<"$url"
		for one in "${urls[@]}"; do
			parse_url "$one" "$proto" || continue
			if py probe "$U_SCHEME" "$U_HOST" "$U_PORT" 3; then
				log "$name answers at $(redact "$one") (one of a list of ${#urls[@]}), using it"
				return 0
			fi
		done
		missing "$name: no node of $shown answers; this script starts single servers only: start the cluster (ops/cluster/cluster.sh start, or docker compose --profile cluster up -d)"
		return 1
	fi
	parse_url "$url" "$proto" || {
		missing "$name: cannot parse the URL $shown"
		return 1
	}
	if answers_settled "$U_SCHEME" "$U_HOST" "$U_PORT"; then
		log "$name answers at $shown, using it"
		return 0
	fi
	if [ "$U_SCHEME" != "$proto" ] || [ "$U_LOCAL" != 1 ]; then
		missing "$name: nothing answers at $shown, which is not a plain $proto:// URL on this machine: start it there, or fix the URL"
		return 1
	fi
	dir=$(instance_dir "$service" "$U_PORT")
	if [ -f "$dir/record" ]; then
		if instance_alive "$dir"; then
			log "$name was started here before ($(describe "$dir")) and does not answer yet"
			PENDING=$dir
			return 0
		fi
		log "forgetting an earlier $name of this script that is no longer running ($dir)"
		rm -rf "$dir"
	fi
	if [ "$U_PORT" = "$compose_port" ] && docker_ready; then
		docker_start "$service" "$dir" || {
			missing "$name: '${COMPOSE[*]} up -d $service' failed (see above)"
			return 1
		}
		record_set "$dir" port "$U_PORT"
		PENDING=$dir
		return 0
	fi
	"${service}_installed" && installed=1
	if [ "$installed" = 0 ]; then
		if can_apt; then
			apt_install "$package" || {
				missing "$name: 'apt-get install $package' failed (see above)"
				return 1
			}
			# On a machine with systemd the package starts its own service.
			if py probe "$proto" "$U_HOST" "$U_PORT" 3; then
				log "$name answers at $shown after installing $package (its system service), using it"
				return 0
			fi
		else
			local how="'sudo apt-get install $package' on Debian/Ubuntu, elsewhere your system's $package package"
			[ "$(id -u)" = 0 ] && how="your system's $package package (no apt-get here)"
			missing "$name: nothing answers at $shown and $package is not installed: install it ($how), or start Docker and run 'docker compose up -d $service', then run this again"
			return 1
		fi
	fi
	if [ "$service" = rabbitmq ]; then
		if [ "$U_PORT" = "$SYSTEM_PORT" ] && [ "$(id -u)" = 0 ] && command -v "${RABBITMQCTL[0]}" >/dev/null 2>&1; then
			rabbitmq_start_system "$dir" || {
				missing "$name: the system node does not serve $shown, and this script started nothing (see above)"
				return 1
			}
		else
			rabbitmq_launch_private "$dir" "$U_PORT" || {
				abandon "$dir"
				missing "$name: could not start a private node on port $U_PORT (see above)"
				return 1
			}
		fi
		PENDING=$dir
		return 0
	fi
	redis_start "$dir" "$U_PORT" || {
		abandon "$dir"
		missing "$name: could not start redis-server on port $U_PORT (see above)"
		return 1
	}
	log "Redis answers at $shown (started: $(describe "$dir"))"
}

cmd_up() {
	lock_state
	local status=0 rabbit_pending line
	# RabbitMQ first: it boots while Redis starts.
	ensure_begin rabbitmq "$AMQP_URL" amqp "$COMPOSE_AMQP_PORT" rabbitmq-server || status=1
	rabbit_pending=$PENDING
	ensure_begin redis "$REDIS_URL" redis "$COMPOSE_REDIS_PORT" redis-server || status=1
	if [ -n "$PENDING" ]; then
		parse_url "$REDIS_URL" redis
		if redis_await "$PENDING"; then
			log "Redis answers at $(redact "$REDIS_URL") (started: $(describe "$PENDING"))"
		else
			missing "Redis: did not come up (see above)"
			status=1
		fi
	fi
	if [ -n "$rabbit_pending" ]; then
		parse_url "$AMQP_URL" amqp
		if ! rabbitmq_await "$rabbit_pending"; then
			[ "$(record_get "$rabbit_pending" kind)" = private ] && abandon "$rabbit_pending"
			missing "RabbitMQ: did not come up (see above)"
			status=1
		fi
	fi
	for line in "${MISSING[@]}"; do err "MISSING $line"; done
	return "$status"
}

# -- down ------------------------------------------------------------------------------------

# Stop what one record says this script started, and forget it. Returns 1 if it still runs.
stop_instance() {
	local dir=$1 kind service node tags=() tag id
	kind=$(record_get "$dir" kind)
	service=$(record_get "$dir" service)
	case "$kind" in
	docker)
		id=$(record_get "$dir" container)
		if instance_alive "$dir"; then
			log "stopping $service: docker stop ${id:0:12}"
			timeout "$STOP_TIMEOUT_S" docker stop "$id" >/dev/null || return 1
		else
			log "$service container ${id:0:12} is not running; nothing to stop"
		fi
		;;
	system)
		tag=$(record_get "$dir" pid)
		node=$(record_get "$dir" node)
		if [ -z "$tag" ]; then
			log "the RabbitMQ system node started here has no recorded pid (it never answered); stop it yourself if it runs: rabbitmqctl stop"
		elif ! tag_alive "$tag"; then
			log "RabbitMQ system node $node (pid ${tag%%:*}) is no longer running; nothing to stop"
		elif [ "$(record_get "$dir" started)" = app ]; then
			log "stopping the RabbitMQ app on system node $node again: rabbitmqctl stop_app"
			timeout "$STOP_TIMEOUT_S" "${RABBITMQCTL[@]}" -n "$node" stop_app >/dev/null || return 1
		else
			log "stopping RabbitMQ system node $node (pid ${tag%%:*}): rabbitmqctl stop"
			timeout "$STOP_TIMEOUT_S" "${RABBITMQCTL[@]}" -n "$node" stop >/dev/null 2>&1 || true
			stop_tags "$tag" || return 1
		fi
		;;
	private)
		for tag in $(record_get "$dir" pid) $(record_get "$dir" wrapper); do tags+=("$tag"); done
		if [ "${#tags[@]}" -gt 0 ] && instance_alive "$dir"; then
			log "stopping $(describe "$dir")"
			stop_tags "${tags[@]}" || {
				err "$service of $dir still runs"
				return 1
			}
		else
			log "$service of $dir is no longer running; nothing to stop"
		fi
		;;
	*) log "unknown record in $dir; leaving it alone" && return 1 ;;
	esac
	case "$dir" in
	"$STATE"/rabbitmq-* | "$STATE"/redis-*) rm -rf "$dir" ;;
	esac
}

cmd_down() {
	if [ ! -d "$STATE" ]; then
		log "nothing to stop: nothing was started with state folder $STATE"
		return 0
	fi
	lock_state
	local dir any=0 status=0
	for dir in "$STATE"/*/; do
		dir=${dir%/}
		[ -f "$dir/record" ] || continue
		any=1
		stop_instance "$dir" || status=1
	done
	[ "$any" = 1 ] || log "nothing to stop: 'up' started nothing here ($STATE)"
	return "$status"
}

# -- status ----------------------------------------------------------------------------------

cmd_status() {
	local dir url proto name state
	for name in RabbitMQ Redis; do
		if [ "$name" = RabbitMQ ]; then url=$AMQP_URL proto=amqp; else url=$REDIS_URL proto=redis; fi
		state="does not answer"
		if [[ $url != *,* ]] && parse_url "$url" "$proto" && py probe "$U_SCHEME" "$U_HOST" "$U_PORT" 3; then
			state=answers
		fi
		log "$name at $(redact "$url"): $state"
	done
	local any=0
	if [ -d "$STATE" ]; then
		for dir in "$STATE"/*/; do
			dir=${dir%/}
			[ -f "$dir/record" ] || continue
			any=1
			if instance_alive "$dir"; then
				state=running
			else
				state="no longer running"
			fi
			log "started by 'up': $(record_get "$dir" service) on port $(record_get "$dir" port): $(describe "$dir") ($state)"
		done
	fi
	[ "$any" = 1 ] || log "started by 'up': nothing (state folder $STATE)"
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
*)
	sed -n '2,/^set -euo/{/^#/p}' "$0" >&2
	exit 2
	;;
esac

# Shared by benches/load.sh and benches/profile.sh (sourced, not run): the
# tools, ports, nginx instances and idemproxy processes of the load rig.
# Everything binds 127.0.0.1; `start_rig` sets up the scratch directory
# (WORK) and what to stop at exit (PIDS) that the others use.

# Installs what the rig needs from Debian's packages when running as root:
# `need_tools nginx wrk redis-server`.
need_tools() {
  local tool missing=()
  for tool in "$@"; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
  [ ${#missing[@]} = 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "${0##*/} needs: ${missing[*]}" >&2; exit 1
  fi
  local packages=()
  for tool in "${missing[@]}"; do
    case $tool in
      nginx) packages+=(nginx-light) ;;
      perf) packages+=(linux-perf) ;;
      *) packages+=("$tool") ;;
    esac
  done
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
}

# Builds the release binary and the fixed-rate load generator, makes the
# scratch directory and stops everything in it at exit: the start of every
# script of the rig. Sets BIN ($PROXY_BIN when set: another build, not
# built here), LOADGEN, FLOOR, API_UPSTREAM, WORK and PIDS.
start_rig() {
  # The examples need the dev-dependencies, and features they turn on
  # reach whatever the same command builds: tokio's `test-util` put a
  # paused-clock check in every `Instant::now` of a proxy built beside
  # them (~500 instructions per request). The proxy is built on its own,
  # last, as it ships.
  cargo build --release --locked --quiet --example loadgen --example bare_forward --example api_upstream
  [ -n "${PROXY_BIN:-}" ] || cargo build --release --locked --quiet --bin idemproxy
  local target=${CARGO_TARGET_DIR:-target}
  BIN=${PROXY_BIN:-$target/release/idemproxy}
  LOADGEN=$target/release/examples/loadgen
  FLOOR=$target/release/examples/bare_forward
  API_UPSTREAM=$target/release/examples/api_upstream
  WORK=$(mktemp -d)
  PIDS=()
  trap stop_rig EXIT
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

# nginx_conf NAME PORT SERVER-BODY: an nginx (worker_processes auto) whose
# one server listens on PORT; its master's pid in $WORK/NAME.pid. The
# `backend` upstream is the `return 201` upstream on $UP, kept alive.
nginx_conf() {
  cat >"$WORK/$1.conf" <<CONF
worker_processes auto;
pid $WORK/$1.pid;
error_log $WORK/$1.error.log warn;
events { worker_connections 4096; }
http {
  access_log $WORK/$1.access.log;
  client_body_temp_path $WORK/$1.body;
  proxy_temp_path $WORK/$1.proxy;
  upstream backend { server 127.0.0.1:$UP; keepalive 64; }
  server {
    listen 127.0.0.1:$2;
    $3
  }
}
CONF
  nginx -c "$WORK/$1.conf" -p "$WORK"
  wait_port "$2"
}

# The upstream every target proxies to: nginx answering 201 with a small
# JSON body, as fast an upstream as this machine has.
start_upstream() {
  nginx_conf upstream "$UP" 'location / { default_type application/json; return 201 "{\"id\":\"pay_1\",\"status\":\"succeeded\"}"; }'
}

# start_control PORT: the control, nginx as a plain reverse proxy in front
# of the upstream (HTTP/1.1 with keep-alive to it, as a tuned setup has).
start_control() {
  nginx_conf control "$1" 'location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }'
}

# start_redis PORT: a private Redis as an operator would run it for
# idempotency records (AOF, fsync every second); pid in $WORK/redis-server.pid.
start_redis() {
  redis-server --port "$1" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync everysec --dir "$WORK" --daemonize no >"$WORK/redis.log" 2>&1 &
  PIDS+=($!); echo $! >"$WORK/redis-server.pid"; wait_port "$1"
}

# start_proxy NAME PORT STORE [VAR=value...]: the release binary (or
# $PROXY_BIN, another build) in front of the upstream, logging at info as in
# production; pid in $WORK/NAME.pid.
start_proxy() {
  local name=$1 port=$2 kind=$3; shift 3
  env IDEMPROXY_LOG__LEVEL=info "$@" "${PROXY_BIN:-$BIN}" --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" \
    --upstream "http://127.0.0.1:$UP" --store "$kind" --redis-url "$(store_url "$kind")" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!); echo $! >"$WORK/$name.pid"; wait_port "$port"
}

# store_url KIND: the private PostgreSQL for `postgres` (start_postgres),
# else the private Redis.
store_url() {
  case $1 in
    postgres) echo "postgres://postgres@127.0.0.1:$PGP/postgres" ;;
    *) echo "redis://127.0.0.1:${RP:-6379}" ;;
  esac
}

# start_postgres PORT: a private PostgreSQL as an operator would run it
# (fsync and synchronous_commit on, the defaults), initdb'd into $WORK/pg
# (as user postgres when running as root, as PostgreSQL requires); sets
# PGP, and PG_PIDS to the postmaster and its backends (read again after
# the proxies connect: store_pids).
start_postgres() {
  PGP=$1
  local bindir as=()
  bindir=$(dirname "$(readlink -f "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")")
  mkdir -p "$WORK/pg"
  if [ "$(id -u)" = 0 ]; then chown postgres: "$WORK" "$WORK/pg"; as=(runuser -u postgres --); fi
  "${as[@]}" "$bindir/initdb" -A trust -U postgres -D "$WORK/pg/data" >"$WORK/initdb.log"
  "${as[@]}" "$bindir/pg_ctl" -D "$WORK/pg/data" -l "$WORK/pg/server.log" -w \
    -o "-p $PGP -k $WORK/pg -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
  head -1 "$WORK/pg/data/postmaster.pid" >"$WORK/postgres-server.pid"
  PG_STOP=("${as[@]}" "$bindir/pg_ctl" -D "$WORK/pg/data" -m fast stop)
}

# The postmaster and every backend of the private PostgreSQL.
postgres_pids() {
  local master
  master=$(cat "$WORK/postgres-server.pid")
  echo "$master"; pgrep -P "$master"
}

# start_floor PORT: examples/bare_forward in front of the upstream, the
# floor of idemproxy's stack (hyper's server and hyper-util's pooled
# client on one current-thread runtime per CPU, nothing else); pid in
# $WORK/floor.pid.
start_floor() {
  "$FLOOR" "127.0.0.1:$1" "http://127.0.0.1:$UP" >"$WORK/floor.log" 2>&1 &
  PIDS+=($!); echo $! >"$WORK/floor.pid"; wait_port "$1"
}

# Stops what the rig started: $PIDS, and the nginx masters by pid file.
stop_rig() {
  local pid f
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  [ -n "${PG_STOP:-}" ] && "${PG_STOP[@]}" >/dev/null 2>&1 || true
  for f in "$WORK"/upstream.pid "$WORK"/control.pid; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 0.3
  rm -rf "$WORK"
}

# --- benches/storage.sh --------------------------------------------------

# start_api_upstream NAME PORT [START]: examples/api_upstream ($API_UPSTREAM),
# varied payment objects numbered from START (default 0); pid in
# $WORK/NAME.pid.
start_api_upstream() {
  "$API_UPSTREAM" "127.0.0.1:$2" "${3:-0}" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!); echo $! >"$WORK/$1.pid"; wait_port "$2"
}

# start_redis_volatile NAME PORT: a private Redis without persistence (no
# AOF, no RDB), for measuring memory; its files in $WORK/NAME, pid in
# $WORK/NAME.pid.
start_redis_volatile() {
  mkdir -p "$WORK/$1"
  redis-server --port "$2" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK/$1" --daemonize no >"$WORK/$1.log" 2>&1 &
  PIDS+=($!); echo $! >"$WORK/$1.pid"; wait_port "$2"
}

# start_proxy_admin NAME PORT ADMIN STORE [VAR=value...]: start_proxy with
# a known admin port (its /metrics and /readyz), waiting until /readyz
# answers 200; pid in $WORK/NAME.pid.
start_proxy_admin() {
  local name=$1 port=$2 admin=$3 kind=$4; shift 4
  env IDEMPROXY_LOG__LEVEL=info "$@" "${PROXY_BIN:-$BIN}" --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
    --upstream "http://127.0.0.1:$UP" --store "$kind" --redis-url "$(store_url "$kind")" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!); echo $! >"$WORK/$name.pid"; wait_port "$port"
  local _
  for _ in $(seq 100); do
    curl -fsS -o /dev/null "http://127.0.0.1:$admin/readyz" 2>/dev/null && return 0
    sleep 0.05
  done
  echo "$name never became ready (log: $WORK/$name.log)" >&2; tail -5 "$WORK/$name.log" >&2; exit 1
}

# stop_pid PID: stops one process this rig started (SIGTERM, waits up to
# 10 s, then SIGKILL) and forgets it, so stop_rig never signals a reused
# pid.
stop_pid() {
  local pid=$1 p _ kept=()
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null || true
  for p in "${PIDS[@]}"; do [ "$p" = "$pid" ] || kept+=("$p"); done
  PIDS=("${kept[@]}")
}

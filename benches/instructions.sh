#!/usr/bin/env bash
# User-space instructions per request under valgrind's cachegrind: the
# figure that repeats from run to run on a shared machine where timings do
# not, so it judges a change of a few percent. The proxy (one worker, the
# memory store unless STORE says otherwise) serves examples/api_upstream's
# ~1.1 KB payment objects (every one different, as a real API's) and
# examples/loadgen's ~1 KB JSON POSTs at 300/s. Each build runs twice,
# with 600 and with 3,000 requests; the difference over the 2,400 requests
# between them leaves out startup and shutdown. Requests go one at a time
# on one keep-alive connection; replays are of 1,000 keys stored before
# either run counts (the same warm-up in both). SHA-256's block function is
# left out: valgrind hides the CPU's SHA extensions, so under it sha2 runs
# its portable code, ~75k instructions per first execution that the CPU
# does in a fraction of it. On the embedded store, fjall's worker queue
# is left out too: its worker 0 never compacts but hands each compaction
# request back to the queue and takes it again until another worker is
# free, a busy-wait that valgrind, running one thread at a time, lets run
# for whole scheduling slices (13.6-18 million instructions per request
# counted, varying from run to run). Natively that loop takes ~1-3% of a
# core (docs/performance.md, "fjall's worker deadlock"). nginx, as a
# plain reverse proxy (one worker, keep-alive to the upstream), serves the
# same traffic under cachegrind the same way: the `x nginx` column is each
# row over it.
#
#   benches/instructions.sh                         # unique replay passthrough
#   STORE=redis benches/instructions.sh unique      # a private redis-server
#   STORE=embedded benches/instructions.sh unique   # fjall, in a fresh scratch
#                                                   # directory for every run
#   benches/instructions.sh floor passthrough       # examples/bare_forward (hyper
#       # and hyper-util forwarding, nothing else: the floor of idemproxy's
#       # own stack) beside the keyless row
#   BASELINE=../old/target/release/idemproxy benches/instructions.sh unique
#   PROXY_ENV="IDEMPROXY_TELEMETRY__SAMPLE_RATIO=0.1" benches/instructions.sh
#   PROFILES=/tmp/cg benches/instructions.sh unique # keeps cachegrind's files:
#       cg_diff the short and the long run, then cg_annotate the difference
#   OTLP=1 benches/instructions.sh unique           # traces on, to a receiver
#                                                   # that answers 200 to all
#
# With BASELINE, both builds run the same traffic and the table gives the
# difference. With OTLP=1, a small receiver (python3) takes the proxy's
# span exports and `[telemetry] otlp_endpoint` points at it.
#
# Needs valgrind and nginx (installed from Debian's packages when missing
# and running as root). Everything binds 127.0.0.1 and stops at exit.
set -euo pipefail
cd "$(dirname "$0")/.."

STORE=${STORE:-memory}
MODES=("$@")
[ ${#MODES[@]} = 0 ] && MODES=(unique replay passthrough)
RATE=300
SHORT=2 LONG=10 # seconds at RATE

. benches/lib.sh
need_tools valgrind nginx
if [ "$STORE" = redis ]; then
  need_tools redis-server
  command -v redis-cli >/dev/null || need_tools redis-tools
fi
start_rig
UP=$(free_port)
start_api_upstream upstream "$UP"

proxy_env=(IDEMPROXY_LOG__LEVEL=info IDEMPROXY_WORKERS=1)
if [ "$STORE" = redis ]; then
  RP=$(free_port)
  start_redis "$RP"
  proxy_env+=(IDEMPROXY_STORE__URL="redis://127.0.0.1:$RP")
fi
# shellcheck disable=SC2206 # PROXY_ENV is a list of NAME=VALUE words
[ -n "${PROXY_ENV:-}" ] && proxy_env+=($PROXY_ENV)
if [ -n "${OTLP:-}" ]; then
  OT=$(free_port)
  python3 - "$OT" >"$WORK/otlp.log" 2>&1 <<'EOF' &
import http.server, sys
class Collector(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Collector).serve_forever()
EOF
  PIDS+=($!); wait_port "$OT"
  proxy_env+=(IDEMPROXY_TELEMETRY__OTLP_ENDPOINT="http://127.0.0.1:$OT")
fi

# instructions BIN MODE SECONDS: the proxy's user-space instructions, from
# start to exit, serving SECONDS of MODE traffic.
instructions() {
  local bin=$1 mode=$2 seconds=$3 port out pid
  port=$(free_port)
  out="$WORK/cachegrind.out.$mode.$seconds.$RANDOM"
  # Every run starts from an empty Redis, as from an empty memory store:
  # a compression dictionary one run learned would spare the next its
  # learning, and the difference of the two would not be per request.
  [ "$STORE" = redis ] && redis-cli -p "$RP" flushall >/dev/null
  # Likewise an empty embedded store: a directory of its own for each run.
  local store_env=()
  [ "$STORE" = embedded ] && store_env=(IDEMPROXY_STORE__PATH="$WORK/embedded.$mode.$seconds.$RANDOM")
  env "${proxy_env[@]}" "${store_env[@]}" valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file="$out" \
    "$bin" --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" \
    --upstream "http://127.0.0.1:$UP" --store "$STORE" >"$WORK/proxy.log" 2>&1 &
  pid=$!
  serve "$pid" "$port" "$mode" "$seconds" TERM
  [ -n "${PROFILES:-}" ] && mkdir -p "$PROFILES" && cp "$out" "$PROFILES/${bin//\//_}.$mode.$seconds"
  counted "$out"
}

# counted FILE: the instructions cachegrind counted, less those of sha2's
# SHA-256 block function and of fjall's worker queue (see the top).
counted() {
  cg_annotate --auto=no --threshold=0 "$1" | awk '
    /PROGRAM TOTALS/ { gsub(",", "", $1); total = $1 }
    /sha2::sha256::compress256/ { gsub(",", "", $1); left += $1 }
    /:fjall::worker_pool::WorkerPool::start::\{\{closure\}\}::\{\{closure\}\}$|:flume::/ { gsub(",", "", $1); left += $1 }
    END { printf "%d\n", total - left }'
}

# serve PID PORT MODE SECONDS SIGNAL: once the process PID listens on
# PORT (valgrind takes seconds to start it), SECONDS of MODE traffic
# (replays after their keys are stored), then SIGNAL, and waits for it to
# exit and write its counts.
serve() {
  local pid=$1 port=$2 mode=$3 seconds=$4 signal=$5
  for _ in $(seq 600); do (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.05; done
  [ "$mode" = replay ] && load "$port" replay $((1000 / RATE + 1))
  load "$port" "$mode" "$seconds"
  kill "-$signal" "$pid"
  wait "$pid" || true
}

# load PORT MODE SECONDS: the traffic, to api_upstream's one-object path.
load() {
  CONNECTIONS=1 "$LOADGEN" "http://127.0.0.1:$1/small/v1/payments" "$RATE" "$3" "$2" "ins-$2-$3-$RANDOM" >"$WORK/loadgen.txt"
}

# nginx_instructions SECONDS: nginx's (one process, no master) for SECONDS
# of keyless traffic; it does the same for every mode.
nginx_instructions() {
  local port out pid
  port=$(free_port)
  out="$WORK/cachegrind.out.nginx.$1.$RANDOM"
  cat >"$WORK/measured.conf" <<CONF
daemon off;
master_process off;
worker_processes 1;
pid $WORK/measured.pid;
error_log $WORK/measured.error.log warn;
events { worker_connections 1024; }
http {
  access_log $WORK/measured.access.log;
  client_body_temp_path $WORK/measured.body;
  proxy_temp_path $WORK/measured.proxy;
  upstream backend { server 127.0.0.1:$UP; keepalive 64; }
  server {
    listen 127.0.0.1:$port;
    location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection ""; }
  }
}
CONF
  valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file="$out" \
    nginx -c "$WORK/measured.conf" -p "$WORK" >"$WORK/nginx.log" 2>&1 &
  pid=$!
  serve "$pid" "$port" passthrough "$1" QUIT
  counted "$out"
}

# floor_instructions SECONDS: examples/bare_forward's (one worker) for
# SECONDS of keyless traffic, under cachegrind as the proxy is.
floor_instructions() {
  local port out pid
  port=$(free_port)
  out="$WORK/cachegrind.out.floor.$1.$RANDOM"
  valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file="$out" \
    "$FLOOR" "127.0.0.1:$port" "http://127.0.0.1:$UP" 1 >"$WORK/floor.log" 2>&1 &
  pid=$!
  serve "$pid" "$port" passthrough "$1" TERM
  counted "$out"
}

# per_request COMMAND ARGS...: COMMAND's instructions per request, from a
# short and a long run.
per_request() {
  local short long
  short=$("$@" "$SHORT")
  long=$("$@" "$LONG")
  echo $(((long - short) / ((LONG - SHORT) * RATE)))
}

# times A B: A over B, two decimals.
times() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

nginx=$(per_request nginx_instructions)
printf 'store: %s; nginx (reverse proxy, one worker): %s instructions per request\n' "$STORE" "$nginx"
printf '%-12s %14s %8s' mode "this build" "x nginx"
[ -n "${BASELINE:-}" ] && printf ' %14s %8s %10s' baseline "x nginx" change
printf '\n'
for mode in "${MODES[@]}"; do
  if [ "$mode" = floor ]; then
    now=$(per_request floor_instructions)
    printf '%-12s %14s %8s\n' "$mode" "$now" "$(times "$now" "$nginx")"
    continue
  fi
  now=$(per_request instructions "$BIN" "$mode")
  printf '%-12s %14s %8s' "$mode" "$now" "$(times "$now" "$nginx")"
  if [ -n "${BASELINE:-}" ]; then
    base=$(per_request instructions "$BASELINE" "$mode")
    printf ' %14s %8s %+10d' "$base" "$(times "$base" "$nginx")" $((now - base))
  fi
  printf '\n'
done

#!/usr/bin/env bash
# User-space instructions per request under valgrind's cachegrind: the
# figure that repeats from run to run on a shared machine where timings do
# not, so it judges a change of a few percent. The proxy (one worker, the
# memory store unless STORE says otherwise) serves the load rig's upstream
# (nginx `return 201`) and examples/loadgen's ~1 KB JSON POSTs at 300/s.
# Each build runs twice, with 600 and with 3,000 requests; the difference
# over the 2,400 requests between them leaves out startup and shutdown.
#
#   benches/instructions.sh                         # unique replay passthrough
#   BASELINE=../old/target/release/idemproxy benches/instructions.sh unique
#   PROXY_ENV="IDEMPROXY_TELEMETRY__SAMPLE_RATIO=0.1" benches/instructions.sh
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
start_rig
UP=$(free_port)
start_upstream

proxy_env=(IDEMPROXY_LOG__LEVEL=info IDEMPROXY_WORKERS=1)
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
  env "${proxy_env[@]}" valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file="$out" \
    "$bin" --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" \
    --upstream "http://127.0.0.1:$UP" --store "$STORE" >"$WORK/proxy.log" 2>&1 &
  pid=$!
  # valgrind takes seconds to start the binary.
  for _ in $(seq 600); do (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.05; done
  "$LOADGEN" "http://127.0.0.1:$port/v1/payments" "$RATE" "$seconds" "$mode" "ins-$mode-$seconds-$RANDOM" >"$WORK/loadgen.txt"
  kill -TERM "$pid"
  wait "$pid" || true
  awk '/^summary:/ { print $2 }' "$out"
}

per_request() {
  local bin=$1 mode=$2 short long
  short=$(instructions "$bin" "$mode" "$SHORT")
  long=$(instructions "$bin" "$mode" "$LONG")
  echo $(((long - short) / ((LONG - SHORT) * RATE)))
}

printf '%-12s %14s' mode "this build"
[ -n "${BASELINE:-}" ] && printf ' %14s %10s' baseline change
printf '\n'
for mode in "${MODES[@]}"; do
  now=$(per_request "$BIN" "$mode")
  printf '%-12s %14s' "$mode" "$now"
  if [ -n "${BASELINE:-}" ]; then
    base=$(per_request "$BASELINE" "$mode")
    printf ' %14s %+10d' "$base" $((now - base))
  fi
  printf '\n'
done

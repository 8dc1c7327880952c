#!/usr/bin/env bash
# Where the proxy's CPU goes, per request, by part (fingerprint, store, log
# line, hyper, sockets...): the profile behind benches/load.sh's table.
# Builds the release binary, starts the load rig's upstream (nginx
# `return 201`) and one idemproxy, drives it with wrk (the same ~1 KB JSON
# POSTs as load.sh), samples it with `perf record --call-graph dwarf` in
# the middle of the run, and prints CPU µs per request for each part, with
# the kernel's share (system calls count for the part that made them).
#
#   benches/profile.sh                         # memory store: unique passthrough replay
#   benches/profile.sh nginx passthrough       # the nginx control, then idemproxy, same traffic
#   STORE=redis benches/profile.sh unique      # on a private Redis
#   STORE=embedded benches/profile.sh unique   # on the default store, in a scratch directory
#   WORKERS=1 SECONDS_SAMPLED=5 benches/profile.sh replay
#
# Needs perf, nginx, wrk (and redis-server for STORE=redis), installed from
# Debian's packages when missing and running as root. Everything binds
# 127.0.0.1 and stops at exit. perf needs kernel.perf_event_paranoid <= 1
# or root.
set -euo pipefail
cd "$(dirname "$0")/.."

STORE=${STORE:-memory}
CONNS=${CONNS:-32}
SECONDS_SAMPLED=${SECONDS_SAMPLED:-3}
FREQUENCY=${FREQUENCY:-499}
MODES=("$@")
[ ${#MODES[@]} = 0 ] && MODES=(unique passthrough replay)

. benches/lib.sh
need_tools perf nginx wrk
[ "$STORE" = redis ] && need_tools redis-server

start_rig

UP=$(free_port); PX=$(free_port); RP=$(free_port); NG=$(free_port)
start_upstream
# The control of benches/load.sh, for the `nginx` mode: its workers are
# sampled under the keyless traffic (nginx ignores the key anyway).
start_control "$NG"
[ "$STORE" = redis ] && start_redis "$RP"
extra=()
[ -n "${WORKERS:-}" ] && extra+=(IDEMPROXY_WORKERS="$WORKERS")
[ "$STORE" = embedded ] && extra+=(IDEMPROXY_STORE__PATH="$WORK/embedded-data")
start_proxy proxy "$PX" "$STORE" "${extra[@]}"
URL="http://127.0.0.1:$PX/v1/payments"
"$LOADGEN" "$URL" 2000 0.5 replay >/dev/null

for mode in "${MODES[@]}"; do
  if [ "$mode" = nginx ]; then
    url="http://127.0.0.1:$NG/v1/payments" traffic=passthrough what="nginx (plain proxy)"
    pids=$(pgrep -P "$(cat "$WORK/control.pid")" | paste -sd,)
  else
    url=$URL traffic=$mode what="idemproxy on $STORE${WORKERS:+, workers = $WORKERS}"
    pids=$(cat "$WORK/proxy.pid")
  fi
  # wrk runs a second before and after the sampled window, so the window
  # sees steady load only.
  MODE=$traffic RUN="profile-$mode-$$" wrk -t1 -c"$CONNS" -d"$((SECONDS_SAMPLED + 2))s" -s benches/load/post.lua "$url" >"$WORK/wrk-$mode.txt" &
  wrk_pid=$!
  sleep 1
  perf record -q -F "$FREQUENCY" --call-graph dwarf,16384 -p "$pids" -o "$WORK/perf-$mode.data" -- sleep "$SECONDS_SAMPLED" 2>/dev/null
  wait "$wrk_pid"
  rps=$(awk '/Requests\/sec:/ {print $2}' "$WORK/wrk-$mode.txt")
  echo
  echo "$mode, $what: $rps req/s (wrk -c$CONNS), ${SECONDS_SAMPLED} s sampled at $FREQUENCY Hz"
  perf script -i "$WORK/perf-$mode.data" 2>/dev/null | python3 benches/load/profile.py "$SECONDS_SAMPLED" "$FREQUENCY" "$rps"
done

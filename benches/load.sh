#!/usr/bin/env bash
# Side-by-side load comparison, one run, one machine:
#   nginx as a plain reverse proxy (the control)  vs
#   idemproxy on the memory store  vs  idemproxy on a private Redis  vs
#   idemproxy on a private PostgreSQL (fsync and synchronous_commit on)  vs
#   idemproxy on the embedded store (the default: fjall, its journal fsync'd,
#   here in a scratch directory),
# and, for the unique-key traffic, the floor of idemproxy's own stack
# (examples/bare_forward: hyper's server and hyper-util's client, one
# current-thread runtime per CPU, forwarding and nothing else),
# all in front of the same fast upstream (nginx `return 201`), each proxy
# with the default configuration. Replays also run against a Redis-backed
# proxy without the local replay cache (`local_cache_entries = 0`), which
# asks Redis for every replay. WORKERS1=1 adds the memory and Redis proxies
# with `workers = 1` (one traffic thread instead of one per CPU).
#
# Load: POST, ~1 KB JSON body, a unique Idempotency-Key per request (wrk +
# benches/load/post.lua, MODE=unique), and the same without a key against
# the memory proxy (MODE=passthrough: the proxy without the idempotency
# work); then replays over 1,000 warmed keys (MODE=replay); then a fixed-rate
# run at half of nginx's maximum, or at 70% of the slowest fixed-rate
# proxy's if that is less (unique keys, and the passthrough traffic against
# the memory proxy), with latencies corrected for coordinated omission
# (examples/loadgen.rs).
# Targets are measured in alternating order over ROUNDS rounds; the table
# shows medians and ratios to nginx. Last, two soaks of SOAK_SECONDS each:
# unique keys against idemproxy-redis and a memory-store proxy whose records
# live 10 s, both at once, with their RSS sampled every 5 s; then a fresh
# embedded-store proxy alone (and BASELINE_BIN's after it), its req/s and
# RSS every 5 s, to show whether it keeps its rate as its directory fills.
#
#   benches/load.sh                 # ROUNDS=3 DURATION=3 CONNS=64, about 3 minutes
#   FIXED_RATE=5000 benches/load.sh # fixed-rate run at a chosen rate instead of
#                                   # min(half nginx's, 70% of the slowest proxy's)
#   BASELINE_BIN=../old/target/release/idemproxy benches/load.sh
#                                   # adds that build's memory and Redis proxies
#                                   # (baseline-memory, baseline-redis): two
#                                   # builds compared in the same run
#
# Needs nginx, wrk, redis-server and PostgreSQL's initdb (installed from Debian's packages when
# missing and running as root). Everything binds 127.0.0.1 and stops at exit.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-3}
CONNS=${CONNS:-64}
FIXED_SECONDS=${FIXED_SECONDS:-5}
WORKERS1=${WORKERS1:-0}
SOAK_SECONDS=${SOAK_SECONDS:-60}

. benches/lib.sh
need_tools nginx wrk redis-server
command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_tools postgresql

start_rig

UP=$(free_port); NG=$(free_port); FL=$(free_port); IM=$(free_port); I1=$(free_port); IR=$(free_port); IR1=$(free_port); IC=$(free_port); IS=$(free_port); IE=$(free_port); RP=$(free_port); IP=$(free_port)

start_upstream
start_control "$NG"
# What any proxy on hyper and tokio pays before doing anything of its own:
# the ceiling for idemproxy on this machine.
start_floor "$FL"

start_redis "$RP"
start_postgres "$(free_port)"

start_proxy memory "$IM" memory
start_proxy redis "$IR" redis
start_proxy postgres "$IP" postgres
# Every replay a round trip to Redis: what the local replay cache saves.
start_proxy redis-nocache "$IC" redis IDEMPROXY_STORE__LOCAL_CACHE_ENTRIES=0
# The default store: durable, so every claim and completion waits for an
# fsync (grouped with the others in flight) on this machine's disk.
start_proxy embedded "$IE" embedded IDEMPROXY_STORE__PATH="$WORK/embedded-data"

declare -A URL=([nginx]="http://127.0.0.1:$NG" [hyper-floor]="http://127.0.0.1:$FL" [idemproxy-memory]="http://127.0.0.1:$IM" [idemproxy-memory-1w]="http://127.0.0.1:$I1" [idemproxy-redis]="http://127.0.0.1:$IR" [idemproxy-redis-1w]="http://127.0.0.1:$IR1" [idemproxy-redis-nocache]="http://127.0.0.1:$IC" [idemproxy-embedded]="http://127.0.0.1:$IE" [idemproxy-postgres]="http://127.0.0.1:$IP")
TARGETS=(nginx hyper-floor idemproxy-memory idemproxy-redis idemproxy-postgres idemproxy-embedded)
REPLAY_TARGETS=(nginx idemproxy-memory idemproxy-redis idemproxy-redis-nocache idemproxy-postgres idemproxy-embedded)
if [ "$WORKERS1" = 1 ]; then
  # One traffic worker instead of one per CPU: on two cores that the load
  # generator and the upstream also use, fewer threads can mean fewer
  # wake-ups and context switches (a sidecar shares its cores too).
  start_proxy memory-1w "$I1" memory IDEMPROXY_WORKERS=1
  start_proxy redis-1w "$IR1" redis IDEMPROXY_WORKERS=1
  TARGETS+=(idemproxy-memory-1w idemproxy-redis-1w)
  REPLAY_TARGETS+=(idemproxy-memory-1w idemproxy-redis-1w)
fi
if [ -n "${BASELINE_BIN:-}" ]; then
  BM=$(free_port); BR=$(free_port); BE=$(free_port)
  PROXY_BIN=$BASELINE_BIN start_proxy baseline-memory "$BM" memory
  # Its own keys: a build before compression reads the records a newer one
  # packed as corrupt (503), and the replay runs share their keys.
  PROXY_BIN=$BASELINE_BIN start_proxy baseline-redis "$BR" redis IDEMPROXY_STORE__KEY_PREFIX=baseline:
  PROXY_BIN=$BASELINE_BIN start_proxy baseline-embedded "$BE" embedded IDEMPROXY_STORE__PATH="$WORK/baseline-embedded-data"
  URL[baseline-memory]="http://127.0.0.1:$BM"; URL[baseline-redis]="http://127.0.0.1:$BR"; URL[baseline-embedded]="http://127.0.0.1:$BE"
  TARGETS+=(baseline-memory baseline-redis baseline-embedded)
  REPLAY_TARGETS+=(baseline-memory baseline-redis baseline-embedded)
fi
FIXED_TARGETS=(nginx idemproxy-memory idemproxy-redis)
RESULTS="$WORK/results.txt"; : >"$RESULTS"

# Warm 1,000 keys on each proxy for the replay runs.
for t in "${REPLAY_TARGETS[@]:1}"; do
  "$LOADGEN" "${URL[$t]}/v1/payments" 2000 0.5 replay >/dev/null
done

# CPU time (user + system, clock ticks) of processes and all their threads.
ticks() {
  local total=0 task f
  for pid in "$@"; do
    for task in /proc/"$pid"/task/*/stat; do
      read -r -a f <"$task" 2>/dev/null || continue
      total=$((total + f[13] + f[14]))
    done
  done
  echo "$total"
}
# The processes that serve a target: the proxy itself (nginx: master and
# workers), the upstream, and for Redis-backed proxies the Redis server.
proxy_pids() {
  case $1 in
    nginx) cat "$WORK/control.pid"; pgrep -P "$(cat "$WORK/control.pid")" ;;
    hyper-floor) cat "$WORK/floor.pid" ;;
    idemproxy-memory) cat "$WORK/memory.pid" ;;
    idemproxy-memory-1w) cat "$WORK/memory-1w.pid" ;;
    idemproxy-redis) cat "$WORK/redis.pid" ;;
    idemproxy-redis-1w) cat "$WORK/redis-1w.pid" ;;
    idemproxy-redis-nocache) cat "$WORK/redis-nocache.pid" ;;
    idemproxy-embedded) cat "$WORK/embedded.pid" ;;
    idemproxy-postgres) cat "$WORK/postgres.pid" ;;
    baseline-memory) cat "$WORK/baseline-memory.pid" ;;
    baseline-redis) cat "$WORK/baseline-redis.pid" ;;
    baseline-embedded) cat "$WORK/baseline-embedded.pid" ;;
  esac
}
upstream_pids() { cat "$WORK/upstream.pid"; pgrep -P "$(cat "$WORK/upstream.pid")"; }
# The store's processes: PostgreSQL's postmaster and backends for its
# target, else redis-server.
store_pids() {
  case $1 in
    idemproxy-postgres) postgres_pids ;;
    *) cat "$WORK/redis-server.pid" ;;
  esac
}
HZ=$(getconf CLK_TCK)

run_wrk() { # scenario target round
  local out proxy upstream store
  local -a pp up sp
  mapfile -t pp < <(proxy_pids "$2"); mapfile -t up < <(upstream_pids); mapfile -t sp < <(store_pids "$2")
  proxy=$(ticks "${pp[@]}"); upstream=$(ticks "${up[@]}"); store=$(ticks "${sp[@]}")
  # The load generator's own CPU (user + system, from bash's `time`): it
  # shares the two cores with the target, so what it spends is not
  # available to the target.
  local TIMEFORMAT='%U %S' loadgen_s
  loadgen_s=$( { time MODE="$1" RUN="r$3-$2" wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency -s benches/load/post.lua "${URL[$2]}/v1/payments" >"$WORK/wrk.out"; } 2>&1 )
  out=$(cat "$WORK/wrk.out")
  proxy=$(( $(ticks "${pp[@]}") - proxy )); upstream=$(( $(ticks "${up[@]}") - upstream ))
  store=$(( $(ticks "${sp[@]}") - store ))
  local rps p50 p99 non2xx requests
  rps=$(awk '/Requests\/sec:/ {print $2}' <<<"$out")
  p50=$(awk '$1=="50%" {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {print $2}' <<<"$out")
  non2xx=$(awk '/Non-2xx/ {print $5}' <<<"$out")
  requests=$(awk '/requests in/ {print $1}' <<<"$out")
  # CPU per request, in µs: where each request's time goes, in this run.
  cpu() { python3 -c "print(f'{$1 * 1e6 / $HZ / max(1, $requests):.1f}')"; }
  echo "$1 $2 $3 rps=$rps p50=$p50 p99=$p99 non2xx=${non2xx:-0} cpu_proxy=$(cpu "$proxy") cpu_upstream=$(cpu "$upstream") cpu_redis=$(cpu "$store") cpu_loadgen=$(awk -v r="$requests" '{printf "%.1f", ($1 + $2) * 1e6 / (r > 0 ? r : 1)}' <<<"$loadgen_s")" >>"$RESULTS"
}

for round in $(seq "$ROUNDS"); do
  # Alternate the order so no target always runs first (or last) on a
  # machine that warms up or gets busier.
  order=("${TARGETS[@]}"); replay_order=("${REPLAY_TARGETS[@]}")
  if (( round % 2 == 0 )); then
    mapfile -t order < <(printf '%s\n' "${order[@]}" | tac)
    mapfile -t replay_order < <(printf '%s\n' "${replay_order[@]}" | tac)
  fi
  for t in "${order[@]}"; do run_wrk unique "$t" "$round"; done
  # The same POSTs without a key: forwarded unprotected, so this is the
  # proxy alone (hyper, tokio, request ids, the log line), compared with
  # nginx's unique-key run, which is the same traffic for nginx.
  run_wrk passthrough idemproxy-memory "$round"
  for t in "${replay_order[@]}"; do run_wrk replay "$t" "$round"; done
done

# Fixed rate at half of nginx's median maximum, but no more than 70% of
# the slowest fixed-rate proxy's: past its maximum a proxy queues without
# end, and its latencies measure the queue, not the proxy (on 2026-12-05's
# faster VM half of nginx's was above the Redis proxy's maximum, and its
# p50 read 2.3 s). 70%, not more: the fixed-rate load generator costs more
# CPU than wrk, and at 80% the Redis proxy's p50 still read 22.8 ms.
median_max() { awk -v t="$1" '$1=="unique" && $2==t {sub("rps=","",$4); print $4}' "$RESULTS" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
SLOWEST_MAX=$(for t in "${FIXED_TARGETS[@]:1}"; do median_max "$t"; done | sort -n | head -1)
RATE=${FIXED_RATE:-$(python3 -c "print(max(100, int(min(float('$(median_max nginx)') / 2, float('$SLOWEST_MAX') * 0.7))))")}
for t in "${FIXED_TARGETS[@]}"; do
  line=$("$LOADGEN" "${URL[$t]}/v1/payments" "$RATE" "$FIXED_SECONDS" unique "fixed-$t")
  echo "fixed $t 1 $line" >>"$RESULTS"
done
# The same without a key: the proxy's own latency, without the idempotency work.
line=$("$LOADGEN" "${URL[idemproxy-memory]}/v1/payments" "$RATE" "$FIXED_SECONDS" passthrough "fixed-passthrough")
echo "fixed passthrough 1 $line" >>"$RESULTS"

RSS_MEMORY=$(awk '/VmHWM/ {print $2}' "/proc/$(cat "$WORK/memory.pid")/status")
RSS_REDIS=$(awk '/VmHWM/ {print $2}' "/proc/$(cat "$WORK/redis.pid")/status")
RSS_EMBEDDED=$(awk '/VmHWM/ {print $2}' "/proc/$(cat "$WORK/embedded.pid")/status")

# Soak: does memory stay flat under sustained load? Redis-backed, the proxy
# keeps no records; on the memory store they live 10 s (purged every 2 s).
start_proxy soak "$IS" memory IDEMPROXY_IDEMPOTENCY__TTL=10s IDEMPROXY_STORE__PURGE_INTERVAL=2s
rss() { awk '/VmRSS/ {print $2}' "/proc/$(cat "$WORK/$1.pid")/status"; }
SOAK_REDIS=""; SOAK_MEMORY=""
(MODE=unique RUN=soak-r wrk -t1 -c"$CONNS" -d"${SOAK_SECONDS}s" -s benches/load/post.lua "${URL[idemproxy-redis]}/v1/payments" >"$WORK/soak-redis.txt") &
SOAK_WRK1=$!
(MODE=unique RUN=soak-m wrk -t1 -c"$CONNS" -d"${SOAK_SECONDS}s" -s benches/load/post.lua "http://127.0.0.1:$IS/v1/payments" >"$WORK/soak-memory.txt") &
SOAK_WRK2=$!
for _ in $(seq $((SOAK_SECONDS / 5))); do
  sleep 5
  SOAK_REDIS="$SOAK_REDIS $(rss redis)"; SOAK_MEMORY="$SOAK_MEMORY $(rss soak)"
done
wait "$SOAK_WRK1" "$SOAK_WRK2"
echo "soak idemproxy-redis 1 rps=$(awk '/Requests\/sec:/ {print $2}' "$WORK/soak-redis.txt") rss_kib=${SOAK_REDIS// /,}" >>"$RESULTS"
echo "soak idemproxy-memory-ttl10s 1 rps=$(awk '/Requests\/sec:/ {print $2}' "$WORK/soak-memory.txt") rss_kib=${SOAK_MEMORY// /,}" >>"$RESULTS"

# Soak of the embedded store: does it keep its rate and its memory as its
# directory fills? (An LSM tree's lookups and compactions grow with it: on
# 2026-12-05 fjall's defaults lost a third of the rate within 20 s.) A
# fresh proxy alone, SOAK_SECONDS of unique keys as 5 s runs in a row, RSS
# after each; with BASELINE_BIN, that build's the same way after it.
soak_embedded() { # NAME BINARY
  local port rates="" rsses="" i
  port=$(free_port)
  PROXY_BIN=$2 start_proxy "$1" "$port" embedded IDEMPROXY_STORE__PATH="$WORK/$1-data"
  for i in $(seq $((SOAK_SECONDS / 5))); do
    rates="$rates,$(MODE=unique RUN="$1-$i" wrk -t1 -c"$CONNS" -d5s -s benches/load/post.lua "http://127.0.0.1:$port/v1/payments" | awk '/Requests\/sec:/ {print $2}')"
    rsses="$rsses,$(rss "$1")"
  done
  echo "soak-embedded $1 1 rps_5s=${rates#,} rss_kib=${rsses#,} hwm_kib=$(awk '/VmHWM/ {print $2}' "/proc/$(cat "$WORK/$1.pid")/status")" >>"$RESULTS"
  # Waited for, so that its last flushes are not the next soak's load.
  stop_pid "$(cat "$WORK/$1.pid")"
}
soak_embedded idemproxy-embedded-soak "$BIN"
[ -z "${BASELINE_BIN:-}" ] || soak_embedded baseline-embedded-soak "$BASELINE_BIN"

python3 - "$RESULTS" "$RSS_MEMORY" "$RSS_REDIS" "$RSS_EMBEDDED" "$CONNS" "$DURATION" "$ROUNDS" "${TARGETS[*]}" "${REPLAY_TARGETS[*]}" <<'PY'
import statistics, sys, re
path, rss_mem, rss_redis, rss_embedded, conns, duration, rounds, unique, replay = sys.argv[1:]
rows = [l.split() for l in open(path)]
def ms(v):
    m = re.match(r"([\d.]+)(us|ms|s)$", v)
    if not m: return float("nan")
    x, u = float(m.group(1)), m.group(2)
    return x / 1000 if u == "us" else x * 1000 if u == "s" else x
def field(r, name):
    for f in r[3:]:
        if f.startswith(name + "="): return f.split("=", 1)[1]
    return None
targets = {"unique": unique.split(), "passthrough": ["idemproxy-memory"], "replay": replay.split()}
print(f"wrk -t1 -c{conns} -d{duration}s, {rounds} alternating rounds, medians; ~1 KB JSON POST")
print(f"{'scenario':<11} {'target':<23} {'req/s':>9} {'x nginx':>8} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}   CPU µs/request: proxy upstream store  wrk")
nginx_unique = None
ratio = {}
cpu = {}
for scenario in ["unique", "passthrough", "replay"]:
    # nginx ignores the key, so its unique-key run is the passthrough's base.
    base = nginx_unique if scenario == "passthrough" else None
    for t in targets[scenario]:
        rs = [r for r in rows if r[0] == scenario and r[1] == t]
        rps = statistics.median(float(field(r, "rps")) for r in rs)
        p50 = statistics.median(ms(field(r, "p50")) for r in rs)
        p99 = statistics.median(ms(field(r, "p99")) for r in rs)
        bad = sum(int(field(r, "non2xx") or 0) for r in rs)
        base = base or rps
        if scenario == "unique" and t == "nginx":
            nginx_unique = rps
        ratio[scenario, t] = rps / base
        c = cpu[scenario, t] = {part: statistics.median(float(field(r, "cpu_" + part) or "nan") for r in rs)
                                for part in ("proxy", "upstream", "redis", "loadgen")}
        redis = f"{c['redis']:6.1f}" if ("redis" in t or "postgres" in t) else f"{'-':>6}"
        print(f"{scenario:<11} {t:<23} {rps:>9.0f} {rps / base:>8.2f} {p50:>8.2f} {p99:>8.2f} {bad:>8}"
              f"   {c['proxy']:20.1f} {c['upstream']:8.1f} {redis} {c['loadgen']:5.1f}")
print()
fixed = [r for r in rows if r[0] == "fixed"]
if fixed:
    print(f"fixed rate {field(fixed[0], 'rate')} req/s, unique keys (passthrough: the same without a key, memory proxy), latency from the scheduled send time:")
    base = None
    for r in fixed:
        p99 = float(field(r, "p99_ms"))
        base = p99 if base is None else base
        print(f"  {r[1]:<17} p50 {float(field(r, 'p50_ms')):7.3f} ms  p99 {p99:7.3f} ms  (nginx p99 + {p99 - base:6.3f} ms)  p99.9 {float(field(r, 'p999_ms')):7.3f} ms  errors {field(r, 'errors')}")
print()
print(f"peak RSS over the runs above: idemproxy-memory {int(rss_mem) / 1024:.1f} MiB (records kept 24 h), idemproxy-redis {int(rss_redis) / 1024:.1f} MiB, idemproxy-embedded {int(rss_embedded) / 1024:.1f} MiB (records on disk)")
print()
print("targets (the CPU-per-request issue's, on the medians above; CPU ratios against nginx's CPU")
print("per request in the same scenario, req/s against nginx's first executions):")
def verdict(name, ok, shown):
    print(f"  {name:<58} {shown:>12}  {'met' if ok else 'NOT met'}")
def cpu_of(scenario, t, *parts):
    return sum(cpu[scenario, t][p] for p in parts)
if ("unique", "idemproxy-memory") in cpu:
    v = cpu_of("unique", "idemproxy-memory", "proxy") / cpu_of("unique", "nginx", "proxy")
    verdict("first executions, memory: proxy CPU/request <= 1.3x", v <= 1.3, f"{v:.2f}x")
if ("unique", "idemproxy-redis") in cpu:
    v = cpu_of("unique", "idemproxy-redis", "proxy", "redis") / cpu_of("unique", "nginx", "proxy")
    alone = cpu_of("unique", "idemproxy-redis", "redis") / cpu_of("unique", "nginx", "proxy")
    verdict(f"first executions, Redis: proxy + Redis CPU/request <= 1.8x", v <= 1.8, f"{v:.2f}x")
    print(f"  {'  (of which redis-server alone)':<58} {alone:>11.2f}x")
if ("unique", "idemproxy-postgres") in cpu:
    # No target: what a claim and a completion cost in PostgreSQL (two
    # statements, each a commit with its WAL flush) beside Redis's.
    v = cpu_of("unique", "idemproxy-postgres", "proxy", "redis") / cpu_of("unique", "nginx", "proxy")
    alone = cpu_of("unique", "idemproxy-postgres", "redis") / cpu_of("unique", "nginx", "proxy")
    print(f"  {'(no target) first executions, PostgreSQL: proxy + postgres CPU':<58} {v:>11.2f}x")
    print(f"  {'  (of which postgres alone)':<58} {alone:>11.2f}x")
if ("replay", "idemproxy-memory") in cpu:
    v = cpu_of("replay", "idemproxy-memory", "proxy") / cpu_of("replay", "nginx", "proxy")
    verdict("replays, memory: proxy CPU/request <= 0.6x", v <= 0.6, f"{v:.2f}x")
if ("unique", "idemproxy-embedded") in ratio:
    v = ratio[("unique", "idemproxy-embedded")]
    verdict("first executions, embedded: req/s >= 0.4x", v >= 0.4, f"{v:.3f}x")
if ("unique", "hyper-floor") in cpu:
    # Not a target: the same stack forwarding and nothing else, so the
    # least CPU a first execution or a passthrough can cost here.
    v = cpu_of("unique", "hyper-floor", "proxy") / cpu_of("unique", "nginx", "proxy")
    print(f"  {'(floor) hyper-floor, forwarding only: CPU/request':<58} {v:>11.2f}x")
if ("passthrough", "idemproxy-memory") in cpu:
    v = cpu_of("passthrough", "idemproxy-memory", "proxy") / cpu_of("unique", "nginx", "proxy")
    print(f"  {'(no key) passthrough, memory: CPU/request':<58} {v:>11.2f}x")
for t, kib in (("idemproxy-redis", rss_redis), ("idemproxy-embedded", rss_embedded)):
    v = int(kib) / 1024
    verdict(f"peak RSS, {t} < 64 MiB", v < 64, f"{v:.1f} MiB")
print(f"  {'(no target) peak RSS, idemproxy-memory, records kept 24 h':<58} {int(rss_mem) / 1024:>8.1f} MiB")
soak = [r for r in rows if r[0] == "soak"]
if soak:
    print()
    print("soak: unique keys, both proxies loaded at once; RSS every 5 s (MiB)")
    for r in soak:
        samples = [int(v) / 1024 for v in field(r, "rss_kib").strip(",").split(",") if v]
        if not samples:
            continue
        # Growth after warm-up: the last sample against the ones at 15 s and
        # at 30 s (a memory store fills up to TTL + purge interval worth of
        # records, and its hash tables grow in steps, before it levels off).
        at15 = samples[min(2, len(samples) - 1)]
        at30 = samples[min(5, len(samples) - 1)]
        print(f"  {r[1]:<28} {float(field(r, 'rps')):>8.0f} req/s  " + " ".join(f"{s:.0f}" for s in samples)
              + f"  (last vs 15 s: {samples[-1] - at15:+.1f} MiB, vs 30 s: {samples[-1] - at30:+.1f} MiB)")
soak = [r for r in rows if r[0] == "soak-embedded"]
if soak:
    print()
    print("soak: unique keys, the embedded store alone on a fresh directory; req/s and RSS (MiB) every 5 s")
    for r in soak:
        rates = [float(v) for v in field(r, "rps_5s").split(",") if v]
        samples = [int(v) / 1024 for v in field(r, "rss_kib").split(",") if v]
        if not rates:
            continue
        print(f"  {r[1]:<28} req/s " + " ".join(f"{v:.0f}" for v in rates))
        peak = int(field(r, "hwm_kib")) / 1024
        print(f"  {'':<28} RSS   " + " ".join(f"{s:.0f}" for s in samples) + f"  (peak {peak:.1f})")
        verdict(f"{r[1]}: last 5 s >= 0.9x the first", rates[-1] >= 0.9 * rates[0], f"{rates[-1] / rates[0]:.2f}x")
        # The issue's RSS bound, held for the whole soak, not only the
        # short rounds: the rate can hold while memory does not.
        verdict(f"{r[1]}: peak RSS < 64 MiB", peak < 64, f"{peak:.1f} MiB")
PY
if [ -n "${BASELINE_BIN:-}" ]; then
  echo "  peak RSS, baseline-embedded: $(awk '/VmHWM/ {printf "%.1f", $2 / 1024}' "/proc/$(cat "$WORK/baseline-embedded.pid")/status") MiB"
fi

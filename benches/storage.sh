#!/usr/bin/env bash
# What a stored response costs, with and without compression: bytes per
# record in each store, and the proxy's CPU per first execution and per
# replay, for compression off, zstd, and zstd with a dictionary trained on
# earlier responses (`idemproxy store train-dictionary`), for a ~1.1 KB
# response (/small, one payment object) and a ~16 KB one (/large, a list of
# 15), in front of examples/api_upstream.rs, whose responses vary as a real
# API's do (a constant body would compress to nothing).
#
# Each configuration (store x body x compression) gets a fresh store and a
# fresh upstream whose objects are numbered from MEASURE_START, so every
# configuration stores the same objects; the dictionaries are trained
# beforehand, one per body, from a zstd run on a Redis of their own with
# objects numbered from 0 (the measured objects are never in the train set).
# A run: N first executions with unique Idempotency-Keys (loadgen `unique`,
# ~1 KB JSON request bodies, at RATE req/s), then
#   - records: Redis DBSIZE, or the proxy's `executed` count (/metrics);
#   - bytes per record:
#       redis: INFO used_memory after - before, / records; plus the mean
#              MEMORY USAGE and STRLEN of 200 keys (SCAN ... COUNT 1000);
#       embedded: growth of the store directory (du -b) once the proxy has
#              stopped, / records (journal and tables: approximate);
#       memory: growth of the proxy's RSS, / records (approximate);
#       postgres: pg_total_relation_size of the records table (heap,
#              primary key and expires_at indexes, TOAST) after - before,
#              / rows, as written (each row was inserted as a claim, then
#              updated to its completion; before a VACUUM reuses the old
#              versions' space);
#   - CPU per first execution: the proxy's CPU time over the N requests
#     (every thread's /proc/PID/task/TID/schedstat, ns; the utime+stime
#     ticks of /proc/PID/stat are kept in the raw results as a check);
#   - CPU per replay: 1,000 keys warmed (loadgen `replay`), then REPLAYS
#     replays of them: answered from the local replay cache (Redis,
#     embedded) or from the process (memory); on Redis also through a second
#     proxy with `local_cache_entries = 0`, so every replay reads (and
#     decompresses) the stored record.
# The compression modes of one store and body run side by side (each with
# its own upstream, store and proxy) and their requests take turns in
# bursts of BURST (first executions) and 1,000 (replays), so a machine that
# gets busier or quieter weighs on every mode alike; the groups run in
# alternating order over ROUNDS rounds. The table shows medians, and
# ratio_to_body = bytes per record / mean response body (measured from the
# upstream with curl). Then the targets: Redis used_memory per /small record
# <= 0.75 x its body; CPU per first execution with zstd <= off + 3 µs; CPU
# per replay with zstd <= off (each with its difference in every round),
# and, for scale, what zstd itself takes on one body here (`zstd -b1`).
#
#   benches/storage.sh                       # N=5000 RATE=2000 ROUNDS=3, ~6 minutes
#   PROXY_BIN=/work/bin/idemproxy benches/storage.sh
#   COMPRESSION_MODES=legacy benches/storage.sh
#       # a build without compression: set no compression variables
#   STORES="redis" BODIES="small" ROUNDS=1 benches/storage.sh
#
# COMPRESSION_MODES: any of off zstd zstd-dict (default all three), or
# legacy. Needs redis-server (installed from Debian's packages when missing
# and running as root) and curl. Everything binds 127.0.0.1 and stops at exit.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-5000}
RATE=${RATE:-2000}
REPLAYS=${REPLAYS:-2000}
REPLAY_RATE=${REPLAY_RATE:-2000}
BURST=${BURST:-500}
ROUNDS=${ROUNDS:-3}
COMPRESSION_MODES=${COMPRESSION_MODES:-off zstd zstd-dict}
STORES=${STORES:-redis embedded memory postgres}
BODIES=${BODIES:-small large}
MEASURE_START=${MEASURE_START:-1000000}
SAMPLE_KEYS=200

. benches/lib.sh
need_tools redis-server curl
command -v redis-cli >/dev/null || need_tools redis-tools

TARGET=${CARGO_TARGET_DIR:-target}
# The proxy on its own, after the examples, as it ships (see start_rig in
# benches/lib.sh: the examples' dev-dependency features must not reach it).
cargo build --release --locked --quiet --example api_upstream --example loadgen
[ -n "${PROXY_BIN:-}" ] || cargo build --release --locked --quiet --bin idemproxy
BIN=${PROXY_BIN:-$TARGET/release/idemproxy}
LOADGEN=$TARGET/release/examples/loadgen
API_UPSTREAM=$TARGET/release/examples/api_upstream
WORK=$(mktemp -d)
PIDS=()
trap stop_rig EXIT
RESULTS="$WORK/results.txt"; : >"$RESULTS"
if [[ " $STORES " == *" postgres "* ]]; then
  command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_tools postgresql
  start_postgres "$(free_port)"
fi
# A configuration's tables in the private PostgreSQL, and their size on
# disk (heap, indexes, TOAST).
pg_prefix() { local n=${1//-/_}; echo "s_${n}_"; }
pg_query() { psql -X -At -h 127.0.0.1 -p "$PGP" -U postgres -d postgres -c "$1"; }
pg_size() { pg_query "SELECT pg_total_relation_size('${1}records')"; }

read -r -a MODES <<<"$COMPRESSION_MODES"
read -r -a STORE_LIST <<<"$STORES"
read -r -a BODY_LIST <<<"$BODIES"
for m in "${MODES[@]}"; do
  case $m in off|zstd|zstd-dict|legacy) ;; *) echo "unknown compression mode: $m" >&2; exit 2 ;; esac
done

# The variables that select a compression mode (none for `legacy`, a build
# that has no such fields and would refuse them).
mode_env() { # MODE BODY
  case $1 in
    off) echo IDEMPROXY_STORE__COMPRESSION=off ;;
    zstd) echo IDEMPROXY_STORE__COMPRESSION=zstd ;;
    zstd-dict) echo IDEMPROXY_STORE__COMPRESSION=zstd; echo "IDEMPROXY_STORE__COMPRESSION_DICTIONARY=$WORK/dict-$2" ;;
  esac
}

# A snapshot of a process's CPU time: `ticks T` (utime + stime of
# /proc/PID/stat, every thread, clock ticks) and one `TID NS` line per
# thread (schedstat: time on a CPU, ns). cpu_delta turns two into
# "NS TICKS": per thread, so a thread that ended between them takes away
# nothing (one that ends has been idle: tokio's blocking threads end after
# 10 s without work).
cpu_snapshot() { # PID FILE
  local t ns _
  {
    echo "ticks $(sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}')"
    for t in /proc/"$1"/task/*; do
      read -r ns _ 2>/dev/null <"$t/schedstat" && echo "${t##*/} $ns"
    done
  } >"$2"
}
cpu_delta() { # BEFORE AFTER
  awk 'NR == FNR { before[$1] = $2; next }
       $1 == "ticks" { ticks = $2 - before["ticks"]; next }
       { ns += $2 - ($1 in before ? before[$1] : 0) }
       END { print ns, ticks }' "$1" "$2"
}
HZ=$(getconf CLK_TCK)

# A counter of the proxy's /metrics: the sum of idemproxy_requests_total
# with that outcome.
outcome_count() { # ADMIN-PORT OUTCOME
  curl -fsS "http://127.0.0.1:$1/metrics" | awk -v o="outcome=\"$2\"" '/^idemproxy_requests_total\{/ && index($0, o) { s += $NF } END { printf "%d\n", s }'
}

# Replays the local replay cache answered.
cache_hits() { # ADMIN-PORT
  curl -fsS "http://127.0.0.1:$1/metrics" | awk '/^idemproxy_local_cache_hits_total/ { s += $NF } END { printf "%d\n", s }'
}

# N requests at RATE (loadgen sends RATE x SECONDS, truncated).
seconds_for() { awk -v n="$1" -v r="$2" 'BEGIN { printf "%.6f\n", (n + 0.5) / r }'; }

# Runs loadgen and checks that every request succeeded.
load() { # URL RATE COUNT MODE RUN
  local out
  out=$("$LOADGEN" "$1" "$2" "$(seconds_for "$3" "$2")" "$4" "$5")
  if ! grep -q " errors=0 " <<<"$out" || ! grep -q " ok=$3 " <<<"$out"; then
    echo "loadgen $4 against $1: $out" >&2
  fi
  echo "$out"
}

redis_info() { # PORT FIELD
  redis-cli -p "$1" INFO memory | tr -d '\r' | awk -F: -v f="$2" '$1 == f { print $2 }'
}
# Mean MEMORY USAGE and STRLEN of the first $SAMPLE_KEYS keys a SCAN finds.
redis_sample() { # PORT
  local keys
  keys=$(redis-cli -p "$1" SCAN 0 MATCH 'idemproxy:*' COUNT 1000 | awk -v n="$SAMPLE_KEYS" 'NR > 1 && NR <= n + 1')
  [ -n "$keys" ] || { echo "nan nan"; return; }
  # One redis-cli per command list, keys passed as arguments (they hold
  # braces, never quotes or spaces).
  paste -d' ' \
    <(awk '{ print "MEMORY USAGE " $0 " SAMPLES 0" }' <<<"$keys" | redis-cli -p "$1") \
    <(awk '{ print "STRLEN " $0 }' <<<"$keys" | redis-cli -p "$1") |
    awk '{ m += $1; s += $2; n++ } END { printf "%.1f %.1f\n", m / n, s / n }'
}

# The mean body size of an upstream path, over 20 responses, and a check
# that the bodies are JSON.
body_size() { # PATH
  local port total=0 size i pid
  port=$(free_port)
  start_api_upstream body-upstream "$port" "$MEASURE_START"
  pid=$(cat "$WORK/body-upstream.pid")
  for i in $(seq 20); do
    size=$(curl -fsS -X POST -o "$WORK/body.json" -w '%{size_download}' "http://127.0.0.1:$port$1")
    total=$((total + size))
    if [ "$i" -le 3 ]; then python3 -m json.tool "$WORK/body.json" >/dev/null || { echo "$1: not JSON" >&2; exit 1; }; fi
  done
  cp "$WORK/body.json" "$WORK/sample-${1#/}.json"
  stop_pid "$pid"
  echo $((total / 20))
}

# take_turns KIND TOTAL BURST: TOTAL requests to the proxy of each mode of
# the group in bursts of BURST that take turns (the order rotating each
# turn), so a machine that gets busier or quieter weighs on every mode
# alike. KIND: unique (first executions), replay (of the 1,000 warmed keys;
# a burst of 1,000 replays each once), nocache (the same replays, through
# the proxies without a local cache). The CPU each proxy spent on its
# bursts is added to cpu_ns[KIND,MODE] and cpu_ticks[KIND,MODE].
take_turns() {
  local kind=$1 total=$2 burst=$3 sent=0 turn=0 i n mode target p ns ticks loadmode=replay rate=$REPLAY_RATE
  [ "$kind" = unique ] && { loadmode=unique; rate=$RATE; }
  while [ "$sent" -lt "$total" ]; do
    n=$(( total - sent < burst ? total - sent : burst ))
    for ((i = 0; i < ${#modes[@]}; i++)); do
      mode=${modes[(i + turn) % ${#modes[@]}]}
      if [ "$kind" = nocache ]; then target=${nurl[$mode]}; p=${npid[$mode]}; else target=${url[$mode]}; p=${pid[$mode]}; fi
      cpu_snapshot "$p" "$WORK/cpu0"
      load "$target" "$rate" "$n" "$loadmode" "$kind-t$turn-$store-$body-$mode-r$round" >/dev/null
      cpu_snapshot "$p" "$WORK/cpu1"
      read -r ns ticks < <(cpu_delta "$WORK/cpu0" "$WORK/cpu1")
      cpu_ns[$kind,$mode]=$(( ${cpu_ns[$kind,$mode]:-0} + ns ))
      cpu_ticks[$kind,$mode]=$(( ${cpu_ticks[$kind,$mode]:-0} + ticks ))
    done
    sent=$((sent + n)); turn=$((turn + 1))
  done
}

rss_bytes() { awk '/^VmRSS/ {print $2 * 1024}' "/proc/$1/status"; }

# run_group STORE BODY ROUND MODE...: the compression modes of one store
# and body side by side, each with its own upstream (the same objects),
# store and proxy, their requests taking turns (take_turns); one line per
# mode appended to $RESULTS.
run_group() {
  local store=$1 body=$2 round=$3; shift 3
  local -a modes=("$@") env_vars
  local -A port admin pid url uport upid rport rpid dir before records bytes usage strlen hits nurl npid nadmin cpu_ns cpu_ticks
  local mode name
  for mode in "${modes[@]}"; do
    name="$store-$body-$mode-r$round"
    mapfile -t env_vars < <(mode_env "$mode" "$body")
    UP=$(free_port); uport[$mode]=$UP; port[$mode]=$(free_port); admin[$mode]=$(free_port)
    start_api_upstream "upstream-$name" "$UP" "$MEASURE_START"
    upid[$mode]=$(cat "$WORK/upstream-$name.pid")
    case $store in
      redis)
        RP=$(free_port); rport[$mode]=$RP
        start_redis_volatile "redis-$name" "$RP"
        rpid[$mode]=$(cat "$WORK/redis-$name.pid")
        ;;
      embedded) dir[$mode]="$WORK/data-$name"; env_vars+=("IDEMPROXY_STORE__PATH=${dir[$mode]}") ;;
      postgres) env_vars+=("IDEMPROXY_STORE__TABLE_PREFIX=$(pg_prefix "$name")") ;;
    esac
    start_proxy_admin "$name" "${port[$mode]}" "${admin[$mode]}" "$store" "${env_vars[@]}"
    pid[$mode]=$(cat "$WORK/$name.pid")
    url[$mode]="http://127.0.0.1:${port[$mode]}/$body"
    case $store in
      redis) before[$mode]=$(redis_info "${rport[$mode]}" used_memory) ;;
      memory) before[$mode]=$(rss_bytes "${pid[$mode]}") ;;
      embedded) before[$mode]=$(du -sb "${dir[$mode]}" | cut -f1) ;;
      postgres) before[$mode]=$(pg_size "$(pg_prefix "$name")") ;;
    esac
  done

  take_turns unique "$N" "$BURST"

  for mode in "${modes[@]}"; do
    usage[$mode]=nan; strlen[$mode]=nan
    case $store in
      redis)
        records[$mode]=$(redis-cli -p "${rport[$mode]}" DBSIZE)
        bytes[$mode]=$(( $(redis_info "${rport[$mode]}" used_memory) - before[$mode] ))
        read -r "usage[$mode]" "strlen[$mode]" < <(redis_sample "${rport[$mode]}")
        ;;
      memory)
        records[$mode]=$(outcome_count "${admin[$mode]}" executed)
        bytes[$mode]=$(( $(rss_bytes "${pid[$mode]}") - before[$mode] ))
        ;;
      postgres)
        name=$(pg_prefix "$store-$body-$mode-r$round")
        records[$mode]=$(pg_query "SELECT count(*) FROM ${name}records")
        bytes[$mode]=$(( $(pg_size "$name") - before[$mode] ))
        ;;
    esac
    # 1,000 keys to replay.
    load "${url[$mode]}" 2000 1000 replay "warm-$store-$body-$mode-r$round" >/dev/null
    hits[$mode]=$(cache_hits "${admin[$mode]}")
  done

  take_turns replay "$REPLAYS" 1000
  local replayed
  for mode in "${modes[@]}"; do
    replayed=$(outcome_count "${admin[$mode]}" replayed)
    [ "$replayed" = "$REPLAYS" ] || echo "$store-$body-$mode-r$round: $replayed of $REPLAYS replays were replays" >&2
    hits[$mode]=$(( $(cache_hits "${admin[$mode]}") - hits[$mode] ))
    # The memory store has no cache: its records are in the process.
    [ "$store" = memory ] || [ "${hits[$mode]}" = "$REPLAYS" ] ||
      echo "$store-$body-$mode-r$round: ${hits[$mode]} of $REPLAYS replays came from the local cache" >&2
  done

  # Redis: the same replays through proxies without the local cache, each
  # a GET of the stored record.
  if [ "$store" = redis ]; then
    local nport
    for mode in "${modes[@]}"; do
      name="$store-$body-$mode-r$round-nocache"
      mapfile -t env_vars < <(mode_env "$mode" "$body")
      UP=${uport[$mode]}; RP=${rport[$mode]}; nport=$(free_port); nadmin[$mode]=$(free_port)
      start_proxy_admin "$name" "$nport" "${nadmin[$mode]}" redis "${env_vars[@]}" IDEMPROXY_STORE__LOCAL_CACHE_ENTRIES=0
      npid[$mode]=$(cat "$WORK/$name.pid")
      nurl[$mode]="http://127.0.0.1:$nport/$body"
      load "${nurl[$mode]}" "$REPLAY_RATE" 100 replay "nocache-warm" >/dev/null
    done
    take_turns nocache "$REPLAYS" 1000
    for mode in "${modes[@]}"; do
      replayed=$(outcome_count "${nadmin[$mode]}" replayed)
      [ "$replayed" = $((REPLAYS + 100)) ] || echo "$store-$body-$mode-r$round-nocache: $replayed of $((REPLAYS + 100)) replays were replays" >&2
      stop_pid "${npid[$mode]}"
    done
  fi

  for mode in "${modes[@]}"; do
    # Every record on disk, the warmed ones too.
    [ "$store" = embedded ] && records[$mode]=$(outcome_count "${admin[$mode]}" executed)
    stop_pid "${pid[$mode]}"
    if [ "$store" = embedded ]; then
      bytes[$mode]=$(( $(du -sb "${dir[$mode]}" | cut -f1) - before[$mode] ))
      rm -rf "${dir[$mode]}"
    fi
    if [ "$store" = redis ]; then stop_pid "${rpid[$mode]}"; rm -rf "$WORK/redis-$store-$body-$mode-r$round"; fi
    stop_pid "${upid[$mode]}"
    echo "$store $body $mode $round records=${records[$mode]} bytes=${bytes[$mode]} usage=${usage[$mode]} strlen=${strlen[$mode]}" \
      "first_ns=${cpu_ns[unique,$mode]} first_ticks=${cpu_ticks[unique,$mode]} first_n=$N" \
      "replay_ns=${cpu_ns[replay,$mode]} replay_ticks=${cpu_ticks[replay,$mode]} replay_n=$REPLAYS" \
      "store_replay_ns=${cpu_ns[nocache,$mode]:-nan} store_replay_ticks=${cpu_ticks[nocache,$mode]:-nan} cache_hits=${hits[$mode]}" >>"$RESULTS"
    echo "  $store /$body $mode, round $round: ${records[$mode]} records, ${bytes[$mode]} bytes" >&2
  done
}

# A dictionary per body, trained on what a zstd run stored in a Redis of
# its own, from objects numbered from 0 (the measured ones start at
# MEASURE_START).
train_dictionary() { # BODY
  local body=$1 name="train-$1" port admin pid redis_pid upstream_pid
  UP=$(free_port); RP=$(free_port); port=$(free_port); admin=$(free_port)
  start_api_upstream "upstream-$name" "$UP" 0
  upstream_pid=$(cat "$WORK/upstream-$name.pid")
  start_redis_volatile "redis-$name" "$RP"
  redis_pid=$(cat "$WORK/redis-$name.pid")
  start_proxy_admin "$name" "$port" "$admin" redis IDEMPROXY_STORE__COMPRESSION=zstd
  pid=$(cat "$WORK/$name.pid")
  load "http://127.0.0.1:$port/$body" "$RATE" "$N" unique "$name" >/dev/null
  stop_pid "$pid"
  cat >"$WORK/$name.toml" <<TOML
[store]
kind = "redis"
url = "redis://127.0.0.1:$RP"
compression = "zstd"
TOML
  "$BIN" store train-dictionary --config "$WORK/$name.toml" --out "$WORK/dict-$body" >"$WORK/$name.train.log" 2>&1 ||
    { echo "train-dictionary failed:" >&2; cat "$WORK/$name.train.log" >&2; exit 1; }
  echo "  dictionary for /$body: $(wc -c <"$WORK/dict-$body") bytes, from $(redis-cli -p "$RP" DBSIZE) records" >&2
  stop_pid "$redis_pid"; rm -rf "$WORK/redis-$name"
  stop_pid "$upstream_pid"
}

declare -A BODY_BYTES
for body in "${BODY_LIST[@]}"; do BODY_BYTES[$body]=$(body_size "/$body"); done
echo "mean response bodies: $(for b in "${BODY_LIST[@]}"; do printf '/%s %s B  ' "$b" "${BODY_BYTES[$b]}"; done)" >&2

if [[ " ${MODES[*]} " == *" zstd-dict "* ]]; then
  for body in "${BODY_LIST[@]}"; do train_dictionary "$body"; done
fi

GROUPS_=()
for store in "${STORE_LIST[@]}"; do
  for body in "${BODY_LIST[@]}"; do GROUPS_+=("$store $body"); done
done
for round in $(seq "$ROUNDS"); do
  # Alternate the order of the groups so none always runs first (or last)
  # on a machine that warms up or gets busier; within a group the modes
  # take turns (take_turns).
  order=("${GROUPS_[@]}")
  if (( round % 2 == 0 )); then mapfile -t order < <(printf '%s\n' "${order[@]}" | tac); fi
  echo "round $round of $ROUNDS" >&2
  for group in "${order[@]}"; do
    read -r store body <<<"$group"
    run_group "$store" "$body" "$round" "${MODES[@]}"
  done
done

BODY_SIZES=$(for b in "${BODY_LIST[@]}"; do printf '%s=%s ' "$b" "${BODY_BYTES[$b]}"; done)
# The codec alone on this machine, for scale: zstd's own benchmark (level
# 1, as the proxy) on one response body, without and with the dictionary.
codec_reference() {
  command -v zstd >/dev/null || return 0
  local body mode line in out c d
  echo "codec alone on this machine (zstd -b1 on one response body, not through the proxy):"
  for body in "${BODY_LIST[@]}"; do
    for mode in zstd zstd-dict; do
      local -a dict=()
      if [ "$mode" = zstd-dict ]; then [ -f "$WORK/dict-$body" ] || continue; dict=(-D "$WORK/dict-$body"); fi
      line=$(zstd -b1 -i1 "${dict[@]}" "$WORK/sample-$body.json" 2>&1 | tr '\r' '\n' | grep 'MB/s' | tail -1 |
        sed -E 's/.*: *([0-9]+) -> *([0-9]+) \(x[0-9.]+\), *([0-9.]+) MB\/s, *([0-9.]+) MB\/s.*/\1 \2 \3 \4/') || true
      [ -n "$line" ] || continue
      read -r in out c d <<<"$line"
      awk -v b="$body" -v m="$mode" -v i="$in" -v o="$out" -v c="$c" -v d="$d" \
        'BEGIN { if (c + 0 > 0 && d + 0 > 0) printf "  /%-6s %-10s %6d -> %5d B  compress %5.1f µs  decompress %5.1f µs\n", b, m, i, o, i / c, i / d
                 else printf "  /%-6s %-10s %6d -> %5d B  (zstd -b reported no speed: %s, %s MB/s)\n", b, m, i, o, c, d }'
    done
  done
}

# KEEP_RESULTS=FILE keeps the raw lines (one per configuration and round).
if [ -n "${KEEP_RESULTS:-}" ]; then cp "$RESULTS" "$KEEP_RESULTS"; fi
python3 - "$RESULTS" "$BODY_SIZES" "$N" "$RATE" "$REPLAYS" "$ROUNDS" "$BIN" "$HZ" <<'PY'
import math, statistics, sys
path, sizes, n, rate, replays, rounds, binary, hz = sys.argv[1:]
body_bytes = {k: int(v) for k, v in (s.split("=") for s in sizes.split())}
rows = []
for line in open(path):
    f = line.split()
    r = {"store": f[0], "body": f[1], "mode": f[2], "round": int(f[3])}
    for kv in f[4:]:
        k, v = kv.split("=", 1)
        r[k] = v
    rows.append(r)
def num(v):
    try:
        return float(v)
    except ValueError:
        return math.nan
def med(values):
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan
def store_has_cache(store):
    return store != "memory"
configs = []
for r in rows:
    c = (r["store"], r["body"], r["mode"])
    if c not in configs:
        configs.append(c)
stats = {}
for c in configs:
    rs = [r for r in rows if (r["store"], r["body"], r["mode"]) == c]
    s = stats[c] = {}
    s["records"] = med(num(r["records"]) for r in rs)
    s["bytes"] = med(num(r["bytes"]) / num(r["records"]) for r in rs)
    s["usage"] = med(num(r["usage"]) for r in rs)
    s["strlen"] = med(num(r["strlen"]) for r in rs)
    s["first"] = med(num(r["first_ns"]) / 1e3 / num(r["first_n"]) for r in rs)
    s["first_ticks"] = med(num(r["first_ticks"]) * 1e6 / int(hz) / num(r["first_n"]) for r in rs)
    s["replay"] = med(num(r["replay_ns"]) / 1e3 / num(r["replay_n"]) for r in rs)
    s["store_replay"] = med(num(r["store_replay_ns"]) / 1e3 / num(r["replay_n"]) for r in rs)
    s["hits"] = med(100 * num(r["cache_hits"]) / num(r["replay_n"]) for r in rs) if store_has_cache(c[0]) else math.nan
    s["rounds"] = len(rs)
def fmt(v, spec):
    return "-" if math.isnan(v) else format(v, spec)
what = {"redis": "used_memory", "embedded": "du -b", "memory": "RSS", "postgres": "table+idx+toast"}
print()
print(f"{binary}: N={n} first executions per run at {rate} req/s, {replays} replays; medians of {rounds} rounds")
print("bytes/record: redis INFO used_memory delta, embedded directory growth (approximate: journal and tables),")
print("memory RSS growth (approximate), postgres pg_total_relation_size growth (heap, indexes, TOAST; as written,")
print("before VACUUM); memory_usage, strlen: Redis MEMORY USAGE / STRLEN of 200 keys;")
print("cpu: the proxy's CPU per request (µs); replay_cached: with the default local replay cache (memory: the")
print("store itself), cache_hit%: how many of those the cache answered (it holds ~40 MiB in 4 KiB units, so")
print("not all of 1,000 large responses); replay_store: Redis, local_cache_entries = 0 (every replay a GET)")
print(f"mean response body: " + ", ".join(f"/{b} {v} B" for b, v in body_bytes.items()))
print()
head = f"{'store':<9} {'body':<6} {'compression':<11} {'records':>7} {'bytes/record':>12} {'(what)':<12} {'memory_usage':>12} {'strlen':>7} {'ratio_to_body':>13} {'cpu_us/first':>12} {'cpu_us/replay_cached':>20} {'cache_hit%':>10} {'cpu_us/replay_store':>19}"
print(head)
for c in configs:
    s = stats[c]
    store, body, mode = c
    ratio = s["bytes"] / body_bytes[body]
    print(f"{store:<9} {'/' + body:<6} {mode:<11} {fmt(s['records'], '.0f'):>7} {fmt(s['bytes'], '.0f'):>12} {what[store]:<12} "
          f"{fmt(s['usage'], '.0f'):>12} {fmt(s['strlen'], '.0f'):>7} {fmt(ratio, '.2f'):>13} {fmt(s['first'], '.1f'):>12} "
          f"{fmt(s['replay'], '.1f'):>20} {fmt(s['hits'], '.0f'):>10} {fmt(s['store_replay'], '.1f'):>19}")
print()
print("cross-check, CPU per first execution from /proc/PID/stat utime+stime (10 ms ticks, coarse): "
      + ", ".join(f"{c[0]} /{c[1]} {c[2]} {fmt(stats[c]['first_ticks'], '.0f')}" for c in configs))
print()
print("targets:")
def verdict(label, ok, shown, rounds=""):
    state = "-" if ok is None else ("met" if ok else "NOT met")
    print(f"  {label:<66} {shown:>24}  {state:<7}  {rounds}")
def per_round(c, base, field, divisor):
    """The difference to off in each round (the modes of a round ran side by side)."""
    out = []
    for r in sorted({r["round"] for r in rows}):
        a = [num(x[field]) / 1e3 / num(x[divisor]) for x in rows if (x["store"], x["body"], x["mode"]) == c and x["round"] == r]
        o = [num(x[field]) / 1e3 / num(x[divisor]) for x in rows if (x["store"], x["body"], x["mode"]) == base and x["round"] == r]
        if a and o:
            out.append(a[0] - o[0])
    return "rounds: " + " ".join(f"{d:+.1f}" for d in out) if len(out) > 1 else ""
for mode in ("off", "zstd", "zstd-dict", "legacy"):
    c = ("redis", "small", mode)
    if c in stats and "small" in body_bytes:
        v = stats[c]["bytes"]; limit = 0.75 * body_bytes["small"]
        verdict(f"redis /small {mode}: used_memory/record <= 0.75 x body ({limit:.0f} B)",
                None if mode in ("off", "legacy") else v <= limit, f"{v:.0f} B ({v / body_bytes['small']:.2f}x)")
for store in ("redis", "embedded", "memory", "postgres"):
    for body in body_bytes:
        base = stats.get((store, body, "off"))
        if not base:
            continue
        for mode in ("zstd", "zstd-dict"):
            s = stats.get((store, body, mode))
            if not s:
                continue
            c, o = (store, body, mode), (store, body, "off")
            d = s["first"] - base["first"]
            verdict(f"{store} /{body} {mode}: CPU/first execution <= off + 3 µs", d <= 3, f"{s['first']:.1f} vs {base['first']:.1f} ({d:+.1f})",
                    per_round(c, o, "first_ns", "first_n"))
            for key, field, label in (("replay", "replay_ns", "cached"), ("store_replay", "store_replay_ns", "from the store")):
                if math.isnan(s[key]) or math.isnan(base[key]):
                    continue
                d = s[key] - base[key]
                verdict(f"{store} /{body} {mode}: CPU/replay ({label}) <= off", d <= 0, f"{s[key]:.1f} vs {base[key]:.1f} ({d:+.1f})",
                        per_round(c, o, field, "replay_n"))
PY
echo
codec_reference

#!/usr/bin/env bash
# Runs every fuzz target for a bounded time, starting from its committed
# seeds (fuzz/seeds/<target>/), and fails if any target finds a crash.
#
#   fuzz/run.sh [SECONDS_PER_TARGET]      (default 20)
#
# Needs a nightly toolchain and cargo-fuzz. cargo-fuzz is installed when
# missing (`cargo install cargo-fuzz --locked`); with FUZZ_OPTIONAL=1 a
# missing nightly or cargo-fuzz skips fuzzing instead (exit 0).
#
# Environment:
#   FUZZ_OPTIONAL=1     skip (exit 0) when nightly or cargo-fuzz is missing
#   FUZZ_TARGETS="a b"  run only these targets (default: all)
#   FUZZ_JOBS=N         targets run at once (default: one per core)
#   FUZZ_CORPUS=DIR     working corpus root (default fuzz/corpus, ignored by
#                       git); new inputs found go to DIR/<target>
#   FUZZ_SANITIZER=X    cargo-fuzz sanitizer: none (default) or address.
#                       idemproxy forbids unsafe code, so AddressSanitizer
#                       only watches its dependencies; without it the build
#                       is shorter and targets run ~5x faster. Debug
#                       assertions and overflow checks stay on either way.
#                       Use address for long local runs.
#   CARGO_BUILD_JOBS=N  parallel compile jobs, as for any cargo build
set -euo pipefail

fuzz_dir="$(cd "$(dirname "$0")" && pwd)"
cd "$fuzz_dir/.."

seconds="${1:-20}"
case "$seconds" in
  '' | *[!0-9]* | 0) echo "fuzz/run.sh: seconds per target must be a positive integer, not '$seconds'" >&2; exit 2 ;;
esac
targets=(${FUZZ_TARGETS:-key canonical_json record_codec packed_response jwt mcp})
corpus_root="${FUZZ_CORPUS:-$fuzz_dir/corpus}"
sanitizer="${FUZZ_SANITIZER:-none}"
logs="$fuzz_dir/target/fuzz-logs"

skip_or_fail() {
  if [ "${FUZZ_OPTIONAL:-0}" = 1 ]; then
    echo "fuzz/run.sh: $1; skipped (FUZZ_OPTIONAL=1)"
    exit 0
  fi
  echo "fuzz/run.sh: $1" >&2
  exit 1
}

if ! cargo +nightly --version >/dev/null 2>&1; then
  skip_or_fail "no nightly toolchain (rustup toolchain install nightly --profile minimal)"
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  [ "${FUZZ_OPTIONAL:-0}" = 1 ] && skip_or_fail "cargo-fuzz is not installed"
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

# The lock file is committed: fail rather than resolve anew, as --locked
# does for the main crate.
host=$(rustc +nightly -vV | sed -n 's/^host: //p')
cargo +nightly fetch --locked --manifest-path "$fuzz_dir/Cargo.toml" --target "$host" >/dev/null

# One build of every target; each run below finds it up to date.
started=$SECONDS
cargo +nightly fuzz build --sanitizer "$sanitizer"
echo "built the fuzz targets in $((SECONDS - started)) s"

mkdir -p "$logs"

# Runs one target; its exit status is libFuzzer's (0: no crash).
run_target() {
  local target=$1 corpus="$corpus_root/$1"
  mkdir -p "$corpus"
  # The first directory receives the new inputs; the seeds, and the inputs
  # of past crashes (fuzz/regressions/<target>/), are only read, and every
  # one of them is run first. A crashing input is written to
  # fuzz/artifacts/<target>/.
  local inputs=("$corpus" "$fuzz_dir/seeds/$target")
  [ -d "$fuzz_dir/regressions/$target" ] && inputs+=("$fuzz_dir/regressions/$target")
  cargo +nightly fuzz run --sanitizer "$sanitizer" "$target" "${inputs[@]}" -- \
    -max_total_time="$seconds" -print_final_stats=1 >"$logs/$target.log" 2>&1
}

# Targets run side by side, one per core (FUZZ_JOBS), each for the full
# `seconds`: the same fuzzing per target in a fraction of the wall time.
jobs="${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}"
declare -A status_of=() target_of=()
running=0
# Waits for one running target and keeps its status.
reap() {
  local pid status=0
  wait -n -p pid || status=$?
  status_of[${target_of[$pid]}]=$status
  running=$((running - 1))
}
for target in "${targets[@]}"; do
  while [ "$running" -ge "$jobs" ]; do reap; done
  run_target "$target" &
  target_of[$!]=$target
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do reap; done

failed=()
for target in "${targets[@]}"; do
  log="$logs/$target.log"
  status=${status_of[$target]}
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  coverage=$(grep -E '^#[0-9]+[[:space:]]+(DONE|INITED|NEW|REDUCE|pulse)' "$log" | tail -n 1 || true)
  if [ "$status" -eq 0 ]; then
    printf '%-15s ok     runs: %-10s %s\n' "$target" "${runs:-?}" "$coverage"
  else
    printf '%-15s FAILED runs: %-10s %s\n' "$target" "${runs:-?}" "$coverage"
    failed+=("$target")
    # The panic or sanitizer report, and the input that caused it.
    if grep -qE "panicked at|ERROR: (libFuzzer|AddressSanitizer)" "$log"; then
      grep -E -A25 "panicked at|ERROR: (libFuzzer|AddressSanitizer)" "$log" | head -n 60 || true
      grep -E -m2 "Test unit written to|Base64:" "$log" || true
    else
      tail -n 40 "$log"
    fi
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz/run.sh: crashes in: ${failed[*]} (logs: $logs; reproduce: cargo +nightly fuzz run <target> <artifact>; see fuzz/README.md)" >&2
  exit 1
fi
echo "fuzz/run.sh: ${#targets[@]} targets, ${seconds} s each, no crash"

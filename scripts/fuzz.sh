#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each for a bounded time on a copy of its committed seed corpus
# (tests/fuzz/corpus/<target>/). Exit non-zero on any crash, leak or invariant violation; the crashing input is kept
# in <build>/artifacts/. FLEXKV_FUZZ_SECONDS (default 30) per target. FLEXKV_FUZZ_BUILD: a clang build directory
# configured with -DFLEXKV_FUZZ=ON already (scripts/test.sh passes build-san/, whose sanitizer build carries the
# targets); unset: build-fuzz/, configured here with the fuzz targets only.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FLEXKV_FUZZ_SECONDS:-30}
# The targets link the daemon library, and with it UCX: its signal handlers would take a crash before libFuzzer's
# (no artifact saved), and its malloc hooks fight the sanitizers.
export UCX_HANDLE_ERRORS=none UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none
targets=(pool_recovery attach_request prefix_index ring_descriptor ssd_header ssd_slot_index peer_lookup)
build=${FLEXKV_FUZZ_BUILD:-build-fuzz}
if [[ ! -f $build/build.ninja ]]; then
  [[ -z ${FLEXKV_FUZZ_BUILD:-} ]] || { echo "fuzz: $build is not configured (FLEXKV_FUZZ_BUILD)" >&2; exit 1; }
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLEXKV_FUZZ=ON \
    -DFLEXKV_WITH_CUDA=OFF -DFLEXKV_BUILD_TESTS=OFF >/dev/null
fi
ninja -C "$build" "${targets[@]/#/fuzz_}" >/dev/null
mkdir -p "$build"/artifacts
# One target per core at a time: each is single-threaded, so the wall time is the targets' time over the cores.
fuzz_one() {  # <target>: runs it, prints its verdict; exit status 1 on a finding
  local t=$1 work runs
  work=$(mktemp -d)
  cp tests/fuzz/corpus/"$t"/* "$work"/
  if "$build"/tests/fuzz/fuzz_"$t" -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix="$build"/artifacts/"$t"- "$work" >"$build"/fuzz_"$t".log 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$build"/fuzz_"$t".log | awk '{print $2}')
    echo "fuzz: $t ok, ${runs:-?} executions in ${seconds} s, 0 crashes"
    rm -rf "$work"
    return 0
  fi
  echo "fuzz: $t FAILED (see $build/fuzz_$t.log and $build/artifacts/)"
  tail -n 30 "$build"/fuzz_"$t".log
  rm -rf "$work"
  return 1
}
status=0
jobs_max=$(nproc)
running=0
for t in "${targets[@]}"; do
  if ((running >= jobs_max)); then
    wait -n || status=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || status=1
  running=$((running - 1))
done
exit $status

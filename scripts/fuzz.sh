#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each for a bounded time on a copy of its
# committed seed corpus (tests/fuzz/corpus/<target>/). Exit non-zero on any crash, leak or invariant
# violation; the crashing input is kept in build-fuzz/artifacts/. FLEXKV_FUZZ_SECONDS (default 30) per target.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FLEXKV_FUZZ_SECONDS:-30}
# The targets link the daemon library, and with it UCX: its signal handlers would take a crash before libFuzzer's
# (no artifact saved), and its malloc hooks fight the sanitizers.
export UCX_HANDLE_ERRORS=none UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none
targets=(pool_recovery attach_request prefix_index ring_descriptor ssd_header peer_lookup)
if [[ ! -f build-fuzz/build.ninja ]]; then
  CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLEXKV_FUZZ=ON \
    -DFLEXKV_WITH_CUDA=OFF -DFLEXKV_BUILD_TESTS=OFF >/dev/null
fi
ninja -C build-fuzz "${targets[@]/#/fuzz_}" >/dev/null
mkdir -p build-fuzz/artifacts
status=0
for t in "${targets[@]}"; do
  work=$(mktemp -d)
  cp tests/fuzz/corpus/"$t"/* "$work"/
  if build-fuzz/tests/fuzz/fuzz_"$t" -max_total_time="$seconds" -print_final_stats=1 \
      -artifact_prefix=build-fuzz/artifacts/"$t"- "$work" >build-fuzz/fuzz_"$t".log 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' build-fuzz/fuzz_"$t".log | awk '{print $2}')
    echo "fuzz: $t ok, ${runs:-?} executions in ${seconds} s, 0 crashes"
  else
    status=1
    echo "fuzz: $t FAILED (see build-fuzz/fuzz_$t.log and build-fuzz/artifacts/)"
    tail -n 30 build-fuzz/fuzz_"$t".log
  fi
  rm -rf "$work"
done
exit $status

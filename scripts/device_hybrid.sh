#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): the [gpu] tests (every component of the
# hybrid presets through the CUDA backend among them), then `flexkv-bench transfer --geometry` for a full-attention
# baseline and each hybrid preset: GB/s per component and for a hit's whole block set, against contiguous copies
# of the same bytes. About 2-4 minutes. Logs under $OUT (five files), a summary table last.
#
# Build and bundle here first (RelWithDebInfo binaries are too large to carry until stripped):
#   ../shared/tools/device-bundle.sh .device/bundle build/tests/gpu/flexkv_gpu_tests build/flexkv-bench &&
#   strip --strip-debug .device/bundle/bin/* .device/bundle/lib/*
# then run with carry [".device"]:  bash scripts/device_hybrid.sh
# GPU_TESTS=0 skips the tests; PREFIX_BLOCKS=n sets the hit's length (default 1024 blocks = 16384 tokens);
# ITERS=n the timed runs per figure (default 7).
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-hybrid}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 \
  | tee "$out/nvidia-smi.txt"

if [ "${GPU_TESTS:-1}" != 0 ]; then
  echo "== GPU tests"
  if ! timeout "${TEST_TIMEOUT:-150}" "$bundle/bin/flexkv_gpu_tests" --durations yes >"$out/gpu_tests.log" 2>&1; then
    status=1
    echo "GPU TESTS FAILED"
    grep -B 5 -A 25 -m 3 "FAILED" "$out/gpu_tests.log" | head -n 120
  fi
  tail -n 3 "$out/gpu_tests.log"
fi

# One JSON line per run in hybrid.jsonl; each run's stderr (checks, errors) in bench.stderr.
: >"$out/hybrid.jsonl"
: >"$out/bench.stderr"
start=$(date +%s)
for run in "llama3-8b 1" "gpt-oss-20b 1" "gemma3-27b 1" "qwen3-next 1" "jamba 1" "gemma3-27b 2" "qwen3-next 2"; do
  set -- $run
  echo "== flexkv-bench transfer --geometry $1 --tp $2" | tee -a "$out/bench.stderr"
  if ! timeout "${BENCH_TIMEOUT:-90}" "$bundle/bin/flexkv-bench" transfer --json --geometry "$1" --tp "$2" \
      --prefix-blocks "${PREFIX_BLOCKS:-1024}" --iters "${ITERS:-7}" >>"$out/hybrid.jsonl" 2>>"$out/bench.stderr"; then
    status=1
    echo "BENCH FAILED: $1 tp $2"
    tail -n 5 "$out/bench.stderr"
  fi
done
echo "bench wall time: $(( $(date +%s) - start )) s"

[ -s "$out/hybrid.jsonl" ] && python3 - "$out/hybrid.jsonl" <<'EOF' | tee "$out/summary.txt"
import json, sys
runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
if runs:
    r = runs[0]
    print(f"{r['device']} ({r['sms']} SMs), driver API {r['cuda_driver']}, runtime {r['cuda_runtime']}; "
          f"hit of {r['prefix_blocks']} blocks ({r['hit_tokens']} tokens), TP rank 0, median of {r['iters']}")
print("geometry      tp | copy                      MiB | kernel store (no sums)  load | copy engine store  load | ceiling st/ld | (ratios to the ceiling)")
for r in runs:
    rows = [(f"{c['component']} {c['kind']} x{c['blocks']}", c) for c in r["components"]]
    rows.append(("hybrid set", r["hybrid_set"]))
    for name, c in rows:
        print(f"{r['geometry']:<13} {r['tp']:>2} | {name:<22} {c['bytes'] / 2**20:>7.1f} | "
              f"{c['kernel_store_gbps']:6.1f} ({c['kernel_store_plain_gbps']:5.1f}) {c['kernel_load_gbps']:6.1f} | "
              f"{c['copy_engine_store_gbps']:6.1f} {c['copy_engine_load_gbps']:6.1f} | "
              f"{c['ceiling_store_gbps']:5.1f}/{c['ceiling_load_gbps']:5.1f} | "
              f"k {c['kernel_store_ratio']:.3f}/{c['kernel_load_ratio']:.3f} ce {c['copy_engine_store_ratio']:.3f}/{c['copy_engine_load_ratio']:.3f}")
    print(f"{'':<16} | {r['rank_bytes_per_hit_token']:.0f} bytes per hit token on this rank")
EOF
exit $status

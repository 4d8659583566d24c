#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): examples/vllm_dp_rank.py with
# --layer-events (the engine's stream waits on the daemon's per-layer CUDA events), two DP ranks one after the other
# against one flexkvd, the second loading what the first stored. Logs under $OUT.
# Bundle first: ../shared/tools/device-bundle.sh .device/bundle build/flexkvd build/flexkvctl; strip; carry [".device"].
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-example}
mkdir -p "$out"
# Python (torch) keeps the machine's own libstdc++ and system libraries; only the project's own come from the bundle.
source scripts/device_pylib.sh
pylib=$(flexkv_python_libdir "$bundle")
sock=$(mktemp -d)/flexkvd.sock
pool=/dev/shm/flexkv-example-$$
mkdir -p "$pool"
LD_LIBRARY_PATH="$PWD/$bundle/lib" "$bundle/bin/flexkvd" --socket "$sock" --pool-path "$pool/pool" --pool-size 8GiB \
  >"$out/flexkvd.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
export LD_LIBRARY_PATH="$pylib" FLEXKV_LIBRARY="$PWD/$bundle/lib/libflexkv.so.0" PYTHONPATH="$PWD/python" FLEXKV_SOCKET="$sock"
status=0
for rank in 0 1; do
  echo "== DP rank $rank --layer-events"
  timeout 300 python3 examples/vllm_dp_rank.py --dp-rank "$rank" --layer-events 2>&1 | tee "$out/rank$rank.txt" | tail -4
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
kill "$daemon"; wait "$daemon"; rm -rf "$pool"
exit $status

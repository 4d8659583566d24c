#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): GPU copy tests, GPU end-to-end
# tests through a real flexkvd, then the end-to-end benchmark (a vLLM-shaped KV cache of 32 layers x 1024
# blocks registered with CUDA IPC handles; Store then layer-wise Load through the rings), once with the
# kernels and once with the copy engine. Logs under $OUT; a short summary last.
# Bundle first:  ../shared/tools/device-bundle.sh .device/bundle build/flexkvd build/tests/gpu/flexkv_gpu_tests \
#   build/tests/integration/flexkv_gpu_e2e_tests build/tests/integration/flexkv-gpu-test-client
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-e2e}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLEXKV_TEST_FLEXKVD="$PWD/$bundle/bin/flexkvd" FLEXKV_TEST_GPU_CLIENT="$PWD/$bundle/bin/flexkv-gpu-test-client"
status=0
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv | tee "$out/nvidia-smi.txt"
df -h /dev/shm /tmp | tee -a "$out/nvidia-smi.txt"

echo "== GPU copy tests"
timeout 180 "$bundle/bin/flexkv_gpu_tests" >"$out/gpu_tests.log" 2>&1 || { status=1; echo "GPU COPY TESTS FAILED"; }
tail -n 2 "$out/gpu_tests.log"
echo "== GPU end-to-end tests"
timeout 300 "$bundle/bin/flexkv_gpu_e2e_tests" -s >"$out/gpu_e2e_tests.log" 2>&1 || { status=1; echo "GPU E2E TESTS FAILED"; tail -n 40 "$out/gpu_e2e_tests.log"; }
tail -n 2 "$out/gpu_e2e_tests.log"

# The pool needs 2 GiB for 1024 Llama-3-8B blocks; /dev/shm in a container can be small.
pooldir=/dev/shm/flexkv-e2e
avail=$(df -k --output=avail /dev/shm | tail -1)
[ "${avail:-0}" -lt 5000000 ] && pooldir=/tmp/flexkv-e2e
for path in kernel copy-engine; do
  rm -rf "$pooldir" /tmp/flexkv-e2e-sock; mkdir -p "$pooldir" /tmp/flexkv-e2e-sock
  "$bundle/bin/flexkvd" --socket /tmp/flexkv-e2e-sock/s --pool-path "$pooldir/pool" --pool-size 4GiB \
    --load-path "$path" --store-path "$path" >"$out/flexkvd-$path.log" 2>&1 &
  daemon=$!
  for _ in $(seq 1 100); do [ -S /tmp/flexkv-e2e-sock/s ] && break; sleep 0.05; done
  for run in 1 2 3; do
    timeout 120 "$bundle/bin/flexkv-gpu-test-client" --socket /tmp/flexkv-e2e-sock/s --layers 32 --kv-blocks 1024 \
      --name "bench-$path" --do bench:1024 2>>"$out/client-$path.stderr" | tee -a "$out/e2e-$path.txt" | grep -E "BENCH|ERROR" \
      | sed "s/^/$path run $run: /"
  done
  kill -TERM "$daemon"; wait "$daemon"
done
rm -rf "$pooldir"
exit $status

#!/usr/bin/env bash
# Runs on a GPU machine with python3 + torch (the device tool's `run`, from the repository root): the C++ GPU
# tests (copy kernels; end to end incl. cuMem/VMM caches), the Python package's GPU tests (two PyTorch engine
# processes, caching allocator and expandable segments), then the example vLLM DP rank, two ranks per
# allocator, against one flexkvd. Logs under $OUT; a summary last.
# Bundle first:  ../shared/tools/device-bundle.sh .device/bundle build/flexkvd build/flexkvctl \
#   build/tests/gpu/flexkv_gpu_tests build/tests/integration/flexkv_gpu_e2e_tests \
#   build/tests/integration/flexkv-gpu-test-client
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-python}
mkdir -p "$out"
# The C++ binaries run with every bundled library; Python (torch) keeps the machine's newer libstdc++ and
# system libraries, so its library path holds only the project's own dependencies (gRPC, protobuf, abseil...).
cxx_path="$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
source scripts/device_pylib.sh
pylib=$(flexkv_python_libdir "$bundle")
py_path="$pylib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH="$cxx_path"
export FLEXKV_TEST_FLEXKVD="$PWD/$bundle/bin/flexkvd" FLEXKV_TEST_GPU_CLIENT="$PWD/$bundle/bin/flexkv-gpu-test-client"
export FLEXKVD="$PWD/$bundle/bin/flexkvd" FLEXKV_LIBRARY="$PWD/$bundle/lib/libflexkv.so.0"
export PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1
status=0
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv | tee "$out/nvidia-smi.txt"
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)' | tee -a "$out/nvidia-smi.txt"

echo "== GPU copy tests"
timeout 180 "$bundle/bin/flexkv_gpu_tests" >"$out/gpu_tests.log" 2>&1 || { status=1; echo "GPU COPY TESTS FAILED"; }
tail -n 2 "$out/gpu_tests.log"
echo "== GPU end-to-end tests (C++)"
timeout 300 "$bundle/bin/flexkv_gpu_e2e_tests" -s >"$out/gpu_e2e_tests.log" 2>&1 || { status=1; echo "GPU E2E TESTS FAILED"; tail -n 60 "$out/gpu_e2e_tests.log"; }
tail -n 2 "$out/gpu_e2e_tests.log"
echo "== Python GPU tests"
export LD_LIBRARY_PATH="$py_path"
(cd tests/python && timeout 400 python3 -m pytest -p no:cacheprovider -q -rs -s test_gpu_torch.py test_gpu_hybrid.py test_client_gpu.py test_examples.py) \
  >"$out/python_gpu_tests.log" 2>&1 || { status=1; echo "PYTHON GPU TESTS FAILED"; tail -n 60 "$out/python_gpu_tests.log"; }
grep -E "GB/s|passed|failed|skipped|SKIP" "$out/python_gpu_tests.log" | tail -n 12

echo "== example vLLM DP rank, two ranks per allocator"
for alloc in caching expandable; do
  dir=$(mktemp -d); pooldir=/dev/shm/flexkv-example-$alloc
  rm -rf "$pooldir"; mkdir -p "$pooldir"
  "$FLEXKVD" --socket "$dir/s" --pool-path "$pooldir/pool" --pool-size 8GiB >"$out/flexkvd-example-$alloc.log" 2>&1 &
  daemon=$!
  for _ in $(seq 1 100); do [ -S "$dir/s" ] && break; sleep 0.05; done
  conf=""; [ "$alloc" = expandable ] && conf="expandable_segments:True"
  for rank in 0 1; do
    PYTORCH_CUDA_ALLOC_CONF=$conf timeout 300 python3 examples/vllm_dp_rank.py --socket "$dir/s" --dp-rank "$rank" \
      --layerwise >"$out/example-$alloc-rank$rank.txt" 2>&1 || { status=1; echo "EXAMPLE $alloc rank $rank FAILED"; tail -n 20 "$out/example-$alloc-rank$rank.txt"; }
    echo "$alloc rank $rank: $(grep '^summary:' "$out/example-$alloc-rank$rank.txt")"
  done
  kill -TERM "$daemon"; wait "$daemon"
  rm -rf "$pooldir" "$dir"
done
exit $status

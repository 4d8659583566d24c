#!/usr/bin/env bash
# Runs on a GPU machine with python3 + torch (+ transformers for the HF parts; the device tool's `run`, from the
# repository root) what issues 31 and 32 need checked on a GPU, in this order: the TP ranks' copies (`flexkv-bench
# transfer --tp-ranks`, options in TP_ARGS; needs build/flexkv-bench in the bundle), the C++ GPU tests (copy kernels
# and end to end, every GPU layout), examples/hf_hybrid_reuse.py (scripts/device_hf_hybrid.sh, options in
# HF_HYBRID_ARGS: whole and layer-wise loads of hybrid models), the Python GPU tests (PyTorch engines, hybrid
# geometries and their layer-wise loads, the vLLM connector's layouts; PY_TESTS picks some) and
# examples/hf_prefix_reuse.py (scripts/device_hf.sh: whole against layer-wise loads, options in HF_LLAMA_ARGS).
# PARTS picks them (tp, cxx, hf-hybrid, py, hf-llama; default "cxx,py,hf-hybrid,hf-llama"). A device call is at most
# 10 minutes: split them over calls, or bound the call with DEADLINE_S (later parts get what is left).
# Logs under $OUT; a summary last; exit 1 when any part failed.
# Bundle first:  ../shared/tools/device-bundle.sh .device/bundle build/flexkvd build/flexkvctl \
#   build/tests/gpu/flexkv_gpu_tests build/tests/integration/flexkv_gpu_e2e_tests \
#   build/tests/integration/flexkv-gpu-test-client build/libflexkv.so.0 build/flexkv-bench   (strip; carry [".device"])
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-connectors}
mkdir -p "$out"
cxx_path="$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
source scripts/device_pylib.sh
pylib=$(flexkv_python_libdir "$bundle")
py_path="$pylib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLEXKV_TEST_FLEXKVD="$PWD/$bundle/bin/flexkvd" FLEXKV_TEST_GPU_CLIENT="$PWD/$bundle/bin/flexkv-gpu-test-client"
export FLEXKVD="$PWD/$bundle/bin/flexkvd" FLEXKV_LIBRARY="$PWD/$bundle/lib/libflexkv.so.0"
export PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1
summary=()
parts=",${PARTS:-cxx,py,hf-hybrid,hf-llama},"
# DEADLINE_S (optional): seconds this whole call may take; each part's limit shrinks to what is left, and a part
# with under 30 s left is skipped (said in the summary) - a device call is at most 10 minutes.
started=$(date +%s)
part() {  # part NAME TIMEOUT_S LOG COMMAND...: runs it, records ok/FAILED with its time
  local name=$1 limit=$2 log=$3 t0 rc left
  shift 3
  if [[ -n ${DEADLINE_S:-} ]]; then
    left=$(( started + DEADLINE_S - $(date +%s) ))
    if (( left < 30 )); then
      summary+=("$name: SKIPPED (no time left of DEADLINE_S=$DEADLINE_S)")
      return 0
    fi
    (( limit > left )) && limit=$left
  fi
  t0=$(date +%s)
  echo "== $name"
  timeout "$limit" "$@" >"$out/$log" 2>&1
  rc=$?
  summary+=("$name: $([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc") in $(( $(date +%s) - t0 )) s")
  tail -n 3 "$out/$log"
  [ $rc -eq 0 ] || { grep -E "FAILED|Error|error:|assert" "$out/$log" | head -n 30; }
  return $rc
}
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv | tee "$out/nvidia-smi.txt"
base_path="${LD_LIBRARY_PATH:-}"
if [[ $parts == *,tp,* ]]; then
  export LD_LIBRARY_PATH="$cxx_path"
  part "TP ranks on one GPU: staged and kernel copies against the ceilings (flexkv-bench transfer --tp-ranks)" \
    "${TP_TIMEOUT:-400}" tp_ranks.log "$bundle/bin/flexkv-bench" transfer --tp-ranks \
    ${TP_ARGS:---tp 2,4,8 --chunk-kib 8,16,32,64,128}
  tail -n 40 "$out/tp_ranks.log"
  export LD_LIBRARY_PATH="$base_path"
fi
if [[ $parts == *,cxx,* ]]; then
  export LD_LIBRARY_PATH="$cxx_path"
  part "C++ GPU copy tests" 150 gpu_tests.log "$bundle/bin/flexkv_gpu_tests"
  part "C++ GPU end-to-end tests" 240 gpu_e2e_tests.log "$bundle/bin/flexkv_gpu_e2e_tests" -s
fi
export LD_LIBRARY_PATH="$base_path"
if [[ $parts == *,hf-hybrid,* ]]; then
  part "HF hybrid models through flexkvd (examples/hf_hybrid_reuse.py)" "${HF_HYBRID_TIMEOUT:-300}" hf_hybrid.log \
    env BUNDLE="$bundle" OUT="$out/hf-hybrid" HF_TIMEOUT="${HF_HYBRID_TIMEOUT:-300}" HF_ARGS="${HF_HYBRID_ARGS:-}" \
    bash scripts/device_hf_hybrid.sh
  grep -E "^summary:|^\|" "$out/hf_hybrid.log" | tail -n 30
fi
if [[ $parts == *,py,* ]]; then
  export LD_LIBRARY_PATH="$py_path"
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)' | tee -a "$out/nvidia-smi.txt"
  pytests=(test_gpu_torch.py test_gpu_hybrid.py test_client_gpu.py test_vllm_gpu_layouts.py)
  [ -f tests/python/test_vllm_gpu_hybrid.py ] && pytests+=(test_vllm_gpu_hybrid.py)
  [[ -n ${PY_TESTS:-} ]] && read -r -a pytests <<<"$PY_TESTS"  # a subset, e.g. PY_TESTS="test_gpu_hybrid.py"
  part "Python GPU tests (${pytests[*]})" 240 python_gpu_tests.log \
    bash -c "cd tests/python && python3 -m pytest -p no:cacheprovider -q -rs ${pytests[*]}"
  grep -E "passed|failed|SKIPPED" "$out/python_gpu_tests.log" | tail -n 8
fi
export LD_LIBRARY_PATH="$base_path"
if [[ $parts == *,hf-llama,* ]]; then
  part "HF Llama, whole and layer-wise loads (examples/hf_prefix_reuse.py)" "${HF_LLAMA_TIMEOUT:-240}" hf_llama.log \
    env BUNDLE="$bundle" OUT="$out/hf-llama" HF_TIMEOUT="${HF_LLAMA_TIMEOUT:-240}" HF_ARGS="${HF_LLAMA_ARGS:-}" \
    bash scripts/device_hf.sh
  grep -E "^summary:|^\|" "$out/hf_llama.log" | tail -n 30
fi
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
! grep -q FAILED "$out/summary.txt"

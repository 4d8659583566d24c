#!/usr/bin/env bash
# Runs on a GPU machine with python3 + torch + transformers 5 (the device tool's `run`, from the repository root):
# examples/hf_hybrid_reuse.py - gpt-oss-like (sliding-window + full attention) and Qwen3-Next-like (Gated DeltaNet +
# full attention) models with random weights; engine process A stores a prompt's KV, windows and states, process B
# loads them into other block ids (whole, and past a local prefix with first_block) and prefills only the new
# tokens; logits compared with a split prefill, TTFT with and without the hit, the layer-wise load's answer.
# Logs under $OUT. Bundle first:  ../shared/tools/device-bundle.sh .device/bundle build/flexkvd build/flexkvctl
#   (libflexkv.so.0 comes with flexkvctl), strip, carry [".device"]. HF_ARGS adds options (e.g. --link client).
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-hf-hybrid}
mkdir -p "$out"
# flexkvd runs with every bundled library; Python (torch) keeps the machine's newer libstdc++ and system libraries,
# so its library path holds only the project's own dependencies (as scripts/device_python.sh).
source scripts/device_pylib.sh
pylib=$(flexkv_python_libdir "$bundle")
cat >"$pylib/flexkvd" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$PWD/$bundle/lib" exec "$PWD/$bundle/bin/flexkvd" "\$@"
WRAP
chmod +x "$pylib/flexkvd"
export LD_LIBRARY_PATH="$pylib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLEXKV_LIBRARY="$PWD/$bundle/lib/libflexkv.so.0" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv | tee "$out/nvidia-smi.txt"
python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$out/nvidia-smi.txt"
python3 -c 'import importlib.util as u; print("fla:", u.find_spec("fla") is not None, "causal_conv1d:", u.find_spec("causal_conv1d") is not None)' | tee -a "$out/nvidia-smi.txt"
timeout ${HF_TIMEOUT:-540} python3 examples/hf_hybrid_reuse.py --flexkvd "$pylib/flexkvd" --log-dir "$out" ${HF_ARGS:-} 2>&1 | tee "$out/hf_hybrid_reuse.txt"
exit "${PIPESTATUS[0]}"

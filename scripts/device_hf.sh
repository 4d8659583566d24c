#!/usr/bin/env bash
# Runs on a GPU machine with python3 + torch + transformers (the device tool's `run`, from the repository root):
# examples/hf_prefix_reuse.py - a Llama-architecture model with random weights; engine process A stores a prompt's
# KV through the vLLM connector's logic, process B loads it from flexkvd and prefills only the rest; greedy tokens
# and logits compared with a full prefill, time to first token with and without the hit, the hit loaded whole and
# layer by layer (each decoder layer waits for its own layer's copies; logits equal bit for bit). Defaults: bf16,
# prompts 4k-32k, ~2-3 min; HF_ARGS="--dtypes bfloat16,float32" adds float32, "--no-layerwise" drops the layer-wise
# variant. Logs under $OUT.
# Bundle first:  ../shared/tools/device-bundle.sh .device/bundle build/flexkvd build/flexkvctl   (libflexkv.so.0
#   comes with flexkvctl), strip, carry [".device"].
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-hf}
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
timeout ${HF_TIMEOUT:-500} python3 examples/hf_prefix_reuse.py --flexkvd "$pylib/flexkvd" --log-dir "$out" ${HF_ARGS:-} 2>&1 | tee "$out/hf_prefix_reuse.txt"
exit "${PIPESTATUS[0]}"

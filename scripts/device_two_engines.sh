#!/usr/bin/env bash
# Runs on a GPU machine: two engine processes (vLLM-shaped KV caches, 32 layers x 1024 Llama-3-8B blocks) served
# by one flexkvd. One engine stores 1024 blocks; then each engine alone, and both at once (a common start time),
# loads them 10 times back to back; the aggregate GB/s of the pair is printed against one engine alone and against a
# contiguous pinned copy measured in the same run (flexkv-bench transfer). With one GPU both engines share it
# (on a 2-GPU machine, one engine per GPU: ENGINE_GPUS="0 1" there, the rest is the same).
# Bundle: flexkvd, flexkv-gpu-test-client, flexkv-bench.
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-two-engines}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
read -r -a gpus <<<"${ENGINE_GPUS:-0 0}"
client="$bundle/bin/flexkv-gpu-test-client"
nvidia-smi --query-gpu=index,name,uuid --format=csv | tee "$out/gpus.txt"
echo "== contiguous pinned copy (same run)"
timeout 300 "$bundle/bin/flexkv-bench" transfer --chunk-kib 32 --layers 32 --blocks 1024 --iters 5 --json \
  >"$out/transfer.json" 2>"$out/transfer.stderr" || echo "transfer bench failed"
python3 - "$out/transfer.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
def find(o, path=""):
    if isinstance(o, dict):
        for k, v in o.items(): yield from find(v, f"{path}.{k}")
    elif isinstance(o, list):
        for i, v in enumerate(o): yield from find(v, f"{path}[{i}]")
    else:
        yield path, o
for k, v in find(d):
    if "contig" in k or "baseline" in k or "gbps" in k: print(k, v)
PY
dir=$(mktemp -d); pool=/dev/shm/flexkv-two; rm -rf "$pool"; mkdir -p "$pool"
"$bundle/bin/flexkvd" --socket "$dir/s" --pool-path "$pool/pool" --pool-size 4GiB >"$out/flexkvd.log" 2>&1 &
daemon=$!
for _ in $(seq 1 100); do [ -S "$dir/s" ] && break; sleep 0.05; done
common=(--socket "$dir/s" --layers 32 --kv-blocks 1024)
CUDA_VISIBLE_DEVICES=${gpus[0]} "$client" "${common[@]}" --name writer --do store:77:1024 | tee "$out/writer.txt"
loads=(--load-repeat 10 --do load:77:1024)
echo "== one engine alone"
CUDA_VISIBLE_DEVICES=${gpus[1]} "$client" "${common[@]}" --name alone "${loads[@]}" | tee "$out/alone.txt"
echo "== two engines at once"
start=$(( $(date +%s%3N) + 4000 ))
CUDA_VISIBLE_DEVICES=${gpus[0]} "$client" "${common[@]}" --name rank0 --start-at-ms "$start" "${loads[@]}" >"$out/rank0.txt" &
a=$!
CUDA_VISIBLE_DEVICES=${gpus[1]} "$client" "${common[@]}" --name rank1 --start-at-ms "$start" "${loads[@]}" >"$out/rank1.txt" &
b=$!
wait $a $b
cat "$out/rank0.txt" "$out/rank1.txt"
kill -TERM "$daemon"; wait "$daemon"; rm -rf "$pool" "$dir"
python3 - "$out" <<'PY'
import os, sys
out, rounds, block = sys.argv[1], 10, 2 * 1024 * 1024
def loaded(name):  # LOADED <hits> <loaded> <equal> <STATUS> <us of all rounds> <layer0_us> <in_order>
    r = [l.split() for l in open(os.path.join(out, name)) if l.startswith("LOADED")][0]
    return int(r[2]), r[3] == "1" and r[4] == "OK", float(r[5])
(n1, e1, us1), (na, ea, usa), (nb, eb, usb) = loaded("alone.txt"), loaded("rank0.txt"), loaded("rank1.txt")
single = rounds * n1 * block / (us1 * 1e3)
pair = rounds * (na + nb) * block / (max(usa, usb) * 1e3)
print(f"SUMMARY byte-exact={e1 and ea and eb} one-engine={single:.1f} GB/s two-engines-aggregate={pair:.1f} GB/s "
      f"(each: {rounds} rounds of {n1} blocks of 2 MiB, layer-wise loads; pair wall {max(usa, usb)/1e3:.0f} ms)")
PY

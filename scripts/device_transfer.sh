#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): the GPU tests, then
# `flexkv-bench transfer --json [ARGS...]`, logs under $OUT, a short table last.
#
# Build and bundle here first (the binaries and every shared library they load but the driver's):
#   ../shared/tools/device-bundle.sh .device/bundle <build>/tests/gpu/flexkv_gpu_tests <build>/flexkv-bench \
#     <build>/flexkvd
# (flexkvd beside flexkv-bench: its layer-wise section starts one to time layer 0 with progress completions and with
# CUDA layer events; --daemon-layers off skips it)
# then run with carry [".device"]:  bash scripts/device_transfer.sh [--sweep] [--iters N] ...
# GPU_TESTS=0 skips the tests; TAG=x names the bench's files transfer<x>.json, summary<x>.txt (a second run in
# the same $OUT).
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-transfer}
tag=${TAG:-}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem \
  --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
nvidia-smi topo -m >>"$out/nvidia-smi.txt" 2>&1 || true

if [ "${GPU_TESTS:-1}" != 0 ]; then
  echo "== GPU tests"
  if ! timeout "${TEST_TIMEOUT:-180}" "$bundle/bin/flexkv_gpu_tests" --durations yes >"$out/gpu_tests.log" 2>&1; then
    status=1
    echo "GPU TESTS FAILED"
  fi
  tail -n 4 "$out/gpu_tests.log"
fi

echo "== flexkv-bench transfer --json $*"
start=$(date +%s)
if ! timeout "${BENCH_TIMEOUT:-420}" "$bundle/bin/flexkv-bench" transfer --json "$@" >"$out/transfer$tag.json" 2>"$out/transfer$tag.stderr"; then
  status=1
  echo "BENCH FAILED"
  tail -n 20 "$out/transfer$tag.stderr"
fi
echo "bench wall time: $(( $(date +%s) - start )) s"

[ -s "$out/transfer$tag.json" ] && python3 - "$out/transfer$tag.json" <<'EOF' | tee "$out/summary$tag.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['device']} ({r['sms']} SMs), driver API {r['cuda_driver']}, runtime {r['cuda_runtime']}; "
      f"{r['layers']} layers x 2 planes, {r['blocks']} blocks, median of {r['iters']}")
print(f"defaults: store {r['default_gather']}  load {r['default_scatter']}")
if r["sweep"]:
    print("sweep (GB/s, ratio to a contiguous copy of the same bytes)")
    def fmt(sh):
        if sh["bulk_kib"]:
            return f"{sh['ctas']}xbulk{sh['bulk_kib']}K/{sh['stages']}"
        return f"{sh['ctas']}x{sh['threads']}u{sh['unroll']}w{sh['warps_per_chunk']}"
    for k in sorted({(s["chunk_kib"], s["dir"]) for s in r["sweep"]}):
        rows = sorted((s for s in r["sweep"] if (s["chunk_kib"], s["dir"]) == k), key=lambda s: -s["gbps"])
        if k[1] == "both":
            print(f"  {k[0]:>4}K both : " + " | ".join(
                f"{fmt(s['shape'])}+{fmt(s['load_shape'])} {s['gbps']:.1f} ({s['ratio']:.3f}; st {s['store_half_ms']:.1f} ld {s['load_half_ms']:.1f} ms)"
                for s in rows[:4]))
            continue
        plain = [s for s in rows if not s["shape"]["bulk_kib"]]
        bulk = [s for s in rows if s["shape"]["bulk_kib"]]
        near = [s for s in plain if s["gbps"] >= 0.99 * plain[0]["gbps"]]
        lean = min(near, key=lambda s: (s["shape"]["ctas"] * s["shape"]["threads"], -s["gbps"]))
        cell = lambda s: f"{fmt(s['shape'])} {s['gbps']:.1f} ({s['ratio']:.3f})"
        print(f"  {k[0]:>4}K {k[1]:5}: plain " + " | ".join(cell(s) for s in plain[:3]) + f" || lean {cell(lean)}"
              + " || bulk " + " | ".join(cell(s) for s in bulk[:3]))
print("chunk | ceiling st/ld/both | kernel store  load  both (ratios) | staged store  load  both (ratios) | copy-engine store  load  both (ratios) | layer-wise load kernel: layer0 / all / one-shot ms")
for c in r["results"]:
    ce, k, e, lw = c["ceiling"], c["kernel"], c["copy_engine"], c["layerwise_kernel"]
    sg = c["staged"]
    print(f"{c['chunk_kib']:>4}K | {ce['store_gbps']:.1f}/{ce['load_gbps']:.1f}/{ce['both_gbps']:.1f} | "
          f"{k['store_gbps']:.1f} {k['load_gbps']:.1f} {k['both_gbps']:.1f} ({k['store_ratio']:.3f} {k['load_ratio']:.3f} {k['both_ratio']:.3f}) | "
          f"{sg['store_gbps']:.1f} {sg['load_gbps']:.1f} {sg['both_gbps']:.1f} ({sg['store_ratio']:.3f} {sg['load_ratio']:.3f} {sg['both_ratio']:.3f}) | "
          f"{e['store_gbps']:.1f} {e['load_gbps']:.1f} {e['both_gbps']:.1f} ({e['store_ratio']:.3f} {e['load_ratio']:.3f} {e['both_ratio']:.3f}) | "
          f"{lw['first_layer_ms']:.3f} / {lw['all_layers_ms']:.2f} / {lw['oneshot_ms']:.2f} ({lw['throughput_vs_oneshot']:.3f})"
          f" | both halves ms: kernel st {k['both_store_half_ms']:.1f} ld {k['both_load_half_ms']:.1f}, staged st {sg['both_store_half_ms']:.1f} ld {sg['both_load_half_ms']:.1f}, ceiling st {ce['both_store_half_ms']:.1f} ld {ce['both_load_half_ms']:.1f}")
    if "store_checksums" in c:
        s = c["store_checksums"]
        print(f"      store with checksums: kernel {s['kernel_store_gbps']:.2f} ({s['kernel_store_vs_plain']:.4f} of plain "
              f"{k['store_gbps']:.2f}; plain again {s['plain_store_again_gbps']:.2f}), with a load {s['kernel_both_gbps']:.1f} "
              f"({s['kernel_both_vs_plain']:.4f}; st {s['kernel_both_store_half_ms']:.1f} ld {s['kernel_both_load_half_ms']:.1f} ms) | "
              f"copy engine + sums beside {s['copy_engine_beside_gbps']:.2f} ({s['copy_engine_beside_vs_plain']:.4f}), "
              f"after {s['copy_engine_after_gbps']:.2f} ({s['copy_engine_after_vs_plain']:.4f}) | sums alone {s['sums_only_gbps']:.0f} GB/s")
    if "kernel_alt" in c:
        a = c["kernel_alt"]
        print(f"      alt shapes {r['alt_store_shape']} / {r['alt_load_shape']}: {a['store_gbps']:.1f} {a['load_gbps']:.1f} {a['both_gbps']:.1f} "
              f"({a['store_ratio']:.3f} {a['load_ratio']:.3f} {a['both_ratio']:.3f}; both halves st {a['both_store_half_ms']:.1f} ld {a['both_load_half_ms']:.1f} ms)")
d = r.get("daemon_layerwise")
if d:
    if d["error"]:
        print(f"layer-wise load through flexkvd: not measured: {d['error']}")
    else:
        print(f"layer-wise load through flexkvd, {d['blocks']} Llama-3-8B blocks ({d['layers']} layers), until the "
              f"engine's stream may run layer 0 / the last layer:")
        print(f"  progress completions: {d['progress_first_layer_ms']:.3f} / {d['progress_last_layer_ms']:.3f} ms "
              f"(load {d['progress_load_gbps']:.1f} GB/s)")
        print(f"  CUDA layer events:    {d['events_first_layer_ms']:.3f} / {d['events_last_layer_ms']:.3f} ms "
              f"(load {d['events_load_gbps']:.1f} GB/s)")
EOF
exit $status

#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): issue 19's two-way study.
#   1. the machine: GPU, PCIe link, THP setting, CPUs and NUMA as the guest sees them;
#   2. `flexkv-bench transfer --two-way --json [ARGS...]` (transfer_two_way.h: ceilings, the copy engine with many
#      copies, the kernels on several maps and pools, staged copies, mixed) -> $OUT/two_way.json, a table;
#   3. Nsight Compute (ncu --clock-control none) on one store, one load and one pack launch: sysmem sectors and
#      requests per kernel, if the counters are readable here (KINDS.md: they are on Firecracker machines).
# Nsight Systems does not run on these machines (KINDS.md: nsys is not on the PATH and the bundled one makes no
# report), so concurrency is studied by timing variants, not by a timeline.
#
# Build and bundle here first:
#   ../shared/tools/device-bundle.sh .device/bundle build/flexkv-bench && strip .device/bundle/bin/*
# then run with carry [".device"]:  bash scripts/device_two_way.sh [--chunk-kib 8,32,128] ...
# NCU=0 skips step 3; TAG=x names the files two_way<x>.json (a second run in the same $OUT).
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-two-way}
tag=${TAG:-}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0

{
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem \
    --format=csv
  nvidia-smi topo -m
  echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1); shmem: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>&1)"
  nproc
  lscpu 2>&1 | grep -E 'Model name|NUMA|Socket'
  grep -E 'MemTotal|Hugepagesize|AnonHugePages' /proc/meminfo
} >"$out/machine$tag.txt" 2>&1
head -n 3 "$out/machine$tag.txt"
grep THP "$out/machine$tag.txt"

echo "== flexkv-bench transfer --two-way --json $*"
start=$(date +%s)
if ! timeout "${BENCH_TIMEOUT:-360}" "$bundle/bin/flexkv-bench" transfer --two-way --json "$@" \
    >"$out/two_way$tag.json" 2>"$out/two_way$tag.stderr"; then
  status=1
  echo "BENCH FAILED"
  tail -n 20 "$out/two_way$tag.stderr"
fi
echo "bench wall time: $(( $(date +%s) - start )) s"

if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
  echo "== ncu"
  ncu --query-metrics --chip gh100 >"$out/ncu_query.txt" 2>&1 || true
  metrics=gpu__time_duration.sum
  for m in lts__t_sectors_aperture_sysmem_op_read.sum lts__t_sectors_aperture_sysmem_op_write.sum \
      lts__t_requests_aperture_sysmem_op_read.sum lts__t_requests_aperture_sysmem_op_write.sum \
      pcie__read_bytes.sum pcie__write_bytes.sum sm__warps_active.avg.pct_of_peak_sustained_active \
      lts__t_sectors_aperture_device_op_read.sum lts__t_sectors_aperture_device_op_write.sum; do
    grep -q "^${m%%.*} " "$out/ncu_query.txt" && metrics="$metrics,$m"
  done
  echo "metrics: $metrics"
  timeout 180 ncu --clock-control none --metrics "$metrics" "$bundle/bin/flexkv-bench" transfer --two-way \
    --ncu-kernels --chunk-kib 32 --mib 512 >"$out/ncu$tag.txt" 2>&1 || echo "ncu failed (rc $?)"
  grep -E 'CopyChunks|BulkCopy|gpu__time|lts__|pcie__|sm__warps|==ERR|==WARN' "$out/ncu$tag.txt" | head -n 40
fi

[ -s "$out/two_way$tag.json" ] && python3 - "$out/two_way$tag.json" <<'EOF' | tee "$out/two_way_summary$tag.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['device']}: {r['mib']} MiB per copy, {r['layers']} layers, median of {r['iters']}; staging rings "
      f"{r['staging_mib']} MiB x 2, {r['large_staging_mib']} MiB x 3; huge pages: pool {r['pool_anon_huge_kib'] >> 10} MiB, "
      f"THP pool {r['thp_pool_anon_huge_kib'] >> 10} MiB")
for row in r["rows"]:
    extra = f"  st {row['store_half_ms']:.1f} ld {row['load_half_ms']:.1f} ms" if row["dir"] == "both" else ""
    print(f"{row['chunk_kib']:>4}K {row['variant']:<30} {row['dir']:<5} {row['gbps']:7.1f} ({row['ratio']:.3f}){extra}")
EOF
exit $status

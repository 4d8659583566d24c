#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root, as root): `flexkv-bench cluster` on a
# multi-core node (the dev VM has 2 cores, which the two daemons, etcd and the bench share). Needs network namespaces
# (the bench creates them) and the bench's absolute tool paths, which this script fills from the bundle.
# Bundle first:
#   ../shared/tools/device-bundle.sh .device/cl/b build/flexkvd build/flexkvctl build/flexkv-bench /usr/sbin/ip \
#     /usr/bin/ucx_perftest /usr/bin/etcdctl
#   cp /usr/bin/etcd .device/cl/b/bin/; cp -r /usr/lib/x86_64-linux-gnu/ucx .device/cl/b/ucxmods; rm .device/cl/b/ucxmods/*.a
#   strip --strip-debug .device/cl/b/bin/* .device/cl/b/lib/*; (cd .device/cl && tar -cJf cl.tar.xz b && rm -rf b)
#   cp ../shared/traces/synthetic_trace.jsonl .device/cl/            # carry: [".device/cl"]
set -uo pipefail
out=${OUT:-/tmp/flexkv-device-cluster}
mkdir -p "$out"
tar -xJf .device/cl/cl.tar.xz -C /tmp || { echo "cannot unpack the bundle"; exit 1; }
b=/tmp/b
export LD_LIBRARY_PATH="$b/lib" UCX_MODULE_DIR="$b/ucxmods"
for t in ip:/usr/sbin/ip etcd:/usr/bin/etcd etcdctl:/usr/bin/etcdctl ucx_perftest:/usr/bin/ucx_perftest; do
  [[ -x ${t#*:} ]] || cp "$b/bin/${t%%:*}" "${t#*:}"
done
{ date -u; uname -a; nproc; id; /usr/sbin/ip -V; } >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
if ! /usr/sbin/ip netns add fkv-probe >"$out/netns.txt" 2>&1; then
  echo "network namespaces cannot be created here: $(cat "$out/netns.txt")"
  exit 3
fi
/usr/sbin/ip netns del fkv-probe
for run in ${RUNS:-1 2 3}; do
  echo "== run $run"
  "$b/bin/flexkv-bench" cluster --trace .device/cl/synthetic_trace.jsonl ${ARGS:-} 2>&1 | tee "$out/run$run.txt" | \
    grep -E "pull A|Prefetch \(|am_bw|ucp_get|ratio|verify|directory|with peer|alone"
done

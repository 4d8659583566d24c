#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root, as root): `flexkv-bench cluster` on a
# multi-core node (the dev VM has 2 cores, which the two daemons, etcd and the bench share). Needs network namespaces
# (the bench creates them) and the bench's absolute tool paths, which this script fills from the bundle.
# The device tool sends the checkout the session started in (not a helper's worktree): put the bundle and this
# script in an ignored folder of that checkout, carry it, and name it in CL (default .device/cl). Bundle first:
#   ../shared/tools/device-bundle.sh .device/cl/b build/flexkvd build/flexkvctl build/flexkv-bench /usr/sbin/ip \
#     /usr/bin/ucx_perftest /usr/bin/etcdctl
#   cp /usr/bin/etcd .device/cl/b/bin/; cp -r /usr/lib/x86_64-linux-gnu/ucx .device/cl/b/ucxmods; rm .device/cl/b/ucxmods/*.a
#   strip --strip-debug .device/cl/b/bin/* .device/cl/b/lib/*; (cd .device/cl && tar -cJf cl.tar.xz b && rm -rf b)
#   cp ../shared/traces/synthetic_trace.jsonl .device/cl/            # carry: [".device/cl"]
# Then: OUT=$OUT RUNS="1 2" ARGS="--inflight 4" VARIANTS="--lanes 1;--lanes 4" TOP=1 bash scripts/device_cluster.sh
set -uo pipefail
cl=${CL:-.device/cl}
final=${OUT:-/tmp/flexkv-device-cluster}
out=$final/d  # everything goes into one archive at the end (the device tool brings back at most 8 files)
mkdir -p "$out"
trap 'tar -czf "$final/results.tar.gz" -C "$final" d && rm -rf "$out"' EXIT
tar -xJf "$cl/cl.tar.xz" -C /tmp || { echo "cannot unpack the bundle"; exit 1; }
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
# VARIANTS: bench arguments per variant, separated by ';' (e.g. "--lanes 1;--lanes 4"), each run once per RUN,
# interleaved (run 1: every variant, run 2: every variant, ...) so that a drift of the machine hits them alike.
# With TOP=1 each run also samples the busiest threads (top -H, every second) into top_<run>_<variant>.txt.
IFS=';' read -r -a variants <<<"${VARIANTS:-}"
[[ ${#variants[@]} -gt 0 ]] || variants=("")
for run in ${RUNS:-1 2 3}; do
  for v in "${!variants[@]}"; do
    echo "== run $run, variant $v: ${ARGS:-} ${variants[$v]}"
    sampler=
    if [[ ${TOP:-0} == 1 ]] && command -v top >/dev/null; then
      (while sleep 1; do top -H -b -n1 -w 200 | head -24; done) >"$out/top_${run}_$v.txt" 2>&1 &
      sampler=$!
    fi
    # shellcheck disable=SC2086
    "$b/bin/flexkv-bench" cluster --trace "$cl/synthetic_trace.jsonl" ${ARGS:-} ${variants[$v]} 2>&1 | \
      tee "$out/run${run}_$v.txt" | grep -E "pull A|Prefetch \(|am_bw|ucp_get|ratio|verify|directory|with peer|alone"
    [[ -n $sampler ]] && kill "$sampler"
  done
done

#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): the first Attach of an engine and its
# time to first store at production pool sizes (issue 29 item 7; default 16, 64 and 96 GiB, SIZES="..." to change).
# For each size: a fresh flexkvd on a fresh pool, then flexkv-gpu-test-client (a 32-layer vLLM-shaped GPU cache,
# registered with CUDA IPC handles) attaches (attach_us, register_us), stores 64 blocks retrying while the daemon
# answers UNAVAILABLE (FIRSTSTORE: the time from Attach's return to the first stored block), loads them back
# byte-checked (LOADED), and `flexkvctl status --json` is polled until the background preparation ends (the time the
# whole pool took to be allocated and registered); then (RESTART=1, the default) the daemon is restarted on that pool:
# the time until its socket answers and until the 64 blocks load again. Logs under $OUT; one SUMMARY line per run.
# Bundle first:  ../shared/tools/device-bundle.sh .device/bundle build/flexkvd build/flexkvctl \
#   build/tests/integration/flexkv-gpu-test-client
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-device-attach}
sizes=${SIZES:-"16 64 96"}
repeat=${REPEAT:-2}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
  free -g
  nproc
  df -h /dev/shm /tmp
} 2>&1 | tee "$out/machine.txt"

largest=0
for s in $sizes; do [ "$s" -gt "$largest" ] && largest=$s; done
need_kb=$(( (largest + 4) * 1024 * 1024 ))
pooldir=/dev/shm/flexkv-attach
avail=$(df -k --output=avail /dev/shm | tail -1)
if [ "${avail:-0}" -lt "$need_kb" ]; then
  # /dev/shm of a container is often small: grow it, or mount a tmpfs of our own (root on the device machine).
  if mount -o remount,size=$((largest + 8))G /dev/shm 2>>"$out/machine.txt"; then
    echo "remounted /dev/shm at $((largest + 8))G" | tee -a "$out/machine.txt"
  else
    mkdir -p /mnt/flexkv-attach
    mount -t tmpfs -o size=$((largest + 8))G tmpfs /mnt/flexkv-attach 2>>"$out/machine.txt" &&
      pooldir=/mnt/flexkv-attach/pool && echo "pool on a tmpfs at /mnt/flexkv-attach" | tee -a "$out/machine.txt"
  fi
fi
df -h "$(dirname "$pooldir")" | tee -a "$out/machine.txt"

status=0
for size in $sizes; do
for run in $(seq 1 "$repeat"); do
  rm -rf "$pooldir"
  mkdir -p "$pooldir"
  sockdir=$(mktemp -d)
  sock="$sockdir/s"
  t0=$(date +%s%N)
  "$bundle/bin/flexkvd" --socket "$sock" --pool-path "$pooldir/pool" --pool-size "${size}GiB" \
    >"$out/flexkvd-$size-$run.log" 2>&1 &
  daemon=$!
  for _ in $(seq 1 600); do [ -S "$sock" ] && break; sleep 0.05; done
  ready_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  timeout 300 "$bundle/bin/flexkv-gpu-test-client" --socket "$sock" --layers 32 --kv-blocks 256 \
    --name "attach-$size" --do firststore:7:64 --do load:7:64 >"$out/client-$size-$run.txt" 2>&1 || status=1
  prep="" json=""
  for _ in $(seq 1 1200); do
    json=$("$bundle/bin/flexkvctl" --socket "$sock" --json status 2>/dev/null)
    prep=$(printf '%s' "$json" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["pool"].get("preparation",""))' 2>/dev/null)
    [ -z "$prep" ] && [ -n "$json" ] && break
    sleep 0.25
  done
  printf '%s\n' "$json" >"$out/status-$size-$run.json"
  figures=$(printf '%s' "$json" | python3 -c 'import json,sys; p=json.load(sys.stdin)["pool"]; print("pool prepared in %d ms (first grants served after %d ms), %.1f GiB active" % (p["prepare_ms"], p["first_serve_ms"], p["active_bytes"]/2**30))' 2>/dev/null)
  kill -TERM "$daemon"; wait "$daemon"
  restart=""
  if [ "${RESTART:-1}" = 1 ]; then
    # A restart on the pool just prepared (its 64 blocks in it): how long until the socket answers, and until the
    # blocks load again (restored blocks are served once their bytes are verified).
    t0=$(date +%s%N)
    "$bundle/bin/flexkvd" --socket "$sock" --pool-path "$pooldir/pool" --pool-size "${size}GiB" \
      >"$out/flexkvd-$size-$run-restart.log" 2>&1 &
    daemon=$!
    for _ in $(seq 1 2400); do [ -S "$sock" ] && break; sleep 0.025; done
    sock_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    hit_ms="none within 120 s"
    for _ in $(seq 1 240); do
      if timeout 60 "$bundle/bin/flexkv-gpu-test-client" --socket "$sock" --layers 32 --kv-blocks 256 \
           --name "restart-$size" --do load:7:64 2>/dev/null | grep -q '^LOADED 64 64 1 OK'; then
        hit_ms=$(( ($(date +%s%N) - t0) / 1000000 )); break
      fi
      sleep 0.25
    done
    restart="; restart: socket after ${sock_ms} ms, the 64 blocks load again after ${hit_ms} ms"
    kill -TERM "$daemon"; wait "$daemon"
  fi
  rm -rf "$pooldir" "$sockdir"
  echo "SUMMARY ${size}GiB run $run: socket after ${ready_ms} ms; $(grep -E '^(ATTACHED|ERROR)' "$out/client-$size-$run.txt" | head -1 | awk '{print $1, $6, $7}'); $(grep -E '^FIRSTSTORE' "$out/client-$size-$run.txt"); $(grep -E '^LOADED' "$out/client-$size-$run.txt"); ${figures:-no status}${restart}" | tee -a "$out/summary.txt"
done
done
exit $status

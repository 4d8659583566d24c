#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): the SSD tier with GPU engines. One
# flexkvd with a 2 GiB DRAM pool (1024 Llama-3-8B blocks of 2 MiB) and an SSD tier on the local disk; engine A
# (vLLM-shaped KV cache in GPU memory, 32 layers x 1024 blocks) stores SEEDS prompts of 256 blocks (3x what DRAM
# holds), pausing between stores so that write-back keeps up; engine B, another process, loads every prompt and
# compares the bytes (the older ones come back through SSD promotion); then flexkvd is killed with SIGKILL, its pool
# file removed and the page cache dropped (a reboot, as far as the cache can tell), and B loads every prompt again,
# from SSD alone. Logs under $OUT; `flexkvctl status` after each phase.
# Bundle: flexkvd, flexkvctl, flexkv-gpu-test-client (device-bundle.sh into .device/bundle).
set -uo pipefail
bundle=${BUNDLE:-.device/bundle}
out=${OUT:-/tmp/flexkv-ssd-e2e}
seeds=${SEEDS:-12}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
client="$bundle/bin/flexkv-gpu-test-client"
ctl="$bundle/bin/flexkvctl"
ssd=${SSD_DIR:-/var/tmp/flexkv-ssd-e2e}
pooldir=/dev/shm/flexkv-ssd-e2e
avail=$(df -k --output=avail /dev/shm | tail -1)
[ "${avail:-0}" -lt 5000000 ] && pooldir=/tmp/flexkv-ssd-e2e-pool
sock=/tmp/flexkv-ssd-e2e-sock/s
rm -rf "$ssd" "$pooldir" "$(dirname $sock)"; mkdir -p "$ssd" "$pooldir" "$(dirname $sock)"
start_daemon() {
  "$bundle/bin/flexkvd" --socket "$sock" --pool-path "$pooldir/pool" --pool-size 2GiB \
    --ssd-path "$ssd" --ssd-size "${SSD_SIZE:-24GiB}" >>"$out/flexkvd.log" 2>&1 &
  daemon=$!
  for _ in $(seq 1 200); do [ -S "$sock" ] && break; sleep 0.05; done
}
status=0
start_daemon
echo "== engine A stores $seeds prompts of 256 blocks (2 MiB each) into 1024 DRAM blocks"
for s in $(seq 1 "$seeds"); do
  timeout 120 "$client" --socket "$sock" --layers 32 --kv-blocks 1024 --name engine-a --do "store:$s:256" \
    2>>"$out/client-a.stderr" | grep -E "STORED|ERROR" | sed "s/^/seed $s: /" | tee -a "$out/store.txt"
  sleep "${PAUSE:-1}"
done
"$ctl" --socket "$sock" status | tee "$out/status-after-stores.txt"
echo "== engine B loads every prompt (LOADED hits loaded equal status us layer0_us in_order)"
args=""; for s in $(seq 1 "$seeds"); do args="$args load:$s:256"; done
timeout 300 "$client" --socket "$sock" --layers 32 --kv-blocks 1024 --name engine-b --do $args \
  2>>"$out/client-b.stderr" | tee "$out/load.txt"
grep -c "LOADED 256 256 1 OK" "$out/load.txt" | sed "s/^/prompts loaded whole and byte-exact: /"
grep -q "LOADED 256 256 1 OK" "$out/load.txt" || status=1
grep -E "LOADED [0-9]+ [0-9]+ 0 " "$out/load.txt" && { echo "WRONG BYTES"; status=1; }
"$ctl" --socket "$sock" status | tee "$out/status-after-loads.txt"
echo "== kill -9, pool file removed, page cache dropped: a reboot as far as the cache can tell"
kill -KILL "$daemon"; wait "$daemon" 2>/dev/null
rm -f "$pooldir"/pool*; sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || echo "(cannot drop the page cache here)"
start_daemon
timeout 300 "$client" --socket "$sock" --layers 32 --kv-blocks 1024 --name engine-b --do $args \
  2>>"$out/client-b.stderr" | tee "$out/load-after-restart.txt"
grep -c "LOADED 256 256 1 OK" "$out/load-after-restart.txt" | sed "s/^/after the restart, prompts loaded whole and byte-exact: /"
grep -E "LOADED [0-9]+ [0-9]+ 0 " "$out/load-after-restart.txt" && { echo "WRONG BYTES"; status=1; }
"$ctl" --socket "$sock" status | tee "$out/status-after-restart.txt"
kill -TERM "$daemon"; wait "$daemon"
grep -E "ssd|ERROR|WARN" "$out/flexkvd.log" | tail -20
rm -rf "$ssd" "$pooldir"
exit $status

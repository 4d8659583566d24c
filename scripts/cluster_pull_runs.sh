#!/usr/bin/env bash
# Live pull runs (issue 29 item 2): RUNS times, two fresh flexkvd (A and B, default --cluster-lanes 4) in network
# namespaces joined by veths to a hub (bridge + a real etcd), UCX over tcp. Each run: A stores PROMPTS prompts of
# BLOCKS blocks (128 KiB each); once A published them, B prefetches them all with INFLIGHT engines at once, then loads
# and compares every byte; then both daemons get SIGTERM. A run FAILS when a daemon dies (any signal: UCX's
# "async.c: Assertion handler->async == async" is SIGABRT) or exits non-zero, when its log has an assertion, or when a
# byte differs; it is SHORT when a prefetch pulled less than its whole prompt (counted, not a failure: a deadline on
# a loaded machine costs blocks, never bytes). Root only. Prints one line per run and a summary; exit 1 on a failure.
#   sudo RUNS=100 bash scripts/cluster_pull_runs.sh            # binaries from ./build
#   sudo BIN=/path/to/build RUNS=30 bash scripts/cluster_pull_runs.sh
# Every run listens on the same port (7471), as a restarted node does, while the previous run's connections wait in
# TIME_WAIT there; PORT_STEP=1 gives each run the next port instead (for a flexkvd from before issue 29, which could
# not bind it for a minute).
set -uo pipefail
bin=$(cd "${BIN:-$(dirname "$0")/../build}" && pwd)
runs=${RUNS:-100}
prompts=${PROMPTS:-16}
blocks=${BLOCKS:-32}
inflight=${INFLIGHT:-4}
ip=/usr/sbin/ip
etcd=/usr/bin/etcd
[[ $(id -u) -eq 0 ]] || { echo "root only (network namespaces)"; exit 2; }
client=$bin/flexkv-test-client
[[ -x $client ]] || client=$bin/tests/integration/flexkv-test-client
for t in "$bin/flexkvd" "$bin/flexkvctl" "$client" "$etcd" "$ip"; do
  [[ -x $t ]] || { echo "missing $t"; exit 2; }
done

tag=$$
net="10.234.$((tag % 200 + 20))"
hub="fkvph$tag"
work=$(mktemp -d /dev/shm/flexkv-pull-runs-XXXXXX)  # the pools too: memory, not disk
cleanup() {
  for ns in "$hub" "fkvpa$tag" "fkvpb$tag"; do
    for p in $($ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    $ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT

$ip netns add "$hub" && $ip -n "$hub" link set lo up && $ip -n "$hub" link add br0 type bridge &&
  $ip -n "$hub" addr add "$net.1/24" dev br0 && $ip -n "$hub" link set br0 up || { echo "cannot create namespaces"; exit 3; }
i=2
for n in a b; do
  ns="fkvp$n$tag"
  $ip netns add "$ns"
  $ip -n "$hub" link add "fkvp${n}o$tag" type veth peer name "fkvp${n}i$tag" netns "$ns"
  $ip -n "$hub" link set "fkvp${n}o$tag" master br0 up
  $ip -n "$ns" addr add "$net.$i/24" dev "fkvp${n}i$tag"
  $ip -n "$ns" link set "fkvp${n}i$tag" up
  $ip -n "$ns" link set lo up
  i=$((i + 1))
done
$ip netns exec "$hub" "$etcd" --name hub --data-dir "$work/etcd" \
  --listen-client-urls "http://$net.1:2379" --advertise-client-urls "http://$net.1:2379" \
  --listen-peer-urls http://127.0.0.1:0 >"$work/etcd.log" 2>&1 &
etcd_pid=$!
disown "$etcd_pid"  # killed with its namespace at the end, without a job notice
head -c 32 /dev/urandom | base64 >"$work/secret" && chmod 600 "$work/secret"

status() { "$bin/flexkvctl" --socket "$1" status 2>/dev/null; }
wait_for() {  # socket, text, seconds
  local until=$((SECONDS + $3))
  while ((SECONDS < until)); do
    status "$1" | grep -q -- "$2" && return 0
    sleep 0.1
  done
  return 1
}
engine() {  # socket, name, steps...
  local s=$1 n=$2
  shift 2
  local args=()
  for step in "$@"; do args+=(--do "$step"); done
  "$client" --socket "$s" --name "$n" --layers 2 --kv-blocks "$blocks" "${args[@]}"
}

failed=0 short_runs=0 wrong=0
t_start=$SECONDS
for run in $(seq 1 "$runs"); do
  d="$work/run$run"
  pids=()
  for n in a b; do
    mkdir -p "$d/$n" && chmod 755 "$d/$n"
    ni=$([[ $n == a ]] && echo 2 || echo 3)
    $ip netns exec "fkvp$n$tag" "$bin/flexkvd" --socket "$d/$n/sock" --pool-path "$d/$n/pool" --pool-size 256MiB \
      --etcd-endpoints "$net.1:2379" --cluster-secret-file "$work/secret" --cluster-listen "$net.$ni:$((7471 + ${PORT_STEP:-0} * run))" \
      --node-id "node-$n" --cluster-transports tcp --transfer-dev "fkvp${n}i$tag" --cluster-chunk-blocks 4 \
      --cluster-lease-ttl 2 >"$d/$n.log" 2>&1 &
    pids+=($!)
  done
  verdict=PASS why=
  if ! wait_for "$d/a/sock" "cluster   joined.*; 2 members" 30 || ! wait_for "$d/b/sock" "cluster   joined.*; 2 members" 30; then
    verdict=FAIL why="the daemons did not see each other within 30 s"
  fi
  if [[ $verdict == PASS ]]; then
    steps=()
    for p in $(seq 1 "$prompts"); do steps+=("store:$((run * 1000 + p)):$blocks"); done
    engine "$d/a/sock" store "${steps[@]}" >"$d/store.txt" 2>&1
    [[ $(grep -c '^STORED .* OK' "$d/store.txt") -eq $prompts ]] || { verdict=FAIL why="store on A: $(grep -v '^STORED\|^ATTACHED' "$d/store.txt" | head -1)"; }
    wait_for "$d/a/sock" "(0 queued" 30 || true
  fi
  if [[ $verdict == PASS ]]; then
    # INFLIGHT engines on B, each prefetching its share of the prompts, then loading them.
    pullers=()
    for e in $(seq 0 $((inflight - 1))); do
      steps=()
      for p in $(seq $((e + 1)) "$inflight" "$prompts"); do steps+=("prefetch:$((run * 1000 + p)):$blocks"); done
      for p in $(seq $((e + 1)) "$inflight" "$prompts"); do steps+=("load:$((run * 1000 + p)):$blocks"); done
      engine "$d/b/sock" "puller$e" "${steps[@]}" >"$d/pull$e.txt" 2>&1 &
      pullers+=($!)
    done
    wait "${pullers[@]}"
    pulled=$(cat "$d"/pull*.txt | awk '$1 == "PREFETCHED" { s += $3 } END { print s + 0 }')
    bad=$(cat "$d"/pull*.txt | awk '$1 == "LOADED" && $2 > 0 && $4 != 1' | wc -l)
    [[ $bad -eq 0 ]] || { verdict=FAIL why="$bad loads with wrong bytes"; wrong=$((wrong + bad)); }
    if [[ $verdict == PASS && $pulled -lt $((prompts * blocks)) ]]; then
      verdict=SHORT why="pulled $pulled of $((prompts * blocks)) blocks"
      short_runs=$((short_runs + 1))
    fi
  fi
  for k in 0 1; do kill -TERM "${pids[$k]}" 2>/dev/null; done
  for k in 0 1; do
    wait "${pids[$k]}"
    rc=$?
    n=$([[ $k == 0 ]] && echo A || echo B)
    if [[ $rc -ne 0 ]]; then
      verdict=FAIL why="$why; flexkvd $n exited $rc$( ((rc > 128)) && echo " (signal $((rc - 128)))")"
    fi
  done
  if grep -l "Assertion\|ucs_fatal\|Fatal:" "$d"/*.log >/dev/null 2>&1; then
    verdict=FAIL why="$why; $(grep -h "Assertion\|ucs_fatal\|Fatal:" "$d"/*.log | head -1)"
  fi
  echo "run $run: $verdict${why:+ ($why)}"
  if [[ $verdict == FAIL ]]; then
    failed=$((failed + 1))
    mkdir -p "${KEEP:-/tmp}/flexkv-pull-run-failures" && cp -r "$d" "${KEEP:-/tmp}/flexkv-pull-run-failures/run$run-$tag"
  fi
  rm -rf "$d"
done
echo "summary: $runs runs, $failed failed (daemon died or exited non-zero, an assertion, or a wrong byte), $short_runs short" \
  "(a prefetch pulled less than its prompt), $wrong wrong loads; $((SECONDS - t_start)) s; flexkvd $bin/flexkvd"
[[ $failed -eq 0 ]]

#!/usr/bin/env bash
# Installs the Debian packages flexkvd needs to build and test, when any is missing. Idempotent and
# fast when everything is there (one dpkg-query). Sourced by run.sh and test.sh.
set -euo pipefail

FLEXKV_PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libcli11-dev catch2 libfmt-dev libxxhash-dev libsystemd-dev
  libtomlplusplus-dev  # the config's [namespace.*] ACL tables, with line numbers in errors
  nlohmann-json3-dev  # JSON: flexkvctl --json, flexkv-bench reports, the trace reader
  liburing-dev libibverbs-dev libboost-dev
  fio  # flexkv-bench ssd: the ceiling the SSD tier is measured against (io_uring, O_DIRECT, same directory)
  etcd-server etcd-client  # the cluster tier's membership and block directory (tests start their own etcd)
  libucx-dev ucx-utils iproute2  # the cluster tier's bytes (UCP RMA), ucx_perftest, network namespaces in tests
  libssl-dev  # the cluster handshake's HMAC-SHA256 (OpenSSL libcrypto; gRPC pulls it in, named here on purpose)
  python3 python3-grpcio python3-protobuf python3-xxhash
  python3-pytest python3-numpy  # the Python package's tests (tests/python) and examples/vllm_dp_rank.py --host
  python3-dev  # headers for the Python package's optional compiled fast path (flexkvd._fast; docs/python.md)
  prometheus-cpp-dev prometheus curl  # metrics: the library; promtool (in prometheus) and curl test it
  libzmq3-dev libmsgpack-dev python3-zmq python3-msgpack  # KV events: the vLLM-format ZMQ publisher and its Python test
  systemd util-linux procps
  help2man file dpkg-dev  # the package: man pages from --help; cpack's dpkg-shlibdeps (needs file) for its Depends
  clang-14 libclang-rt-14-dev  # libFuzzer targets (scripts/fuzz.sh)
)

flexkv_install_deps() {
  local missing=()
  local status
  for p in "${FLEXKV_PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ "$status" == "install ok installed" ]] || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  echo "flexkv: installing ${missing[*]}" >&2
  local sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  # Packages are installed for their tools (promtool) and libraries; never start their services here.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
    "${sudo[@]}" chmod +x "$policy"
    created_policy=1
  fi
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [[ $created_policy -eq 1 ]] && "${sudo[@]}" rm -f "$policy"
  return 0
}

# Configures (once) and builds the given targets (all when none) in build/.
flexkv_build() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [[ ! -f "$root/build/build.ninja" ]]; then
    cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  fi
  ninja -C "$root/build" "$@"
}

# flexkv_build, printing its progress on stderr for a person waiting on it: one line per tenth of the build steps
# (with the step count and the seconds so far), and the compiler's output in full when a step fails.
flexkv_build_progress() {
  local root log rcfile rc
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [[ ! -f "$root/build/build.ninja" ]]; then
    echo "flexkvd: configuring the build (cmake)" >&2
  fi
  log=$(mktemp)
  rcfile=$(mktemp)
  # (`||`: the failure is recorded even where errexit is on, as in scripts run with set -e)
  (NINJA_STATUS="[%f/%t] " flexkv_build "$@" 2>&1 && echo 0 >"$rcfile" || echo $? >"$rcfile") | tee "$log" | awk -v start="$(date +%s)" '
    match($0, /^\[[0-9]+\/[0-9]+\] /) {
      split(substr($0, 2, RLENGTH - 3), n, "/")
      step = int(n[1] * 10 / n[2])
      if (step > shown) {
        shown = step
        "date +%s" | getline now
        close("date +%s")
        printf "flexkvd: build %d%% (%d of %d steps, %d s)\n", step * 10, n[1], n[2], now - start > "/dev/stderr"
      }
    }'
  rc=$(cat "$rcfile")
  rc=${rc:-1}
  if [[ "$rc" != 0 ]]; then
    echo "flexkvd: the build failed; its output:" >&2
    grep -v '^\[[0-9]*/[0-9]*\] ' "$log" | tail -n 60 >&2
  fi
  rm -f "$log" "$rcfile"
  return "$rc"
}

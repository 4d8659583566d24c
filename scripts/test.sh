#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs every test this machine can run.
# Exit 0 only if all pass. GPU tests ([gpu]) skip themselves where no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
flexkv_install_deps
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
# Paths relative to the checkout: a fresh clone elsewhere (CI) reuses what an earlier build cached.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

# Runs one stage and prints how long it took, so a slow stage shows in the CI log. Exits on failure (set -e).
stage() {  # <name> <command...>
  local name=$1 start=$SECONDS
  shift
  echo "flexkv: $name" >&2
  "$@"
  echo "flexkv: $name: $((SECONDS - start)) s" >&2
}

stage "build (build/)" flexkv_build
stage "tests (build/)" ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600 "$@"
# The Debian package from build/ (cpack, no second build): installed, its daemon run as the unit says, reached by the
# installed flexkvctl, Python package and example engine project, purged. Root only (it skips itself otherwise).
stage "Debian package: build, install, run, purge (scripts/test_package.sh)" bash scripts/test_package.sh build

# The lock annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED) are checked by clang only: build-clang/
# compiles what ships and the test binaries with -Wthread-safety, a violation is an error, the project's other
# warnings stay warnings. Debug (-O0) because nothing runs from it. FLEXKV_THREAD_SAFETY=0 skips it.
clang_thread_safety_build() {
  if [[ ! -f build-clang/build.ninja ]]; then
    CC=clang-14 CXX=clang++-14 cmake -S . -B build-clang -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFLEXKV_WITH_CUDA=OFF \
      -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety" >/dev/null
  fi
  ninja -C build-clang flexkvd flexkvctl flexkv-test-client flexkv_unit_tests flexkv_integration_tests \
    flexkv_data_plane_tests flexkv_client_session_tests
}
if [[ ${FLEXKV_THREAD_SAFETY:-1} != 0 ]]; then
  stage "clang -Wthread-safety -Werror=thread-safety build (build-clang/)" clang_thread_safety_build
fi

# Sanitizers, on by default (CI); FLEXKV_SANITIZERS=0 runs the normal suite only. Each has its own build
# directory, CUDA off, and builds only what the tests run (no benches). A report anywhere fails: the sanitizers halt
# on the first one, and the test harness fails a test whose daemon or client printed one (tests/support/process.cc).
[[ ${FLEXKV_SANITIZERS:-1} == 0 ]] && exit 0
# -O1 -g1 (line tables): what the sanitizers' manuals recommend, and half the compile time of -O2 -g under
# instrumentation (measured: 4 of the largest files, 104 s -> 52 s of CPU; docs/performance.md "CI time"); reports
# still name file and line.
san_build() {  # <dir> <sanitizers> <targets...>
  local dir=$1 san=$2
  shift 2
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLEXKV_SANITIZE="$san" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" >/dev/null
  ninja -C "$dir" "$@"
}
san_ctest() {  # <dir> <ctest selection...>
  local dir=$1
  shift
  ctest --test-dir "$dir" --output-on-failure -j "$(nproc)" --timeout 900 --no-tests=error "$@"
}
SAN_TARGETS=(flexkvd flexkvctl flexkv-test-client flexkv_unit_tests flexkv_integration_tests flexkv_data_plane_tests
  flexkv_client_session_tests flexkv_cluster_tests flexkv_ucx_transport_tests flexkv-ucx-peer)
# UCX (linked into the daemon library for the cluster tier) hooks malloc and mmap through libucm when it is loaded;
# under TSan that interposition segfaults every thread start, under ASan it fights the allocator. The sanitizer runs
# turn the hooks off: the daemon registers its pool explicitly (ucp_mem_map) and needs no registration-cache events.
export UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none

asan_stage() {
  san_build build-asan address,undefined "${SAN_TARGETS[@]}"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    san_ctest build-asan -L 'unit|integration'
}
stage "AddressSanitizer + UndefinedBehaviorSanitizer: unit and integration tests" asan_stage

# The data plane runs in-process here, without gRPC (tests/unit/daemon/dataplane/data_plane_concurrency_test.cc: DataPlane and
# the cache driven through the client's ring code by several sessions, sessions ended under load). The integration
# tests are not run under TSan: Debian's gRPC and abseil are not instrumented, so TSan reports every gRPC call
# handoff (see tests/tsan.supp); that would need a TSan-built gRPC.
# The SSD store's tests run here too, except those that fork a child which starts threads (TSan cannot follow
# that): its I/O threads, submission from the callers' threads and the completion callbacks.
tsan_stage() {
  san_build build-tsan thread flexkv_unit_tests
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
    san_ctest build-tsan -R '^unit: ?(prefix index|drain |concurrent begin/finish|data plane: |ring transport: |copy scheduler: |handle table: |request handlers: |lease renewer: |cache: a scrub running beside |cache: resizes beside |ssd format: |ssd store: (many blocks|reopened|registered buffers|a payload byte|a torn write|a full queue|when full|one key in another)|ssd tier: )'
}
stage "ThreadSanitizer: the index, lifecycle, data-plane and SSD store concurrency tests" tsan_stage

stage "libFuzzer targets, ${FLEXKV_FUZZ_SECONDS:-20} s each" env FLEXKV_FUZZ_SECONDS="${FLEXKV_FUZZ_SECONDS:-20}" \
  bash scripts/fuzz.sh

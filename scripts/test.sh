#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs every test this machine can run.
# Exit 0 only if all pass. GPU tests ([gpu]) skip themselves where no GPU is visible.
# CI=true (.ci/run sets it): what cannot run fails the run with the reason instead of skipping: a stage that cannot
# run here, a test that skipped itself for any reason but the missing GPU (scripts/skipped_tests.py --ci), and the
# knobs that turn checks off (FLEXKV_SANITIZERS=0, FLEXKV_THREAD_SAFETY=0).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
flexkv_install_deps
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
# Paths relative to the checkout: a fresh clone elsewhere (CI) reuses what an earlier build cached. With -g, ccache
# also hashes the working directory unless told not to (hash_dir): without this, a clone in another directory missed
# every object (measured in session 19: 366 s builds over a warm cache). The cost: debug info of an object cached from
# another clone names that clone's build directory.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}

if [[ ${CI:-} == true ]]; then
  for knob in FLEXKV_SANITIZERS FLEXKV_THREAD_SAFETY; do
    [[ ${!knob:-1} != 0 ]] ||
      { echo "flexkv: FAIL: $knob=0 under CI=true: CI runs every check (the knob is for quick local runs)" >&2; exit 1; }
  done
fi

# What did not run, and why: a stage or test group that skipped itself appends its reason to FLEXKV_SKIPS_FILE, and
# the tests that skipped themselves are read from each ctest run's log; both are listed when the script ends, so a
# green run says what it did not test.
FLEXKV_SKIPS_FILE=$(mktemp /tmp/flexkv-skips.XXXXXX)
export FLEXKV_SKIPS_FILE
CTEST_DIRS=()  # those whose ctest ran in this run (a log left by an earlier run says nothing about this one)
summary() {
  local rc=$? dir
  set +e
  {
    echo "flexkv: summary ($([[ $rc -eq 0 ]] && echo passed || echo "FAILED, exit $rc")); skipped:"
    [[ -s $FLEXKV_SKIPS_FILE ]] && sed 's/^/  /' "$FLEXKV_SKIPS_FILE"
    for dir in "${CTEST_DIRS[@]}"; do python3 scripts/skipped_tests.py "$dir"; done
    [[ ${FLEXKV_SANITIZERS:-1} != 0 ]] || echo "  the sanitizer, thread-safety and fuzz stages (FLEXKV_SANITIZERS=0)"
    [[ ${FLEXKV_THREAD_SAFETY:-1} != 0 ]] || echo "  -Werror=thread-safety: a warning only (FLEXKV_THREAD_SAFETY=0)"
  } >&2
  rm -f "$FLEXKV_SKIPS_FILE"
  exit "$rc"
}
trap summary EXIT

# Runs ctest in <dir> (arguments after it go to ctest); under CI=true a test that skipped itself for any reason but the
# missing GPU then fails the stage, each one named with its reason.
run_ctest() {  # <dir> <ctest args...>
  local dir=$1
  shift
  CTEST_DIRS+=("$dir")
  ctest --test-dir "$dir" --output-on-failure -j "$(nproc)" --no-tests=error "$@"
  if [[ ${CI:-} == true ]] && ! python3 scripts/skipped_tests.py --ci "$dir" >&2; then
    echo "flexkv: FAIL: tests in $dir skipped themselves under CI=true (listed above with their reasons)" >&2
    return 1
  fi
}

# Runs one stage and prints how long it took, so a slow stage shows in the CI log. Exits on failure (set -e).
stage() {  # <name> <command...>
  local name=$1 start=$SECONDS
  shift
  echo "flexkv: $name" >&2
  "$@"
  echo "flexkv: $name: $((SECONDS - start)) s" >&2
}

stage "build (build/)" flexkv_build
# The libraries and the bench compile in unity batches (CMakeLists.txt, FLEXKV_UNITY_BUILD): a name defined at file
# scope in two of one target's sources would collide in a batch, or silently overload; this lists any.
stage "unity batches: no file-scope name twice in one target (scripts/check_unity_names.py)" \
  python3 scripts/check_unity_names.py build
stage "test names: none that ctest cannot register alone (scripts/check_test_names.py)" \
  python3 scripts/check_test_names.py
# Without a CUDA toolkit at configure time the GPU tests are not built at all: say so (CI may lack a GPU).
if ! ctest --test-dir build -N -L gpu | grep '^Total Tests: [1-9]' >/dev/null; then
  cuda=$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' build/CMakeCache.txt)
  if [[ -z $cuda || $cuda == *NOTFOUND ]]; then why="no CUDA toolkit when build/ was configured"; else why="none registered in build/"; fi
  echo "GPU tests (tests/gpu, [gpu]): not run: $why" >>"$FLEXKV_SKIPS_FILE"
fi
stage "tests (build/)" run_ctest build --timeout 600 "$@"
# The Debian package from build/ (cpack, no second build): installed, its daemon run as the unit says, reached by the
# installed flexkvctl, Python package and example engine project, purged; over what an earlier run of the daemon
# leaves (a regression test of issue 33: it makes /run/flexkvd and /dev/shm/flexkvd with a real run where the host
# has neither, and checks that both come back as they were). Root only (it skips itself otherwise, and fails under
# CI=true).
stage "Debian package over an earlier run's leftovers: build, install, run, purge (tests/scripts/test_package_over_leftovers_test.sh)" \
  bash tests/scripts/test_package_over_leftovers_test.sh build

# Sanitizers and the other clang checks, on by default (CI); FLEXKV_SANITIZERS=0 runs the normal suite only. Each
# build has its own directory, CUDA off, and builds only what its checks run (no benches). A report anywhere fails:
# the sanitizers halt on the first one, and the test harness fails a test whose daemon or client printed one
# (tests/support/process.cc).
[[ ${FLEXKV_SANITIZERS:-1} == 0 ]] && exit 0
# -O1 -g1 (line tables): what the sanitizers' manuals recommend, and half the compile time of -O2 -g under
# instrumentation (measured: 4 of the largest files, 104 s -> 52 s of CPU; docs/performance.md "CI time"); reports
# still name file and line.
san_configure() {  # <dir> <cmake args...>
  local dir=$1
  shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLEXKV_WITH_CUDA=OFF \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" "$@" >/dev/null
}
san_ctest() {  # <dir> <ctest selection...>
  local dir=$1
  shift
  run_ctest "$dir" --timeout 900 "$@"
}
SAN_TARGETS=(flexkvd flexkvctl flexkv-test-client flexkv_unit_tests flexkv_integration_tests flexkv_data_plane_tests
  flexkv_client_session_tests flexkv_cluster_tests flexkv_ucx_transport_tests flexkv-ucx-peer)
FUZZ_TARGETS=(fuzz_pool_recovery fuzz_attach_request fuzz_prefix_index fuzz_ring_descriptor fuzz_ssd_header
  fuzz_ssd_slot_index fuzz_peer_lookup)
# UCX (linked into the daemon library for the cluster tier) hooks malloc and mmap through libucm when it is loaded;
# under TSan that interposition segfaults every thread start, under ASan it fights the allocator. The sanitizer runs
# turn the hooks off: the daemon registers its pool explicitly (ucp_mem_map) and needs no registration-cache events.
export UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none

# One clang build (build-san/) serves three checks, so CI compiles the project once for them instead of three
# times: AddressSanitizer + UndefinedBehaviorSanitizer (the unit and integration tests run from it), the lock
# annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED: -Wthread-safety, a violation is an error, the
# project's other warnings stay warnings) and the libFuzzer targets (FLEXKV_FUZZ: everything carries libFuzzer's
# coverage instrumentation, fuzzer-no-link). FLEXKV_THREAD_SAFETY=0 drops -Werror=thread-safety.
san_clang_build() {
  # A build directory configured with another compiler cannot switch: start it again.
  if [[ -f build-san/CMakeCache.txt ]] && ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++-14$' build-san/CMakeCache.txt; then
    rm -rf build-san
  fi
  local ts_flags="-Wthread-safety -Werror=thread-safety"
  [[ ${FLEXKV_THREAD_SAFETY:-1} == 0 ]] && ts_flags="-Wthread-safety"
  CC=clang-14 CXX=clang++-14 san_configure build-san -DFLEXKV_SANITIZE=address,undefined -DFLEXKV_FUZZ=ON \
    -DCMAKE_CXX_FLAGS="$ts_flags"
  ninja -C build-san "${SAN_TARGETS[@]}" "${FUZZ_TARGETS[@]}"
}
stage "clang build: ASan + UBSan, -Werror=thread-safety, libFuzzer targets (build-san/)" san_clang_build

asan_tests() {
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    san_ctest build-san -L 'unit|integration'
}
stage "AddressSanitizer + UndefinedBehaviorSanitizer: unit and integration tests (build-san/)" asan_tests

# The data plane runs in-process here, without gRPC (tests/unit/daemon/dataplane/data_plane_concurrency_test.cc: DataPlane and
# the cache driven through the client's ring code by several sessions, sessions ended under load). The integration
# tests are not run under TSan: Debian's gRPC and abseil are not instrumented, so TSan reports every gRPC call
# handoff (see tests/tsan.supp); that would need a TSan-built gRPC.
# The SSD store's tests run here too, except those that fork a child which starts threads (TSan cannot follow
# that): its I/O threads, submission from the callers' threads and the completion callbacks.
tsan_stage() {
  san_configure build-tsan -DFLEXKV_SANITIZE=thread
  ninja -C build-tsan flexkv_unit_tests
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
    san_ctest build-tsan -R '^unit: ?(cache prepare: |prefix index|drain |concurrent begin/finish|data plane: |ring transport: |copy scheduler: |handle table: |request handlers: |lease renewer: |cache: a scrub running beside |cache: resizes beside |cache: the restart check with several threads |ssd format: |ssd store: (many blocks|reopened|registered buffers|a payload byte|a torn write|a full queue|when full|one key in another)|ssd tier: )'
}
stage "ThreadSanitizer: the index, lifecycle, data-plane and SSD store concurrency tests" tsan_stage

stage "libFuzzer targets (build-san/), ${FLEXKV_FUZZ_SECONDS:-15} s each" \
  env FLEXKV_FUZZ_SECONDS="${FLEXKV_FUZZ_SECONDS:-15}" FLEXKV_FUZZ_BUILD=build-san bash scripts/fuzz.sh

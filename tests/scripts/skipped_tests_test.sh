#!/usr/bin/env bash
# scripts/skipped_tests.py on a real ctest run: a scratch ctest project whose tests skip the ways the project's tests
# do (a Catch2 warning in Catch's console format, pytest -rs, ctest's SKIP_RETURN_CODE with and without a reason, a script's SKIP line) beside
# one that passes printing "skipped" in other senses. Each skipped test is listed with its reason, nothing else is;
# --ci fails on every skip but the missing GPU's and passes on that one alone. Run by ctest ("unit: skipped tests ...").
set -euo pipefail
script="$(cd "$(dirname "$0")/../.." && pwd)/scripts/skipped_tests.py"
project=$(mktemp -d)
trap 'rm -rf "$project"' EXIT
fail() { echo "FAIL: $*"; [[ -z ${out:-} ]] || echo "$out"; exit 1; }

cat >"$project/test_etcd.py" <<'EOF'
import pytest


def test_directory():
    pytest.skip("etcd not installed (Debian etcd-server)")
EOF
# Catch2 v2 prints a WARN of a passing test this way (file:line, "warning:", the message indented).
cat >"$project/catch_gpu.sh" <<'EOF'
printf -- '---\nkernels round-trip\n---\n../tests/gpu/kv_copy_test.cc:385\n...\n\n'
printf -- '../tests/gpu/kv_copy_test.cc:386: \nwarning:\n  no GPU visible; skipped\n\n===\ntest cases: 1 | 1 passed\n'
EOF
cat >"$project/passes.sh" <<'EOF'
echo "I 12:00:00.000 cache: skipped key 0x12ab (stale generation)"
printf -- '../tests/unit/x_test.cc:10: \nwarning:\n  the pool is smaller than asked\n\n'
echo "3 passed, 0 skipped"
EOF
cat >"$project/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.19)
project(skips NONE)
enable_testing()
add_test(NAME "gpu: kernels round-trip" COMMAND sh $project/catch_gpu.sh)
add_test(NAME "python: etcd directory" COMMAND /usr/bin/python3 -m pytest -p no:cacheprovider -q -rs test_etcd.py
         WORKING_DIRECTORY $project)
add_test(NAME "python: zmq events" COMMAND sh -c "echo 'skipped: libzmq was missing at configure time'; exit 5")
add_test(NAME "unit: silent" COMMAND sh -c "exit 5")
set_tests_properties("python: zmq events" "unit: silent" PROPERTIES SKIP_RETURN_CODE 5)
add_test(NAME "unit: units verify" COMMAND sh -c "echo 'SKIP: systemd-analyze not available'")
add_test(NAME "unit: passes" COMMAND sh $project/passes.sh)
EOF
out=$(python3 "$script" "$project/build" 2>&1) && fail "no ctest log yet, but skipped_tests.py exited 0"
grep -q "no ctest log at $project/build/Testing/Temporary/LastTest.log" <<<"$out" || fail "no line saying the log is missing"

cmake -S "$project" -B "$project/build" >/dev/null
ctest --test-dir "$project/build" >/dev/null
out=$(python3 "$script" "$project/build" ci-build) || fail "skipped_tests.py failed without --ci"
expected="  ci-build: gpu: kernels round-trip: no GPU visible; skipped
  ci-build: python: etcd directory: SKIPPED [1] test_etcd.py:5: etcd not installed (Debian etcd-server)
  ci-build: python: zmq events: skipped: libzmq was missing at configure time
  ci-build: unit: silent: skipped (ctest: SKIP_RETURN_CODE; the test printed no reason)
  ci-build: unit: units verify: SKIP: systemd-analyze not available"
[[ $(sort <<<"$out") == "$expected" ]] || { echo "expected:"; echo "$expected"; fail "another listing (below)"; }

out=$(python3 "$script" --ci "$project/build" ci-build) && fail "--ci passed over skips that CI must not have"
for name in "python: etcd directory" "python: zmq events" "unit: silent" "unit: units verify"; do
  grep -qF "ci-build: NOT RUN IN CI: $name: " <<<"$out" || fail "--ci does not name '$name' as not run in CI"
done
grep -qF "ci-build: gpu: kernels round-trip: no GPU visible" <<<"$out" || fail "--ci lost the GPU skip"
grep -qF "NOT RUN IN CI: gpu:" <<<"$out" && fail "--ci counts the missing GPU against CI"
grep -qF "ci-build: 4 test(s) skipped in CI for a reason other than the missing GPU" <<<"$out" || fail "no count line"

ctest --test-dir "$project/build" -R '^(gpu|unit: passes)' >/dev/null
out=$(python3 "$script" --ci "$project/build" ci-build) || fail "--ci failed with only the GPU skip"
[[ $out == "  ci-build: gpu: kernels round-trip: no GPU visible; skipped" ]] || fail "another listing for the GPU skip alone"
echo "PASS"

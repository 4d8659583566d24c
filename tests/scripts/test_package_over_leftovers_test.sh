#!/usr/bin/env bash
# Regression test for issue 33: the Debian package test on a host where the daemon ran before. `scripts/run.sh` as
# root leaves /run/flexkvd behind (its socket directory), and a daemon run with the unit's --pool-path leaves
# /dev/shm/flexkvd (its pool directory and lock); the package test used to say SKIP over them and pass having tested
# nothing, under CI=true too. Here a real run of the source-built daemon (build/flexkvd, as root, on run.sh's default
# socket, --pool-path /dev/shm/flexkvd/pool, stopped with SIGINT as Ctrl-C would) leaves both where the host has
# neither; then scripts/test_package.sh runs, and
#   - it must end in PASS after installing, running and purging the .deb, and say it moved the leftovers aside;
#     exit 0 without that is a failure under CI=true, and outside CI a failure too when its skip names a leftover
#     (other skips outside CI, e.g. a flexkvd package already installed, are its own and listed by scripts/test.sh);
#   - the leftovers must be back afterwards: the same entries, types, owners, modes, sizes, modification times and
#     file contents (sha256), whatever the package test's verdict.
# What a leftover path the host already had is left as it is: no daemon is run over it, only its state is compared.
# Removes only what it created. This is scripts/test.sh's package stage (one install of the .deb, not a second one).
#   tests/scripts/test_package_over_leftovers_test.sh [BUILD_DIR]     (default build/; root)
# Not root: runs scripts/test_package.sh, which says SKIP with the reason (a failure under CI=true).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
package_test=$root/scripts/test_package.sh

fail() { echo "FAIL tests/scripts/test_package_over_leftovers_test.sh: $*" >&2; exit 1; }
step() { echo "test_package_over_leftovers: $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
  exec bash "$package_test" "$build"
fi
[[ -x $build/flexkvd ]] || fail "$build/flexkvd is missing: build flexkvd (and the package's inputs) first"

leftovers=(/run/flexkvd /dev/shm/flexkvd)
work=$(mktemp -d /tmp/flexkv-leftovers.XXXXXX)
created=()
daemon_pid=""
cleanup() {
  local rc=$? path
  set +e
  if [[ -n $daemon_pid ]]; then kill -KILL "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null; fi
  for path in "${created[@]}"; do rm -rf "$path"; done
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The state a leftover must come back in: one line per entry (itself included), sorted, with a checksum per file.
state() {  # <path>
  local line
  find "$1" -printf '%P\t%y\t%u:%g\t%m\t%s\t%T@\t%l\n' | LC_ALL=C sort | while IFS= read -r line; do
    if [[ $(cut -f2 <<<"$line") == f ]]; then
      printf '%s\t%s\n' "$line" "$(sha256sum <"$1/$(cut -f1 <<<"$line")" | cut -d' ' -f1)"
    else
      printf '%s\n' "$line"
    fi
  done
}

# --- An earlier run of the source-built daemon, as scripts/run.sh starts it ---------------------------------------
daemon_args=(--pool-size 64MiB)
for path in "${leftovers[@]}"; do
  [[ -e $path ]] || created+=("$path")
done
if [[ ${#created[@]} -gt 0 ]]; then
  # Where the host has its own leftover, the daemon uses a scratch path instead: that one is not touched.
  if [[ -e /run/flexkvd ]]; then socket=$work/flexkvd.sock; daemon_args+=(--socket "$socket"); else socket=/run/flexkvd/flexkvd.sock; fi
  if [[ -e /dev/shm/flexkvd ]]; then daemon_args+=(--pool-path "$work/pool"); else daemon_args+=(--pool-path /dev/shm/flexkvd/pool); fi
  step "making what an earlier run leaves: $build/flexkvd ${daemon_args[*]}, stopped with SIGINT"
  "$build/flexkvd" "${daemon_args[@]}" >"$work/flexkvd.log" 2>&1 &
  daemon_pid=$!
  # Ready once its socket is in place (bound, listening, renamed into place).
  for _ in $(seq 1200); do
    [[ -S $socket ]] && break
    kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/flexkvd.log" >&2; fail "$build/flexkvd exited before serving (log above)"; }
    sleep 0.1
  done
  [[ -S $socket ]] || { cat "$work/flexkvd.log" >&2; fail "$build/flexkvd made no socket $socket within 120 s (log above)"; }
  kill -INT "$daemon_pid"
  rc=0
  wait "$daemon_pid" || rc=$?
  daemon_pid=""
  [[ $rc -eq 0 ]] || { cat "$work/flexkvd.log" >&2; fail "$build/flexkvd exited $rc on SIGINT; expected 0 (log above)"; }
  for path in "${created[@]}"; do
    [[ -d $path ]] || fail "the daemon's run left no $path: this test no longer makes what scripts/run.sh leaves"
  done
fi
for path in "${leftovers[@]}"; do
  state "$path" >"$work/before.${path//\//_}"
  step "$path before: $(wc -l <"$work/before.${path//\//_}") entries, $(stat -c '%U:%G %a' "$path")"
done

# --- The package test over them ------------------------------------------------------------------------------------
status=0
bash "$package_test" "$build" 2>&1 | tee "$work/package.log" >&2 || status=$?

# The leftovers are back, whatever the verdict.
for path in "${leftovers[@]}"; do
  [[ -e $path ]] || fail "$path is gone after scripts/test_package.sh: an earlier run's files were lost"
  state "$path" >"$work/after.${path//\//_}"
  if ! diff "$work/before.${path//\//_}" "$work/after.${path//\//_}" >"$work/diff" 2>&1; then
    cat "$work/diff" >&2
    fail "$path is not back as it was after scripts/test_package.sh (< before, > after; path, type, owner, mode, size, mtime, link, sha256)"
  fi
done
step "${leftovers[*]} back as they were (entries, owners, modes, sizes, times, contents)"

[[ $status -eq 0 ]] || fail "scripts/test_package.sh exited $status (its output is above)"
if ! grep -q '^PASS scripts/test_package.sh' "$work/package.log"; then
  skipped=$(grep -m1 '^SKIP' "$work/package.log" || echo "no PASS and no SKIP line")
  [[ ${CI:-} != true ]] || fail "scripts/test_package.sh exited 0 under CI=true without testing the package: $skipped"
  if grep -E '/run/flexkvd|/dev/shm/flexkvd' <<<"$skipped" | grep -v 'in use by a running process' >/dev/null; then
    fail "scripts/test_package.sh skipped because of what an earlier run left: $skipped"
  fi
  step "the package test skipped for a reason of this host (listed by scripts/test.sh): $skipped"
  exit 0
fi
for line in 'test_package: dpkg -i ' 'test_package: ready: ' 'test_package: purged: '; do
  grep -q "^$line" "$work/package.log" || fail "scripts/test_package.sh passed without its '$line' step"
done
for path in "${leftovers[@]}"; do
  grep -q "^test_package: moved $path " "$work/package.log" ||
    fail "scripts/test_package.sh passed without moving $path aside: it did not run over the leftover"
done
echo "PASS tests/scripts/test_package_over_leftovers_test.sh (the package installed, run and purged over ${leftovers[*]}; both put back)"

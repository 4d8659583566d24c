#!/usr/bin/env bash
# The Debian package test on a host that ran the daemon before (issue 33): what an earlier run leaves under the
# package's paths (`scripts/run.sh` as root leaves /run/flexkvd; a daemon run with the unit's --pool-path leaves
# /dev/shm/flexkvd) must neither turn the package test off nor be lost. Puts such leftovers in place where the host has none (a marker file in each, standing for the
# socket and the pool), runs scripts/test_package.sh under CI=true, and checks that it tested the package (installed,
# ran and purged it: its last step line) and that the leftovers are back, byte for byte. Removes only what it created.
#   scripts/test_package_leftovers.sh [BUILD_DIR]     (root; scripts/test.sh runs it as its package stage)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
if [[ $(id -u) -ne 0 ]]; then
  # Not root: the package test cannot install anything; it says so itself (and fails under CI=true).
  exec bash scripts/test_package.sh "$build"
fi
created=()
cleanup() {
  local p
  for p in "${created[@]}"; do rm -rf "$p"; done
}
trap cleanup EXIT
marker_text="left by an earlier flexkvd run ($$)"
for dir in /run/flexkvd /dev/shm/flexkvd; do
  if [[ ! -e $dir ]]; then
    mkdir -p "$dir"
    created+=("$dir")
  fi
  echo "$marker_text" >"$dir/.flexkv-leftover-marker"
done
log=$(mktemp /tmp/flexkv-package-log.XXXXXX)
status=0
CI=true bash scripts/test_package.sh "$build" 2>&1 | tee "$log" >&2 || status=$?
[[ $status -eq 0 ]] || { rm -f "$log"; echo "FAIL: scripts/test_package.sh exited $status" >&2; exit 1; }
if ! grep -q '^PASS scripts/test_package.sh' "$log"; then
  rm -f "$log"
  echo "FAIL: scripts/test_package.sh exited 0 without its PASS line: it did not test the package" >&2
  exit 1
fi
rm -f "$log"
for dir in /run/flexkvd /dev/shm/flexkvd; do
  [[ $(cat "$dir/.flexkv-leftover-marker" 2>/dev/null) == "$marker_text" ]] ||
    { echo "FAIL: $dir/.flexkv-leftover-marker was not put back after the package test" >&2; exit 1; }
  rm -f "$dir/.flexkv-leftover-marker"
done
echo "test_package_leftovers: the package was tested over an earlier run's /run/flexkvd and /dev/shm/flexkvd, both put back" >&2

#!/usr/bin/env bash
# The run command: installs what is missing, builds what the daemon needs to start (flexkvd, flexkvctl), and starts
# flexkvd in the foreground on the embedded default (socket and pool in a private runtime directory, a modest pool).
# Ctrl-C stops it cleanly. Extra arguments go to flexkvd (e.g. --pool-size 4GiB). The build shows its progress (a
# first build takes minutes on a small machine); the benchmark and tests are not built here (scripts/test.sh, or
# `source scripts/deps.sh; flexkv_build flexkv-bench`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
started=$(date +%s)
flexkv_install_deps
echo "flexkvd: building flexkvd and flexkvctl (build/; a first build takes several minutes)" >&2
flexkv_build_progress flexkvd flexkvctl
echo "flexkvd: built in $(( $(date +%s) - started )) s; starting; in another shell: build/flexkvctl status" >&2
exec build/flexkvd --pool-size "${FLEXKV_POOL_SIZE:-1GiB}" "$@"

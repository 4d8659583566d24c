#!/usr/bin/env bash
# The run command: installs what is missing, builds, and starts flexkvd in the foreground on the
# embedded default (socket and pool in a private runtime directory, a modest pool). Ctrl-C stops it
# cleanly. Extra arguments go to flexkvd (e.g. --pool-size 4GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
flexkv_install_deps
flexkv_build flexkvd flexkvctl flexkv-bench >/dev/null
echo "flexkvd: starting; in another shell: build/flexkvctl status" >&2
exec build/flexkvd --pool-size "${FLEXKV_POOL_SIZE:-1GiB}" "$@"

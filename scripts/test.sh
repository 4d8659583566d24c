#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs every test this machine can run.
# Exit 0 only if all pass. GPU tests ([gpu]) skip themselves where no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
flexkv_install_deps
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
flexkv_build
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600 "$@"

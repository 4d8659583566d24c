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
flexkv_build
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600 "$@"

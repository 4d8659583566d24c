#!/usr/bin/env bash
# scripts/check_layering.py refuses what the layering forbids, naming the file, line and include, and passes the
# tree as it is. Run by ctest ("unit: layering ...").
set -euo pipefail
script="$(cd "$(dirname "$0")/../.." && pwd)/scripts/check_layering.py"
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/daemon/cache" "$tree/daemon/tiers/ssd" "$tree/client" "$tree/common"
printf '#include "daemon/cache/pool.h"\n#include "common/log.h"\n' >"$tree/daemon/tiers/ssd/ok.cc"
printf '#include "flexkv/v1/control.pb.h"\n' >"$tree/client/ok.cc"
python3 "$script" "$tree"  # allowed: a tier uses the cache; anyone uses the generated protos
printf '// a cache that knows its tiers\n#include "daemon/tiers/ssd/ssd_tier.h"\n' >"$tree/daemon/cache/bad.cc"
printf '#include "daemon/cache/cache.h"\n' >"$tree/client/bad.cc"
if out=$(python3 "$script" "$tree" 2>&1); then
  echo "FAIL: check_layering.py accepted a cache that includes a tier and a client that includes the daemon"; exit 1
fi
grep -q 'daemon/cache/bad.cc:2: daemon/cache/ may not include "daemon/tiers/ssd/ssd_tier.h"' <<<"$out" ||
  { echo "FAIL: no line for the cache's include:"; echo "$out"; exit 1; }
grep -q 'client/bad.cc:1: client/ may not include "daemon/cache/cache.h"' <<<"$out" ||
  { echo "FAIL: no line for the client's include:"; echo "$out"; exit 1; }
python3 "$script" "$(dirname "$script")/.."  # the real tree passes
echo "PASS"

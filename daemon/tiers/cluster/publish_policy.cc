// What is published and what a Prefetch asks for; see publish_policy.h.
#include "daemon/tiers/cluster/publish_policy.h"

#include <algorithm>

namespace flexkv {

std::vector<size_t> LookupCandidates(std::span<const BlockKey> keys, size_t local, size_t reach,
                                     uint32_t chunk_blocks) {
  reach = std::min(reach, keys.size());
  std::vector<size_t> out;
  if (local >= reach) return out;
  size_t first = reach, last = reach;  // the first and last sampled positions in [local, reach); reach: none
  for (size_t j = local; j < reach; ++j) {
    if (!IsSampledKey(keys[j], chunk_blocks)) continue;
    if (first == reach) first = j;
    last = j;
  }
  for (size_t j = reach; j-- > local;) {
    if (first == reach || j < first || j >= last || IsSampledKey(keys[j], chunk_blocks)) out.push_back(j);
  }
  return out;
}

std::vector<size_t> LookupGapAbove(std::span<const BlockKey> keys, size_t found, size_t reach, uint32_t chunk_blocks) {
  reach = std::min(reach, keys.size());
  std::vector<size_t> out;
  if (found >= reach || !IsSampledKey(keys[found], chunk_blocks)) return out;
  size_t next = found + 1;
  while (next < reach && !IsSampledKey(keys[next], chunk_blocks)) ++next;
  if (next == reach) return out;  // `found` is the last sampled key: the keys after it were asked
  for (size_t j = next; j-- > found + 1;) out.push_back(j);
  return out;
}

}  // namespace flexkv

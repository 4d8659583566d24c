// RoutingIndex: key -> (DRAM nodes, SSD nodes) bit masks, behind one reader-writer lock; ChoosePrefixAware.
#include "flexkv/routing.h"

#include <algorithm>
#include <array>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

namespace flexkv {

namespace {

struct Holders {
  std::array<uint64_t, kCacheTierCount> nodes{};  // bit n: node n holds the key in that tier
  uint64_t any() const { return nodes[0] | nodes[1]; }
};

size_t TierIndex(CacheTier tier) { return static_cast<size_t>(tier) < kCacheTierCount ? static_cast<size_t>(tier) : 0; }

}  // namespace

struct RoutingIndex::State {
  mutable std::shared_mutex mu;
  std::vector<std::string> names;  // node number -> name
  std::unordered_map<BlockKey, Holders, BlockKeyHash> keys;
  std::vector<std::array<uint64_t, kCacheTierCount>> counts;  // node -> keys held per tier
  uint64_t dead = 0;                                          // bit n: node n is not live (SetLive)

  Status CheckNode(uint32_t node) const {
    if (node < names.size()) return Status::Ok();
    return Status::InvalidArgument("routing index: node " + std::to_string(node) + " was never added; expected 0.." +
                                   std::to_string(static_cast<int64_t>(names.size()) - 1) + " (AddNode)");
  }
  // Takes `node` out of every key's masks, drops the keys no node holds and zeroes its counts. Caller holds mu
  // exclusively.
  void DropNode(uint32_t node) {
    const uint64_t keep = ~(uint64_t{1} << node);
    for (auto it = keys.begin(); it != keys.end();) {
      for (uint64_t& mask : it->second.nodes) mask &= keep;
      it = it->second.any() == 0 ? keys.erase(it) : std::next(it);
    }
    counts[node] = {};
  }
};

RoutingIndex::RoutingIndex() : state_(std::make_unique<State>()) {}
RoutingIndex::~RoutingIndex() = default;

Result<uint32_t> RoutingIndex::AddNode(std::string_view name) {
  if (name.empty()) return Status::InvalidArgument("routing index: a node needs a non-empty name");
  std::unique_lock lock(state_->mu);
  auto& names = state_->names;
  if (std::find(names.begin(), names.end(), name) != names.end()) {
    return Status::AlreadyExists("routing index: node '" + std::string(name) + "' was added already");
  }
  if (names.size() >= kMaxNodes) {
    return Status::ResourceExhausted("routing index: " + std::to_string(kMaxNodes) +
                                     " nodes at most; cannot add '" + std::string(name) + "'");
  }
  names.emplace_back(name);
  state_->counts.push_back({});
  return static_cast<uint32_t>(names.size() - 1);
}

Result<uint32_t> RoutingIndex::FindNode(std::string_view name) const {
  std::shared_lock lock(state_->mu);
  const auto& names = state_->names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) return Status::NotFound("routing index: no node '" + std::string(name) + "'");
  return static_cast<uint32_t>(it - names.begin());
}

std::string RoutingIndex::NodeName(uint32_t node) const {
  std::shared_lock lock(state_->mu);
  return node < state_->names.size() ? state_->names[node] : std::string();
}

uint32_t RoutingIndex::node_count() const {
  std::shared_lock lock(state_->mu);
  return static_cast<uint32_t>(state_->names.size());
}

Status RoutingIndex::Stored(uint32_t node, CacheTier tier, std::span<const BlockKey> keys) {
  std::unique_lock lock(state_->mu);
  if (Status s = state_->CheckNode(node); !s.ok()) return s;
  const size_t t = TierIndex(tier);
  const uint64_t bit = uint64_t{1} << node;
  uint64_t added = 0;
  for (const BlockKey& key : keys) {
    uint64_t& mask = state_->keys[key].nodes[t];
    added += (mask & bit) == 0 ? 1 : 0;
    mask |= bit;
  }
  state_->counts[node][t] += added;
  return Status::Ok();
}

Status RoutingIndex::Removed(uint32_t node, CacheTier tier, std::span<const BlockKey> keys) {
  std::unique_lock lock(state_->mu);
  if (Status s = state_->CheckNode(node); !s.ok()) return s;
  const size_t t = TierIndex(tier);
  const uint64_t bit = uint64_t{1} << node;
  uint64_t removed = 0;
  for (const BlockKey& key : keys) {
    auto it = state_->keys.find(key);
    if (it == state_->keys.end() || (it->second.nodes[t] & bit) == 0) continue;
    it->second.nodes[t] &= ~bit;
    ++removed;
    if (it->second.any() == 0) state_->keys.erase(it);
  }
  state_->counts[node][t] -= removed;
  return Status::Ok();
}

Status RoutingIndex::ClearNode(uint32_t node) {
  std::unique_lock lock(state_->mu);
  if (Status s = state_->CheckNode(node); !s.ok()) return s;
  state_->DropNode(node);
  return Status::Ok();
}

Status RoutingIndex::ReplaceNode(uint32_t node, std::span<const BlockKey> dram, std::span<const BlockKey> ssd) {
  std::unique_lock lock(state_->mu);
  if (Status s = state_->CheckNode(node); !s.ok()) return s;
  state_->DropNode(node);
  const uint64_t bit = uint64_t{1} << node;
  const std::span<const BlockKey> tiers[kCacheTierCount] = {dram, ssd};
  for (size_t t = 0; t < kCacheTierCount; ++t) {
    uint64_t added = 0;
    for (const BlockKey& key : tiers[t]) {
      uint64_t& mask = state_->keys[key].nodes[t];
      added += (mask & bit) == 0 ? 1 : 0;
      mask |= bit;
    }
    state_->counts[node][t] = added;
  }
  return Status::Ok();
}

std::vector<RoutingIndex::NodePrefix> RoutingIndex::PrefixLengths(std::span<const BlockKey> keys) const {
  std::shared_lock lock(state_->mu);
  const uint32_t n = static_cast<uint32_t>(state_->names.size());
  std::vector<NodePrefix> out(n);
  for (uint32_t i = 0; i < n; ++i) {
    out[i].node = i;
    out[i].live = ((state_->dead >> i) & 1) == 0;
  }
  // Walk the prompt while some node still holds every block so far: `alive` (any tier) and `dram` (DRAM only)
  // lose a node's bit at its first missing block, where its prefix ends.
  const uint64_t all = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  uint64_t alive = all, dram = all;
  for (size_t i = 0; i < keys.size() && alive != 0; ++i) {
    auto it = state_->keys.find(keys[i]);
    const uint64_t here = it == state_->keys.end() ? 0 : it->second.any();
    const uint64_t here_dram = it == state_->keys.end() ? 0 : it->second.nodes[TierIndex(CacheTier::kDram)];
    for (uint64_t ended = alive & ~here; ended != 0; ended &= ended - 1) {
      out[static_cast<uint32_t>(__builtin_ctzll(ended))].blocks = static_cast<uint32_t>(i);
    }
    for (uint64_t ended = dram & ~here_dram; ended != 0; ended &= ended - 1) {
      out[static_cast<uint32_t>(__builtin_ctzll(ended))].dram_blocks = static_cast<uint32_t>(i);
    }
    alive &= here;
    dram &= here_dram;
  }
  // Nodes still alive at the end hold the whole prompt (in DRAM: those still in `dram`; dram is a subset).
  const uint32_t whole = static_cast<uint32_t>(keys.size());
  for (uint64_t m = alive; m != 0; m &= m - 1) out[static_cast<uint32_t>(__builtin_ctzll(m))].blocks = whole;
  for (uint64_t m = dram; m != 0; m &= m - 1) out[static_cast<uint32_t>(__builtin_ctzll(m))].dram_blocks = whole;
  return out;
}

Status RoutingIndex::SetLive(uint32_t node, bool live) {
  std::unique_lock lock(state_->mu);
  FLEXKV_RETURN_IF_ERROR(state_->CheckNode(node));
  const uint64_t bit = uint64_t{1} << node;
  state_->dead = live ? state_->dead & ~bit : state_->dead | bit;
  return Status::Ok();
}

uint64_t RoutingIndex::KeyCount(uint32_t node, CacheTier tier) const {
  std::shared_lock lock(state_->mu);
  return node < state_->counts.size() ? state_->counts[node][TierIndex(tier)] : 0;
}

uint64_t RoutingIndex::size() const {
  std::shared_lock lock(state_->mu);
  return state_->keys.size();
}

Result<uint32_t> ChoosePrefixAware(std::span<const RoutingIndex::NodePrefix> prefixes, std::span<const double> loads,
                                   double max_load_ratio) {
  if (prefixes.empty() || prefixes.size() != loads.size()) {
    return Status::InvalidArgument("ChoosePrefixAware: " + std::to_string(prefixes.size()) + " prefixes and " +
                                   std::to_string(loads.size()) + " loads; expected one of each per node, at least one");
  }
  size_t live = 0;
  double least = 0;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    if (!prefixes[i].live) continue;
    least = live++ == 0 ? loads[i] : std::min(least, loads[i]);
  }
  if (live == 0) {
    return Status::Unavailable("ChoosePrefixAware: none of the " + std::to_string(prefixes.size()) +
                               " nodes is live (their event streams ended or went quiet, or they left the cluster); "
                               "expected at least one");
  }
  const double limit = std::max(max_load_ratio, 1.0) * (least + 1.0);
  size_t best = prefixes.size();
  for (size_t i = 0; i < prefixes.size(); ++i) {
    if (!prefixes[i].live) continue;  // a request sent there would fail
    // Overloaded: a long prefix there would queue behind its work. The least loaded node always qualifies (also
    // for loads below -1, where the limit is below every load).
    if (loads[i] > limit && loads[i] != least) continue;
    if (best == prefixes.size() || prefixes[i].blocks > prefixes[best].blocks ||
        (prefixes[i].blocks == prefixes[best].blocks && loads[i] < loads[best])) {
      best = i;
    }
  }
  return prefixes[best].node;  // the least loaded live node always qualifies, so best was set
}

}  // namespace flexkv

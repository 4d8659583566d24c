// flexkv-bench trace: replays a Mooncake-format trace (one JSON object a line with `hash_ids`, one id per
// 512-token block) through a flexkvd it starts, from K client processes (DP ranks, round-robin), and reports the
// block hit ratio next to a reference block-LRU simulation at the same capacity and the infinite-cache bound.
//
// The pure parts (trace parsing, block tokens, the reference LRU, the bound, the hybrid pool simulation) are inline
// here so that a unit test can check them without a daemon.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "bench_json.h"
#include "daemon/cache/prefix_index.h"
#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv::bench {

struct TraceRequest {
  int64_t timestamp_ms = 0;
  std::vector<uint64_t> hash_ids;  // one per 512-token block
};

// Parses one trace line: a JSON object with "hash_ids" (an array of integers in 0..2^64-1) and, optionally,
// "timestamp" (an integer in 0..2^63-1, ms); other fields are ignored. INVALID_ARGUMENT saying what was wrong:
// not JSON (with the byte offset; this includes strings that are not UTF-8), not an object, a missing or mistyped
// field, a number out of range. The caller adds the file and line number.
inline Result<TraceRequest> ParseTraceLine(std::string_view line) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);  // the exception is the only way nlohmann says where and why
  } catch (const nlohmann::json::parse_error& e) {
    return Status::InvalidArgument(fmt::format("not valid JSON ({}); expected one JSON object a line", e.what()));
  }
  if (!j.is_object()) {
    return Status::InvalidArgument(fmt::format("a JSON {}; expected an object with \"hash_ids\"", j.type_name()));
  }
  TraceRequest r;
  if (auto ts = j.find("timestamp"); ts != j.end()) {
    // nlohmann stores a non-negative integer as unsigned, a negative one as signed, one past 2^64-1 as a float.
    if (!ts->is_number_unsigned() || ts->get<uint64_t>() > uint64_t{INT64_MAX}) {
      return Status::InvalidArgument(
          fmt::format("\"timestamp\" is {}; expected an integer in 0..2^63-1 (ms)", ts->dump()));
    }
    r.timestamp_ms = static_cast<int64_t>(ts->get<uint64_t>());
  }
  auto ids = j.find("hash_ids");
  if (ids == j.end()) return Status::InvalidArgument("no \"hash_ids\" field; expected an array of block ids");
  if (!ids->is_array()) {
    return Status::InvalidArgument(fmt::format("\"hash_ids\" is a JSON {}; expected an array of block ids",
                                               ids->type_name()));
  }
  r.hash_ids.reserve(ids->size());
  for (size_t i = 0; i < ids->size(); ++i) {
    const nlohmann::json& id = (*ids)[i];
    if (!id.is_number_unsigned()) {
      return Status::InvalidArgument(
          fmt::format("\"hash_ids\"[{}] is {}; expected an integer in 0..2^64-1", i, id.dump()));
    }
    r.hash_ids.push_back(id.get<uint64_t>());
  }
  return r;
}

// The tokens of the block whose trace id is `id`: a pure function of the id, distinct for distinct ids
// (token j = low 31 bits of id * tokens_per_block + j, and id < 2^22 keeps them distinct). Chained through
// ComputeBlockKeys, equal id sequences give equal keys and a different id anywhere gives different keys from
// there on: the trace's prefix identity.
inline void AppendBlockTokens(uint64_t id, uint32_t tokens_per_block, std::vector<int32_t>* tokens) {
  for (uint32_t j = 0; j < tokens_per_block; ++j) {
    tokens->push_back(static_cast<int32_t>((id * tokens_per_block + j) & 0x7FFFFFFFu));
  }
}

// Reference: plain LRU over individual blocks (no prefix closure). A request touches its blocks in order (match,
// then store of the rest), so the first block of a request is its least recently used one. Only a leading run of
// present blocks is usable by an engine: `Access` returns that run (prefix hits); `raw_hits` also counts present
// blocks after the first miss (not usable).
class BlockLru {
 public:
  explicit BlockLru(uint64_t capacity) : capacity_(capacity) {}

  uint64_t Access(std::span<const uint64_t> ids) {
    uint64_t prefix_hits = 0;
    bool prefix = true;
    for (uint64_t id : ids) {
      auto it = where_.find(id);
      if (it != where_.end()) {
        ++raw_hits_;
        if (prefix) ++prefix_hits;
        order_.splice(order_.end(), order_, it->second);  // to the most recently used end
      } else {
        prefix = false;
        if (capacity_ == 0) continue;
        if (where_.size() >= capacity_) {
          where_.erase(order_.front());
          order_.pop_front();
          ++evictions_;
        }
        order_.push_back(id);
        where_.emplace(id, std::prev(order_.end()));
      }
    }
    return prefix_hits;
  }
  uint64_t raw_hits() const { return raw_hits_; }
  uint64_t evictions() const { return evictions_; }
  size_t size() const { return where_.size(); }

 private:
  uint64_t capacity_;
  std::list<uint64_t> order_;  // front: least recently used
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where_;
  uint64_t raw_hits_ = 0;
  uint64_t evictions_ = 0;
};

// Infinite cache, prefix hits only: the leading blocks of each request that an earlier request already had.
struct HitCount {
  uint64_t hits = 0;
  uint64_t blocks = 0;
  double ratio() const { return blocks == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(blocks); }
};
inline HitCount InfiniteCacheBound(std::span<const TraceRequest> trace) {
  std::unordered_set<uint64_t> seen;
  HitCount c;
  for (const TraceRequest& r : trace) {
    bool prefix = true;
    for (uint64_t id : r.hash_ids) {
      const bool hit = seen.count(id) != 0;
      if (hit && prefix) ++c.hits;
      if (!hit) prefix = false;
      seen.insert(id);
    }
    c.blocks += r.hash_ids.size();
  }
  return c;
}

inline HitCount ReferenceLru(std::span<const TraceRequest> trace, uint64_t capacity) {
  BlockLru lru(capacity);
  HitCount c;
  for (const TraceRequest& r : trace) {
    c.hits += lru.Access(r.hash_ids);
    c.blocks += r.hash_ids.size();
  }
  return c;
}

// ---------------------------------------------------------------------------------------------------------------
// Hybrid pool simulation (issue #14; docs/performance.md, "Trace replay of hybrid geometries"). A model of the
// daemon's hybrid cache, replayed one request at a time in trace order: a FULL sub-pool (the daemon's own
// PrefixIndex: prefix-closed, leaf LRU), one sub-pool per other component (block key -> entry, LRU, entries whose
// FULL block is gone evicted first), the hit rule, and stores that are all or none across components.

// One component of a simulated pool.
struct SimComponent {
  ComponentKind kind = ComponentKind::kFull;
  uint32_t window_blocks = 0;  // kSlidingWindow: W
  uint32_t capacity = 0;       // slots of its sub-pool
};

// The components of `g` (component 0 first) with the given sub-pool capacities (one per component).
inline std::vector<SimComponent> SimComponentsOf(const Geometry& g, std::span<const uint32_t> capacities) {
  std::vector<SimComponent> out(g.component_count());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = {g.component_kind(i), g.window_blocks(i), i < capacities.size() ? capacities[i] : 0};
  }
  return out;
}

// The hit rule (docs/hybrid.md, "Match"): the longest prefix end e in [0, full_prefix] at which every component
// c >= 1 is usable - a sliding window holds the blocks [max(0, e - W), e), a state component holds the snapshot at
// e (the entry of block e - 1). `has(c, j)`: component c holds an entry for block j. e = 0 always qualifies.
inline size_t HybridHitEnd(size_t full_prefix, std::span<const SimComponent> components,
                           const std::function<bool(size_t, size_t)>& has) {
  for (size_t e = full_prefix; e > 0; --e) {
    bool usable = true;
    for (size_t c = 1; c < components.size() && usable; ++c) {
      if (components[c].kind == ComponentKind::kState) {
        usable = has(c, e - 1);
        continue;
      }
      const size_t w = components[c].window_blocks;
      for (size_t j = e > w ? e - w : 0; j < e && usable; ++j) usable = has(c, j);
    }
    if (usable) return e;
  }
  return 0;
}

// The sub-pool of one component c >= 1: like daemon/cache/component_index.h without pins, pending or unverified
// entries (a sequential replay has none). Eviction takes unanchored entries (their FULL block is gone: they serve
// no prefix end) first, then the least recently used anchored ones.
class ComponentLru {
 public:
  explicit ComponentLru(uint32_t capacity) : capacity_(capacity) {}

  bool Has(const BlockKey& key) const { return entries_.count(key) != 0; }
  // Marks the entry used. No-op without an entry.
  void Touch(const BlockKey& key) {
    auto it = entries_.find(key);
    if (it == entries_.end()) return;
    std::list<BlockKey>& l = it->second.anchored ? anchored_ : unanchored_;
    l.splice(l.end(), l, it->second.at);
  }
  // Whether Insert(keys) would succeed: free plus evictable slots (entries not of `keys`) cover the keys without
  // an entry. `keys` must not repeat a key.
  bool CanInsert(std::span<const BlockKey> keys) const { return Victims(keys).has_value(); }
  // Adds anchored entries for the keys without one, all or none: free slots first, then evicting; the keys' existing
  // entries are marked used (before the new ones). The new entries of the first `cold` keys go to the cold end
  // (evicted first, keys[0]'s first), as ComponentIndex::Commit's. Returns the entries added, or nullopt (nothing
  // changed) when CanInsert is false.
  std::optional<uint32_t> Insert(std::span<const BlockKey> keys, size_t cold = 0) {
    auto victims = Victims(keys);
    if (!victims) return std::nullopt;
    for (const BlockKey& v : *victims) {
      auto it = entries_.find(v);
      if (!it->second.anchored) ++unanchored_evictions_;
      (it->second.anchored ? anchored_ : unanchored_).erase(it->second.at);
      entries_.erase(it);
      ++evictions_;
    }
    uint32_t added = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (Has(keys[i])) Touch(keys[i]);  // as the daemon's store: entries it found cached count as used
    }
    cold = std::min(cold, keys.size());
    for (size_t i = cold; i < keys.size(); ++i) {
      if (Has(keys[i])) continue;
      anchored_.push_back(keys[i]);
      entries_.emplace(keys[i], Entry{true, std::prev(anchored_.end())});
      ++added;
    }
    for (size_t i = cold; i-- > 0;) {
      if (Has(keys[i])) continue;
      anchored_.push_front(keys[i]);
      entries_.emplace(keys[i], Entry{true, anchored_.begin()});
      ++added;
    }
    return added;
  }
  // The FULL block of `key` left (Unanchor) or came back (Anchor). No-op without an entry or when unchanged.
  void Unanchor(const BlockKey& key) { Move(key, false); }
  void Anchor(const BlockKey& key) { Move(key, true); }

  uint32_t capacity() const { return capacity_; }
  uint32_t size() const { return static_cast<uint32_t>(entries_.size()); }
  uint32_t unanchored() const { return static_cast<uint32_t>(unanchored_.size()); }
  uint64_t evictions() const { return evictions_; }
  uint64_t unanchored_evictions() const { return unanchored_evictions_; }

 private:
  struct Entry {
    bool anchored = true;
    std::list<BlockKey>::iterator at;
  };

  std::optional<std::vector<BlockKey>> Victims(std::span<const BlockKey> keys) const {
    size_t missing = 0;
    for (const BlockKey& k : keys) missing += Has(k) ? 0 : 1;
    const size_t free = capacity_ - entries_.size();
    std::vector<BlockKey> victims;
    if (missing <= free) return victims;
    const size_t need = missing - free;
    auto own = [&](const BlockKey& k) { return std::find(keys.begin(), keys.end(), k) != keys.end(); };
    for (const std::list<BlockKey>* l : {&unanchored_, &anchored_}) {
      for (auto it = l->begin(); it != l->end() && victims.size() < need; ++it) {
        if (!own(*it)) victims.push_back(*it);
      }
    }
    if (victims.size() < need) return std::nullopt;
    return victims;
  }
  void Move(const BlockKey& key, bool anchored) {
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.anchored == anchored) return;
    std::list<BlockKey>& from = it->second.anchored ? anchored_ : unanchored_;
    std::list<BlockKey>& to = anchored ? anchored_ : unanchored_;
    to.splice(to.end(), from, it->second.at);
    it->second.anchored = anchored;
  }

  uint32_t capacity_;
  std::list<BlockKey> unanchored_, anchored_;  // front: evicted first
  std::unordered_map<BlockKey, Entry, BlockKeyHash> entries_;
  uint64_t evictions_ = 0, unanchored_evictions_ = 0;
};

// A hybrid pool (or, with one FULL component, a full-attention pool) and an engine replaying requests into it.
// Not thread-safe.
class HybridPoolSim {
 public:
  // components[0] is the FULL component (capacity >= 1); the others sliding windows or states.
  explicit HybridPoolSim(std::vector<SimComponent> components)
      : components_(std::move(components)), full_(components_.at(0).capacity), parts_(components_.size()) {
    for (size_t c = 1; c < components_.size(); ++c) parts_[c] = std::make_unique<ComponentLru>(components_[c].capacity);
    full_.SetEvictionListener([this](SlotId, const BlockKey& key) {
      for (size_t c = 1; c < parts_.size(); ++c) parts_[c]->Unanchor(key);
    });
  }

  // What one request did, in entries per component (component 0: FULL blocks).
  struct Request {
    size_t full_prefix = 0;  // leading FULL blocks cached at the match
    size_t hit_end = 0;      // e: the hit (hit rule), the blocks the engine does not recompute
    std::vector<uint64_t> loaded, stored;
    uint32_t stores = 0, refused_stores = 0;
  };

  // One request as an engine runs it: Match (the hit rule), Load what e needs (FULL [0, e), each window's
  // [e - W, e), the state at e; the entries used count as used for LRU), then prefill from e and Store at each
  // boundary b = e + chunk_blocks, e + 2 chunk_blocks, ... below n, and at n (chunk_blocks 0: at n only). A store
  // at b holds FULL [0, b) (the cached part skipped), each window's [b - W, b) (right-aligned: the trailing window)
  // or, with `every_window`, every window block the engine computed since the last store as well ([start, b) with
  // start the previous boundary, or e: the store's window_keys) and the state at b; all or none across components.
  Request Replay(std::span<const BlockKey> keys, uint32_t chunk_blocks, bool every_window = false) {
    Request r;
    r.loaded.assign(components_.size(), 0);
    r.stored.assign(components_.size(), 0);
    r.full_prefix = full_.Match(keys, /*pin=*/false, nullptr);
    const size_t e = HitEnd(keys, r.full_prefix);
    r.hit_end = e;
    r.loaded[0] = e;
    for (size_t c = 1; c < components_.size() && e > 0; ++c) {
      for (const BlockKey& k : Needed(c, keys.first(e))) parts_[c]->Touch(k);
      r.loaded[c] = Needed(c, keys.first(e)).size();
    }
    const size_t n = keys.size();
    if (e == n) return r;
    size_t b = chunk_blocks == 0 ? n : std::min(n, e + chunk_blocks);
    size_t start = e;
    for (;;) {
      ++r.stores;
      if (!Store(keys.first(b), every_window ? b - start : 0, &r.stored)) ++r.refused_stores;
      if (b == n) break;
      start = b;
      b = std::min(n, b + chunk_blocks);
    }
    return r;
  }

  // The hit a request for `keys` would get now (marks the matched FULL blocks used, nothing else).
  size_t UsableEnd(std::span<const BlockKey> keys) { return HitEnd(keys, full_.Match(keys, false, nullptr)); }

  // Distinct cached prefix ends at which the hit rule holds (for a full-attention pool: every cached block).
  uint64_t UsableEndsHeld() const {
    std::unordered_map<BlockKey, BlockKey, BlockKeyHash> parent;
    full_.ForEachCommitted([&](SlotId, const BlockKey& k, const BlockKey& p) { parent.emplace(k, p); });
    uint64_t usable = 0;
    for (const auto& [key, up] : parent) {
      bool ok = true;
      for (size_t c = 1; c < components_.size() && ok; ++c) {
        if (components_[c].kind == ComponentKind::kState) {
          ok = parts_[c]->Has(key);
          continue;
        }
        BlockKey at = key;
        for (uint32_t w = 0; w < components_[c].window_blocks && ok; ++w) {
          ok = parts_[c]->Has(at);
          auto it = parent.find(at);
          if (it == parent.end() || it->second == kRootParent) break;
          at = it->second;
        }
      }
      usable += ok ? 1 : 0;
    }
    return usable;
  }

  const std::vector<SimComponent>& components() const { return components_; }
  // Entries held now, and evicted so far (component 0: FULL blocks).
  uint64_t held(size_t c) const { return c == 0 ? full_.committed_blocks() : parts_[c]->size(); }
  uint64_t evictions(size_t c) const { return c == 0 ? full_.evicted_blocks() : parts_[c]->evictions(); }
  uint64_t unanchored(size_t c) const { return c == 0 ? 0 : parts_[c]->unanchored(); }

 private:
  size_t HitEnd(std::span<const BlockKey> keys, size_t full_prefix) const {
    return HybridHitEnd(full_prefix, components_, [&](size_t c, size_t j) { return parts_[c]->Has(keys[j]); });
  }
  // The keys component c >= 1 needs for the prefix end keys.size().
  std::span<const BlockKey> Needed(size_t c, std::span<const BlockKey> prefix) const {
    if (prefix.empty()) return {};
    if (components_[c].kind == ComponentKind::kState) return prefix.last(1);
    return prefix.last(std::min<size_t>(components_[c].window_blocks, prefix.size()));
  }
  // The window entries a store of `prefix` carries: the trailing window, or its last `window_keys` keys when more.
  std::span<const BlockKey> Stored(size_t c, std::span<const BlockKey> prefix, size_t window_keys) const {
    const std::span<const BlockKey> trailing = Needed(c, prefix);
    if (components_[c].kind == ComponentKind::kState || window_keys <= trailing.size()) return trailing;
    return prefix.last(std::min(window_keys, prefix.size()));
  }
  bool Store(std::span<const BlockKey> prefix, size_t window_keys, std::vector<uint64_t>* stored) {
    for (size_t c = 1; c < components_.size(); ++c) {
      if (!parts_[c]->CanInsert(Stored(c, prefix, window_keys))) return false;
    }
    PrefixIndex::Reservation res = full_.Reserve(kRootParent, prefix);
    if (res.shortfall != StatusCode::kOk) {
      full_.Abort(res.slots);
      return false;
    }
    full_.Commit(res.slots);
    for (size_t j = res.cached; j < res.cached + res.slots.size(); ++j) {
      for (size_t c = 1; c < components_.size(); ++c) parts_[c]->Anchor(prefix[j]);
    }
    (*stored)[0] += res.slots.size();
    for (size_t c = 1; c < components_.size(); ++c) {
      const std::span<const BlockKey> keys = Stored(c, prefix, window_keys);
      (*stored)[c] += parts_[c]->Insert(keys, keys.size() - Needed(c, prefix).size()).value_or(0);
    }
    return true;
  }

  std::vector<SimComponent> components_;
  PrefixIndex full_;
  std::vector<std::unique_ptr<ComponentLru>> parts_;  // [c] for c >= 1
};

// The reference a hybrid geometry is compared with: the same model with every layer stored as FULL attention, one
// component (what a cache that ignores windows and states would keep). Sliding-window layers count with their own
// shape; a state layer (linear attention, Mamba) has no per-token KV, so it counts as a full-attention layer of
// component 0's shape: the dense model of the same depth. INVALID_ARGUMENT when a sliding window's shape differs
// from component 0's (one geometry cannot describe the mix).
inline Result<Geometry> AllFullReference(const Geometry& g) {
  Geometry ref = g.Component(0);
  for (size_t i = 1; i < g.component_count(); ++i) {
    const ComponentSpec& c = g.components[i - 1];
    if (c.kind == ComponentKind::kSlidingWindow &&
        (c.kv_planes != g.kv_planes || c.kv_heads_per_rank != g.kv_heads_per_rank || c.head_dim != g.head_dim ||
         c.dtype_bytes != g.dtype_bytes)) {
      return Status::InvalidArgument(fmt::format(
          "components[{}] (sliding window) has another attention shape than the full-attention layers; expected the "
          "same kv_planes, kv_heads_per_rank, head_dim and dtype_bytes for an all-FULL reference", i - 1));
    }
    ref.num_layers += c.num_layers;
  }
  return ref;
}

// The geometry presets `flexkv-bench trace --geometry` knows (geometry.h), by name, at `tokens_per_block` tokens a
// block (the trace's 512). INVALID_ARGUMENT naming the known presets for any other name.
inline Result<Geometry> TracePreset(std::string_view name, uint32_t tokens_per_block) {
  Geometry g;
  if (name == "llama3-8b") {
    g = Llama3_8B();
  } else if (name == "qwen3-8b") {
    g = Qwen3_8B();
  } else if (name == "deepseek-mla") {
    g = DeepSeekMla();
  } else if (name == "gpt-oss-20b") {
    g = GptOss20B();
  } else if (name == "gemma3-27b") {
    g = Gemma3_27B();
  } else if (name == "qwen3-next") {
    g = Qwen3Next80B();
  } else if (name == "jamba") {
    g = JambaLike();
  } else {
    return Status::InvalidArgument(fmt::format(
        "--geometry {}: unknown preset; expected llama3-8b, qwen3-8b, deepseek-mla, gpt-oss-20b, gemma3-27b, "
        "qwen3-next or jamba", name));
  }
  g.tokens_per_block = tokens_per_block;
  return g;
}

// The daemon replay of a model runs a scaled-down copy of its geometry: every FULL and sliding-window layer's bytes
// per token, and every state, divided by `scale`, so that slot sizes keep their ratios and a pool of budget / scale
// bytes has the slots of the model's pool at that budget (the hit ratio depends on slot counts, not bytes).
// TraceScale: the largest power of two in 1..max_scale that divides every component's per-token bytes of one
// layer and plane (kv_heads_per_rank x head_dim x dtype_bytes) and leaves every state a multiple of 16 bytes.
inline uint64_t TraceScale(const Geometry& g, uint64_t max_scale) {
  auto fits = [&](uint64_t s) {
    for (size_t i = 0; i < g.component_count(); ++i) {
      const Geometry c = g.Component(i);
      if (c.state_bytes_per_layer != 0 ? c.state_bytes_per_layer % (16 * s) != 0
                                       : (uint64_t{c.kv_heads_per_rank} * c.head_dim * c.dtype_bytes) % s != 0) {
        return false;
      }
    }
    return true;
  };
  uint64_t s = 1;
  while (s * 2 <= max_scale && fits(s * 2)) s *= 2;
  return s;
}
// `g` with every component scaled by `scale` (TraceScale's answer): one KV head of head_dim = the per-token bytes /
// scale, dtype 1 byte; states state_bytes_per_layer / scale.
inline Geometry ScaledGeometry(const Geometry& g, uint64_t scale) {
  Geometry out = g;
  auto shrink = [&](uint32_t* heads, uint32_t* dim, uint32_t* dtype) {
    *dim = static_cast<uint32_t>(uint64_t{*heads} * *dim * *dtype / scale);
    *heads = 1;
    *dtype = 1;
  };
  shrink(&out.kv_heads_per_rank, &out.head_dim, &out.dtype_bytes);
  for (ComponentSpec& c : out.components) {
    if (c.kind == ComponentKind::kState) {
      c.state_bytes_per_layer /= scale;
    } else {
      shrink(&c.kv_heads_per_rank, &c.head_dim, &c.dtype_bytes);
    }
  }
  return out;
}

// The window-churn trace (trace --window-churn): `passes` copies of `trace` one after the other, copy p with every
// id + p x 65536 (new prompts with the same sharing), so that a run lasts long enough for flexkvd's sub-pool sizing
// to act. INVALID_ARGUMENT when an id is 65536 or more (the copies would share ids) or passes is 0 or above 63.
inline Result<std::vector<TraceRequest>> RepeatTrace(std::span<const TraceRequest> trace, uint32_t passes) {
  if (passes == 0 || passes > 63) {
    return Status::InvalidArgument(fmt::format("--window-churn {}: expected 1..63 passes", passes));
  }
  int64_t span_ms = 0;
  for (const TraceRequest& r : trace) {
    span_ms = std::max(span_ms, r.timestamp_ms + 1);
    for (uint64_t id : r.hash_ids) {
      if (id >= 65536) {
        return Status::InvalidArgument(fmt::format(
            "--window-churn: the trace has block id {}; expected ids below 65536 (each pass adds 65536)", id));
      }
    }
  }
  std::vector<TraceRequest> out;
  out.reserve(trace.size() * passes);
  for (uint32_t p = 0; p < passes; ++p) {
    for (const TraceRequest& r : trace) {
      TraceRequest copy = r;
      copy.timestamp_ms += span_ms * p;
      for (uint64_t& id : copy.hash_ids) id += uint64_t{p} * 65536;
      out.push_back(std::move(copy));
    }
  }
  return out;
}

// `trace --split` as one weight per component ("w0,w1,..."; each > 0). INVALID_ARGUMENT saying what was expected
// for anything else; "daemon" and "demand" are the caller's.
inline Result<std::vector<double>> ParseSplitWeights(std::string_view text, size_t components) {
  std::vector<double> weights;
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string part(text.substr(at, comma - at));
    char* end = nullptr;
    const double w = std::strtod(part.c_str(), &end);
    if (part.empty() || *end != '\0' || !(w > 0)) {
      weights.clear();
      break;
    }
    weights.push_back(w);
    at = comma + 1;
  }
  if (weights.size() != components) {
    return Status::InvalidArgument(fmt::format(
        "--split {}: expected daemon, demand or {} positive weights, one per component", text, components));
  }
  return weights;
}

}  // namespace flexkv::bench

// Entry points (argv[0] is the subcommand name).
int RunTraceBench(int argc, char** argv);
// `trace --geometry`: the hybrid report (trace_hybrid_bench.cc); returns the exit code.
namespace flexkv::bench {
// What a daemon replay of a hybrid geometry measured; per component from the daemon's metrics at the end.
struct HybridDaemonRun {
  uint64_t blocks = 0, hit_blocks = 0, stored_full = 0, shortfalls = 0, mismatches = 0;
  double seconds = 0;
  std::vector<uint64_t> capacity, used, unanchored, evicted;
  std::vector<uint64_t> active_end;  // each sub-pool's active slots at the end (flexkv_component_capacity_slots)
};
struct HybridTraceOptions {
  std::string trace;  // absolute path
  std::string preset;
  std::vector<uint32_t> capacities;  // budgets, in blocks of the all-FULL reference
  uint32_t chunk_blocks = 16;
  // The budget's split between sub-pools: "daemon" (flexkvd's default), "demand" (in proportion to what each
  // component holds after the trace with no eviction) or one weight per component, "w0,w1,...".
  std::string split = "daemon";
  bool json = false;
  // The window-churn case (trace --window-churn): per capacity, the sliding-window share swept in the simulation
  // (the ideal: the most hit blocks), the default split fixed (simulation and flexkvd with that --swa-share) and
  // flexkvd with its sub-pools sized by demand; flexkvd's hit blocks reported as a fraction of the ideal.
  bool window_churn = false;
  // Replays the trace through a flexkvd holding the model's geometry scaled by `scale` (ScaledGeometry) in a pool of
  // pool_bytes, started with --swa-share / --state-share (0: its default); nullopt after printing why. Empty:
  // simulation only.
  std::function<std::optional<HybridDaemonRun>(uint32_t capacity_blocks, uint64_t pool_bytes, uint64_t scale,
                                               double swa_share, double state_share)>
      daemon;
  // Each store carries every window block the engine computed since its last store (window_keys, ring layout 5),
  // not only the trailing window; `daemon` is told the same (trace --window-stores).
  bool every_window = false;
};
// Prints the text report, or with options.json sets *json to the report's object. 0, or the exit code after an
// error message.
int RunHybridTraceReport(const HybridTraceOptions& options, std::span<const TraceRequest> trace, Json* json);
}  // namespace flexkv::bench
int RunTraceWorker(int argc, char** argv);

// flexkv-bench trace: replays a Mooncake-format trace (one JSON object a line with `hash_ids`, one id per
// 512-token block) through a flexkvd it starts, from K client processes (DP ranks, round-robin), and reports the
// block hit ratio next to a reference block-LRU simulation at the same capacity and the infinite-cache bound.
//
// The pure parts (trace parsing, block tokens, the reference LRU, the bound) are inline here so that a unit test
// can check them without a daemon.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <list>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

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

}  // namespace flexkv::bench

// Entry points (argv[0] is the subcommand name).
int RunTraceBench(int argc, char** argv);
int RunTraceWorker(int argc, char** argv);

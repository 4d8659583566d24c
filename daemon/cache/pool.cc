// The pool file; see pool.h.
#include "daemon/cache/pool.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <unordered_map>

#include "common/block_checksum.h"
#include "common/log.h"
#include "common/mapped_region.h"
#include "common/uds.h"
#include "common/units.h"
#include "common/unique_fd.h"

namespace flexkv {
namespace {

constexpr char kPoolMagic[8] = {'F', 'L', 'E', 'X', 'K', 'V', 'P', 'L'};
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kDataAlign = 2ULL << 20;
constexpr uint32_t kSlotCommitted = 0x434F4D54;  // "TMOC"

struct PoolHeader {
  char magic[8];
  uint32_t version;
  uint32_t geometry[7];  // tokens_per_block, num_layers, kv_planes, kv_heads_per_rank, head_dim, dtype_bytes, tp_size
  uint64_t block_bytes;
  uint64_t capacity;
  uint64_t table_offset;
  uint64_t data_offset;
  uint64_t file_bytes;
  char model_namespace[257];
  char pad[3];
  uint32_t creator_uid;  // the uid whose Attach created the namespace (version 2)
  uint64_t checksum;  // XXH64 of everything above
};
static_assert(offsetof(PoolHeader, checksum) == 344, "the header's fields keep their offsets");

uint64_t HeaderChecksum(const PoolHeader& h) { return XXH64(&h, offsetof(PoolHeader, checksum), 0); }

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

struct Pool::SlotEntry {
  std::atomic<uint32_t> state;  // kSlotCommitted or 0
  uint32_t reserved;
  BlockKey key;
  BlockKey parent;
  uint64_t checksum;            // EntryChecksum: XXH64 of the slot index, key, parent and content checksum
  uint64_t content_checksum;    // BlockChecksum of the slot's bytes
  uint64_t pad;
};
static_assert(sizeof(BlockKey) == 16);

Pool::SlotEntry* Pool::entry(SlotId slot) const {
  return reinterpret_cast<SlotEntry*>(table_ + uint64_t{slot} * 64);
}

namespace {

// The slot index is part of it, so an entry copied or swapped into another slot fails.
uint64_t EntryChecksum(SlotId slot, const BlockKey& key, const BlockKey& parent, uint64_t content_checksum) {
  const uint64_t words[6] = {slot, key.lo, key.hi, parent.lo, parent.hi, content_checksum};
  return XXH64(words, sizeof(words), 0x666C65786B76ULL);
}

}  // namespace

Result<std::unique_ptr<Pool>> Pool::Create(const std::string& path, const std::string& model_namespace,
                                           const Geometry& geometry, uint64_t budget_bytes, uid_t creator_uid) {
  static_assert(sizeof(SlotEntry) == 64);
  static_assert(sizeof(PoolHeader) <= kHeaderBytes);
  const uint64_t block_bytes = geometry.host_block_bytes();
  const uint64_t capacity = budget_bytes / block_bytes;
  if (capacity == 0 || capacity > UINT32_MAX - 1) {
    return Status::InvalidArgument(fmt::format("pool of {} holds {} blocks of {}; expected 1..{}",
                                               FormatByteSize(budget_bytes), capacity, FormatByteSize(block_bytes),
                                               UINT32_MAX - 1));
  }
  const uint64_t table_offset = kHeaderBytes;
  const uint64_t data_offset = AlignUp(table_offset + capacity * 64, kDataAlign);
  const uint64_t file_bytes = data_offset + capacity * block_bytes;

  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty() && !std::filesystem::exists(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || chmod(dir.c_str(), 0700) != 0) {
      return Status::FailedPrecondition(fmt::format("cannot create pool directory {}: {}", dir.string(), ec.message()));
    }
  }
  const std::string tmp = path + ".new";
  UniqueFd fd(open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) return Status::FailedPrecondition(fmt::format("cannot create pool file {}: {}", tmp, ErrnoText(errno)));
  const int rc = posix_fallocate(fd.get(), 0, static_cast<off_t>(file_bytes));
  if (rc != 0) {
    ::unlink(tmp.c_str());
    return Status::ResourceExhausted(fmt::format(
        "cannot allocate the {} pool file {}: {}; free space in {} (df -h) or lower --pool-size",
        FormatByteSize(file_bytes), path, ErrnoText(rc), dir.string()));
  }
  auto map = MappedRegion::Shared(path, fd.get(), file_bytes);
  if (!map.ok()) {
    ::unlink(tmp.c_str());
    return map.status();
  }
  auto pool = std::unique_ptr<Pool>(new Pool());
  pool->path_ = path;
  pool->namespace_ = model_namespace;
  pool->creator_uid_ = creator_uid;
  pool->geometry_ = geometry;
  pool->block_bytes_ = block_bytes;
  pool->capacity_ = static_cast<uint32_t>(capacity);
  pool->map_ = std::move(*map);
  pool->table_ = pool->map_.bytes() + table_offset;
  pool->data_ = pool->map_.bytes() + data_offset;
  pool->watch_ = std::make_unique<PoolFileWatch>(path, fd.get(), pool->map_.bytes(), pool->map_.size());

  PoolHeader h{};
  std::memcpy(h.magic, kPoolMagic, sizeof(h.magic));
  h.version = kPoolLayoutVersion;
  const uint32_t g[7] = {geometry.tokens_per_block, geometry.num_layers,  geometry.kv_planes, geometry.kv_heads_per_rank,
                         geometry.head_dim,         geometry.dtype_bytes, geometry.tp_size};
  std::memcpy(h.geometry, g, sizeof(g));
  h.block_bytes = block_bytes;
  h.capacity = capacity;
  h.table_offset = table_offset;
  h.data_offset = data_offset;
  h.file_bytes = file_bytes;
  std::snprintf(h.model_namespace, sizeof(h.model_namespace), "%s", model_namespace.c_str());
  h.creator_uid = creator_uid;
  h.checksum = HeaderChecksum(h);
  std::memcpy(pool->map_.data(), &h, sizeof(h));
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::FailedPrecondition(fmt::format("rename {} -> {}: {}", tmp, path, ErrnoText(errno)));
  }
  log::Info("pool", "created {}: {} slots of {} ({} in all), namespace '{}' created by uid {}", path, capacity,
            FormatByteSize(block_bytes), FormatByteSize(file_bytes), model_namespace, creator_uid);
  return pool;
}

std::optional<uint32_t> Pool::FileLayoutVersion(const std::string& path) {
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  PoolHeader h{};
  if (!fd || pread(fd.get(), &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h)) ||
      std::memcmp(h.magic, kPoolMagic, sizeof(h.magic)) != 0) {
    return std::nullopt;
  }
  return h.version;
}

Result<std::unique_ptr<Pool>> Pool::Open(const std::string& path, uint64_t budget_bytes) {
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return Status::NotFound(fmt::format("no pool file at {}", path));
    return Status::FailedPrecondition(fmt::format("cannot open pool file {}: {}", path, ErrnoText(errno)));
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Status::Internal(fmt::format("fstat {}: {}", path, ErrnoText(errno)));
  PoolHeader h{};
  if (static_cast<uint64_t>(st.st_size) < kHeaderBytes || pread(fd.get(), &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h))) {
    return Status::DataLoss(fmt::format("pool file {} is {} bytes: too short for a header", path, st.st_size));
  }
  const std::string fix = "; start with --discard-pool to replace it (its blocks are lost)";
  if (std::memcmp(h.magic, kPoolMagic, sizeof(h.magic)) != 0) {
    return Status::DataLoss(fmt::format("{} is not a flexkvd pool file (bad magic){}", path, fix));
  }
  if (h.version != kPoolLayoutVersion) {
    return Status::FailedPrecondition(fmt::format("pool file {} has layout version {}; this flexkvd reads version {}{}",
                                                  path, h.version, kPoolLayoutVersion, fix));
  }
  if (h.checksum != HeaderChecksum(h)) return Status::DataLoss(fmt::format("pool file {} has a corrupt header{}", path, fix));
  h.model_namespace[sizeof(h.model_namespace) - 1] = '\0';
  Geometry g{h.geometry[0], h.geometry[1], h.geometry[2], h.geometry[3], h.geometry[4], h.geometry[5], h.geometry[6]};
  Status valid = g.Validate();
  if (!valid.ok() || g.host_block_bytes() != h.block_bytes || h.capacity == 0 || h.capacity > UINT32_MAX - 1 ||
      h.table_offset != kHeaderBytes || h.data_offset < h.table_offset + h.capacity * 64 ||
      h.file_bytes != h.data_offset + h.capacity * h.block_bytes) {
    return Status::DataLoss(fmt::format("pool file {} has an inconsistent header ({}){}", path,
                                        valid.ok() ? "sizes do not add up" : valid.message(), fix));
  }
  if (static_cast<uint64_t>(st.st_size) < h.file_bytes) {
    return Status::DataLoss(fmt::format(
        "pool file {} is {} bytes but its header says {}: it was truncated and its blocks are lost{}", path,
        st.st_size, h.file_bytes, fix));
  }
  const uint64_t budget_capacity = budget_bytes / h.block_bytes;
  if (budget_capacity != h.capacity) {
    return Status::FailedPrecondition(fmt::format(
        "pool file {} holds {} slots ({}) but --pool-size {} gives {} slots; start with --pool-size {} to keep the "
        "cache{}",
        path, h.capacity, FormatByteSize(h.capacity * h.block_bytes), FormatByteSize(budget_bytes), budget_capacity,
        FormatByteSize(h.capacity * h.block_bytes), fix));
  }
  auto map = MappedRegion::Shared(path, fd.get(), h.file_bytes);
  if (!map.ok()) return map.status();
  auto pool = std::unique_ptr<Pool>(new Pool());
  pool->path_ = path;
  pool->namespace_ = h.model_namespace;
  pool->creator_uid_ = h.creator_uid;
  pool->geometry_ = g;
  pool->block_bytes_ = h.block_bytes;
  pool->capacity_ = static_cast<uint32_t>(h.capacity);
  pool->map_ = std::move(*map);
  pool->table_ = pool->map_.bytes() + h.table_offset;
  pool->data_ = pool->map_.bytes() + h.data_offset;
  pool->watch_ = std::make_unique<PoolFileWatch>(path, fd.get(), pool->map_.bytes(), pool->map_.size());
  return pool;
}

Pool::~Pool() = default;

void Pool::MarkCommitted(SlotId slot, const BlockKey& key, const BlockKey& parent, uint64_t content_checksum) {
  SlotEntry* e = entry(slot);
  e->key = key;
  e->parent = parent;
  e->content_checksum = content_checksum;
  e->checksum = EntryChecksum(slot, key, parent, content_checksum);
  // Bytes first, then the entry's fields, then the state: a crash at any point leaves the slot either
  // absent or complete.
  e->state.store(kSlotCommitted, std::memory_order_release);
}

void Pool::MarkFree(SlotId slot) { entry(slot)->state.store(0, std::memory_order_release); }

std::optional<Pool::Committed> Pool::Entry(SlotId slot) const {
  const SlotEntry* e = entry(slot);
  if (e->state.load(std::memory_order_acquire) != kSlotCommitted ||
      e->checksum != EntryChecksum(slot, e->key, e->parent, e->content_checksum)) {
    return std::nullopt;
  }
  return Committed{slot, e->key, e->parent, e->content_checksum};
}

bool Pool::ContentMatches(SlotId slot, uint64_t content_checksum) const {
  return BlockChecksum(SlotData(slot), block_bytes_) == content_checksum;
}

std::vector<Pool::Committed> Pool::Recover(uint64_t* dropped, uint64_t* corrupt) {
  *dropped = 0;
  uint64_t bad_entries = 0;
  // Pass 1: valid committed entries, by key (reserved once: no rehashing at 10 M blocks).
  size_t committed = 0;
  for (SlotId s = 0; s < capacity_; ++s) committed += entry(s)->state.load(std::memory_order_acquire) != 0 ? 1 : 0;
  std::unordered_map<BlockKey, SlotId, BlockKeyHash> by_key;
  by_key.reserve(committed);
  for (SlotId s = 0; s < capacity_; ++s) {
    SlotEntry* e = entry(s);
    const uint32_t state = e->state.load(std::memory_order_acquire);
    if (state == 0) continue;
    const bool intact =
        state == kSlotCommitted && e->checksum == EntryChecksum(s, e->key, e->parent, e->content_checksum);
    if (!intact || e->key == BlockKey{} || !by_key.emplace(e->key, s).second) {
      e->state.store(0, std::memory_order_relaxed);
      ++*dropped;
      if (!intact) ++bad_entries;
    }
  }
  // Pass 2: order parents before children; drop chains whose first block is missing. verdict per slot:
  // 0 = not yet decided, 1 = placed, -1 = orphan.
  std::vector<int8_t> verdict(capacity_, 0);
  std::vector<Committed> out;
  out.reserve(by_key.size());
  std::vector<SlotId> chain;
  for (const auto& [key, slot] : by_key) {
    if (verdict[slot] != 0) continue;
    chain.clear();
    SlotId cur = slot;
    int8_t result = 0;
    for (;;) {
      if (verdict[cur] != 0) {
        result = verdict[cur];
        break;
      }
      chain.push_back(cur);
      const BlockKey parent = entry(cur)->parent;
      if (parent == BlockKey{}) {
        result = 1;
        break;
      }
      auto it = by_key.find(parent);
      if (it == by_key.end() || chain.size() > by_key.size()) {
        result = -1;
        break;
      }
      cur = it->second;
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      verdict[*it] = result;
      if (result == 1) {
        const SlotEntry* e = entry(*it);
        out.push_back(Committed{*it, e->key, e->parent, e->content_checksum});
      } else {
        MarkFree(*it);
        ++*dropped;
      }
    }
  }
  if (corrupt != nullptr) *corrupt = bad_entries;
  return out;
}

}  // namespace flexkv

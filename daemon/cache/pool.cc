// The pool file; see pool.h. Longer than 800 lines: the layout, the header and active-capacity records, creation,
// opening, SetActive and recovery all read the same file-format definitions, kept private to this file on purpose
// (the format is written down once here and in docs/protocol.md).
#include "daemon/cache/pool.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/falloc.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <unordered_map>

#include "common/block_checksum.h"
#include "common/invariant.h"
#include "common/log.h"
#include "common/mapped_region.h"
#include "common/slot_order.h"
#include "common/uds.h"
#include "common/unique_fd.h"
#include "common/units.h"

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

// Layout 3 (hybrid geometries): the sub-pools, at kComponentTableOffset inside the header page.
constexpr uint64_t kComponentTableOffset = 512;
struct ComponentRecord {
  uint32_t kind;
  uint32_t num_layers;
  uint32_t kv_planes;
  uint32_t kv_heads_per_rank;
  uint32_t head_dim;
  uint32_t dtype_bytes;
  uint32_t window_tokens;
  uint32_t pad;
  uint64_t state_bytes_per_layer;
  uint64_t slot_bytes;
  uint64_t capacity;
  uint64_t base_slot;
  uint64_t data_offset;
};
struct ComponentTable {
  uint32_t count;  // components, component 0 (FULL) included
  uint32_t pad;
  ComponentRecord records[Geometry::kMaxComponents];
  uint64_t checksum;  // XXH64 of everything above
};
static_assert(kComponentTableOffset + sizeof(ComponentTable) <= 4096);
uint64_t TableChecksum(const ComponentTable& t) { return XXH64(&t, offsetof(ComponentTable, checksum), 1); }

// Every layout: each sub-pool's active capacity, in the header page between the header (ends at 352) and the
// sub-pool table (512), where readers from before elastic pools do not look. All zero (a file written before it):
// every sub-pool is fully active.
constexpr uint64_t kActiveRecordOffset = 384;
constexpr char kActiveMagic[8] = {'F', 'L', 'E', 'X', 'K', 'V', 'A', 'C'};
constexpr uint32_t kActiveRecordVersion = 1;
struct ActiveRecord {
  char magic[8];
  uint32_t version;  // kActiveRecordVersion
  uint32_t count;    // components, as the layout has them
  uint32_t active[Geometry::kMaxComponents];  // per component, in slots
  uint64_t checksum;  // XXH64 (seed 2) of everything above
};
static_assert(sizeof(PoolHeader) <= kActiveRecordOffset);
static_assert(kActiveRecordOffset + sizeof(ActiveRecord) <= kComponentTableOffset);
uint64_t ActiveChecksum(const ActiveRecord& r) { return XXH64(&r, offsetof(ActiveRecord, checksum), 2); }

#define POOL_CHECK(cond, what) FLEXKV_INVARIANT(cond, "Pool", what)

uint32_t GrantOf(uint64_t capacity, uint32_t grants_per_sub_pool) {
  return static_cast<uint32_t>((capacity + grants_per_sub_pool - 1) / grants_per_sub_pool);
}

// `slots` of a sub-pool of `capacity` slots in grants of `grant`: rounded up to a whole number, clamped.
uint32_t RoundUpToGrants(uint64_t slots, uint32_t grant, uint32_t capacity) {
  const uint64_t rounded = (std::max<uint64_t>(slots, 1) + grant - 1) / grant * grant;
  return static_cast<uint32_t>(std::min<uint64_t>(rounded, capacity));
}

// Active slots per component for `active_bytes` of data, `capacity` and `slot_bytes` per component, split in
// proportion to `weights` (bytes per component; the capacities' bytes: the layout's own split).
std::vector<uint32_t> ScaledActive(const std::vector<uint64_t>& capacity, const std::vector<uint64_t>& slot_bytes,
                                   const std::vector<uint64_t>& weights, uint64_t active_bytes,
                                   uint32_t grants_per_sub_pool) {
  long double total = 0;
  for (size_t c = 0; c < capacity.size(); ++c) total += static_cast<long double>(weights[c]);
  std::vector<uint32_t> active;
  for (size_t c = 0; c < capacity.size(); ++c) {
    // Rounded down, so that the pool's data stays within `active_bytes` (a budget share) unless one grant of
    // each component is already more.
    // (Slots, then the share: with one component the share is exactly 1 and an exact quotient stays exact.)
    const long double share = static_cast<long double>(weights[c]) / total;
    const long double slots =
        std::min<long double>(static_cast<long double>(active_bytes) / static_cast<long double>(slot_bytes[c]) * share,
                              static_cast<long double>(capacity[c]));
    const auto want = static_cast<uint64_t>(std::floor(slots));
    const uint32_t grant = GrantOf(capacity[c], grants_per_sub_pool);
    const uint64_t whole = want >= capacity[c] ? capacity[c] : want / grant * grant;
    active.push_back(static_cast<uint32_t>(std::max<uint64_t>(whole, std::min<uint64_t>(grant, capacity[c]))));
  }
  if (grants_per_sub_pool == kDemandGrantsPerSubPool) {
    // Layout 4's grants are a 64th of the whole budget, coarse next to a small share (gpt-oss's default window is 3 %
    // of it): what rounding down left of `active_bytes` goes, a grant at a time, to the components it shortened most.
    uint64_t used = 0;
    for (size_t c = 0; c < capacity.size(); ++c) used += uint64_t{active[c]} * slot_bytes[c];
    for (bool added = true; added;) {
      added = false;
      std::optional<size_t> best;
      long double best_short = 0;
      for (size_t c = 0; c < capacity.size(); ++c) {
        const uint32_t grant = GrantOf(capacity[c], grants_per_sub_pool);
        const uint64_t more = std::min<uint64_t>(grant, capacity[c] - active[c]);
        if (more == 0 || used + more * slot_bytes[c] > active_bytes) continue;
        const long double want = static_cast<long double>(active_bytes) / static_cast<long double>(slot_bytes[c]) *
                                 static_cast<long double>(weights[c]) / total;
        const long double shortfall = (want - active[c]) / static_cast<long double>(grant);
        if (shortfall > 0.5L && (!best || shortfall > best_short)) {
          best = c;
          best_short = shortfall;
        }
      }
      if (best) {
        const uint32_t more = std::min<uint32_t>(GrantOf(capacity[*best], grants_per_sub_pool),
                                                 static_cast<uint32_t>(capacity[*best] - active[*best]));
        active[*best] += more;
        used += uint64_t{more} * slot_bytes[*best];
        added = true;
      }
    }
  }
  // A component whose share is under one grant still gets one: the others then give back whole grants, the largest
  // part first, so that the data stays within `active_bytes` (a pool above its budget is refused when it is
  // re-attached after a restart). Each keeps at least one grant; where one grant of each is more, that is the pool.
  uint64_t used = 0;
  for (size_t c = 0; c < capacity.size(); ++c) used += uint64_t{active[c]} * slot_bytes[c];
  while (used > active_bytes) {
    std::optional<size_t> largest;
    for (size_t c = 0; c < capacity.size(); ++c) {
      const uint32_t grant = GrantOf(capacity[c], grants_per_sub_pool);
      if (active[c] <= grant) continue;
      if (!largest || uint64_t{active[c]} * slot_bytes[c] > uint64_t{active[*largest]} * slot_bytes[*largest]) largest = c;
    }
    if (!largest) break;
    const uint32_t grant = GrantOf(capacity[*largest], grants_per_sub_pool);
    // A whole number of grants below (the capacity, when active is all of it, need not be one).
    const uint32_t lower = active[*largest] % grant != 0 ? active[*largest] / grant * grant : active[*largest] - grant;
    used -= uint64_t{active[*largest] - lower} * slot_bytes[*largest];
    active[*largest] = lower;
  }
  return active;
}

// What `path`'s filesystem is, for messages: its directory and type.
std::string FilesystemOf(const std::string& path, int fd) {
  struct statfs fs {};
  std::string type = "unknown filesystem";
  if (fstatfs(fd, &fs) == 0) {
    switch (static_cast<uint64_t>(fs.f_type)) {
      case TMPFS_MAGIC: type = "tmpfs"; break;
      case HUGETLBFS_MAGIC: type = "hugetlbfs"; break;
      default: type = fmt::format("filesystem type {:#x}", static_cast<uint64_t>(fs.f_type)); break;
    }
    type += fmt::format(", {} free", FormatByteSize(uint64_t{fs.f_bavail} * static_cast<uint64_t>(fs.f_bsize)));
  }
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  return fmt::format("{} ({})", dir.empty() ? "." : dir.string(), type);
}

// Where each part of a pool file goes, from the geometry and the slots of each component.
struct FileLayout {
  std::vector<uint64_t> base, data_offset;
  uint64_t slots = 0, table_offset = kHeaderBytes, data_end = 0;
};

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

FileLayout LayOut(const Geometry& g, const std::vector<uint64_t>& capacity) {
  FileLayout l;
  for (uint64_t c : capacity) {
    l.base.push_back(l.slots);
    l.slots += c;
  }
  uint64_t at = AlignUp(l.table_offset + l.slots * 64, kDataAlign);
  for (size_t c = 0; c < capacity.size(); ++c) {
    at = AlignUp(at, kDataAlign);
    l.data_offset.push_back(at);
    at += capacity[c] * g.Component(c).host_block_bytes();
  }
  l.data_end = at;
  return l;
}

// The default budget split: what each component holds per 4096 tokens of cached prefix when engines store a window
// and a state at chunk boundaries that far apart (chunked prefill), in slots. Measured on the shared trace
// (docs/performance.md, "Trace replay of hybrid geometries"): within 10 % of the split by actual demand there.
double DefaultDemand(const Geometry& g, size_t c) {
  constexpr double kChunkTokens = 4096;
  const double full_blocks = std::ceil(kChunkTokens / g.tokens_per_block);
  switch (g.component_kind(c)) {
    case ComponentKind::kFull:
      return full_blocks;
    case ComponentKind::kSlidingWindow:
      return std::min<double>(g.window_blocks(c), full_blocks);
    case ComponentKind::kState:
      return 1;
  }
  return 0;
}

}  // namespace

Result<std::vector<uint64_t>> SplitBudget(const Geometry& g, uint64_t budget_bytes, const PoolSplit& split) {
  const size_t n = g.component_count();
  if (n == 1) return std::vector<uint64_t>{budget_bytes / g.host_block_bytes()};
  for (const auto& [name, share] : {std::pair{"--swa-share", split.swa_share}, std::pair{"--state-share", split.state_share}}) {
    if (!(share >= 0 && share < 1)) {
      return Status::InvalidArgument(fmt::format("{} is {}; expected a fraction of the pool in [0, 1) (0: automatic)", name, share));
    }
  }
  // Bytes each component would want for one cached prefix end; a kind whose share the operator set splits that
  // share among its components by the same weights.
  std::vector<double> want(n), share(n);
  double kind_total[4] = {0, 0, 0, 0};
  for (size_t c = 0; c < n; ++c) {
    want[c] = DefaultDemand(g, c) * static_cast<double>(g.Component(c).host_block_bytes());
    kind_total[static_cast<uint32_t>(g.component_kind(c))] += want[c];
  }
  const double set_swa = split.swa_share, set_state = split.state_share;
  double fixed = 0, free_want = 0;
  for (size_t c = 0; c < n; ++c) {
    const ComponentKind k = g.component_kind(c);
    const double set = k == ComponentKind::kSlidingWindow ? set_swa : k == ComponentKind::kState ? set_state : 0;
    if (set > 0) {
      share[c] = set * want[c] / kind_total[static_cast<uint32_t>(k)];
      fixed += share[c];
    } else {
      share[c] = -1;
      free_want += want[c];
    }
  }
  if (fixed >= 1) {
    return Status::InvalidArgument(fmt::format(
        "--swa-share {} and --state-share {} leave nothing for the full-attention layers; expected a sum below 1",
        set_swa, set_state));
  }
  std::vector<uint64_t> capacity(n);
  for (size_t c = 0; c < n; ++c) {
    if (share[c] < 0) share[c] = (1 - fixed) * want[c] / free_want;
    const uint64_t slot = g.Component(c).host_block_bytes();
    capacity[c] = static_cast<uint64_t>(share[c] * static_cast<double>(budget_bytes)) / slot;
    if (capacity[c] == 0) {
      return Status::InvalidArgument(fmt::format(
          "the pool budget {} gives component {} ({}) a share of {:.1f}% ({}), less than one slot of {}; expected a "
          "larger --pool-size or another split (--swa-share, --state-share)",
          FormatByteSize(budget_bytes), c, ComponentKindName(g.component_kind(c)), share[c] * 100,
          FormatByteSize(static_cast<uint64_t>(share[c] * static_cast<double>(budget_bytes))), FormatByteSize(slot)));
    }
  }
  return capacity;
}

Result<PoolLayoutPlan> PlanPoolLayout(const Geometry& g, uint64_t budget_bytes, const PoolSplit& split) {
  auto fixed = SplitBudget(g, budget_bytes, split);
  if (!fixed.ok()) return fixed.status();
  PoolLayoutPlan plan;
  const bool by_demand = g.is_hybrid() && split.demand_sized();
  plan.version = by_demand ? kDemandPoolLayoutVersion : g.is_hybrid() ? kHybridPoolLayoutVersion : kPoolLayoutVersion;
  const uint32_t per = by_demand ? kDemandGrantsPerSubPool : kGrantsPerSubPool;
  for (size_t c = 0; c < fixed->size(); ++c) {
    const uint64_t slot = g.Component(c).host_block_bytes();
    plan.capacity.push_back(by_demand ? budget_bytes / slot : (*fixed)[c]);
    plan.grant.push_back(GrantOf(plan.capacity.back(), per));
    plan.weights.push_back((*fixed)[c] * slot);
  }
  return plan;
}

struct Pool::SlotEntry {
  std::atomic<uint32_t> state;  // kSlotCommitted or 0
  uint32_t order;               // kRankMajorEntry in a pool of sharded slots; 0: layer-major (older releases)
  BlockKey key;
  BlockKey parent;
  uint64_t checksum;            // EntryChecksum: XXH64 of the slot index, key, parent, content checksum and order
  uint64_t content_checksum;    // BlockChecksum of the slot's bytes
  uint64_t pad;
};
static_assert(sizeof(BlockKey) == 16);

Pool::SlotEntry* Pool::entry(SlotId slot) const {
  return reinterpret_cast<SlotEntry*>(table_ + uint64_t{slot} * 64);
}

namespace {

// An entry's `order` in a pool whose slots have more than one TP shard: the bytes are in today's rank-major order.
constexpr uint32_t kRankMajorEntry = 1;

// The slot index is part of it, so an entry copied or swapped into another slot fails; so is a nonzero `order`, so
// an entry whose order changed fails too (its bytes would be read in the wrong order). Entries of order 0 keep the
// checksum older releases wrote.
uint64_t EntryChecksum(SlotId slot, const BlockKey& key, const BlockKey& parent, uint64_t content_checksum,
                       uint32_t order) {
  if (order != 0) {
    const uint64_t words[7] = {slot, key.lo, key.hi, parent.lo, parent.hi, content_checksum, order};
    return XXH64(words, sizeof(words), 0x666C65786B76ULL);
  }
  const uint64_t words[6] = {slot, key.lo, key.hi, parent.lo, parent.hi, content_checksum};
  return XXH64(words, sizeof(words), 0x666C65786B76ULL);
}

}  // namespace

bool Pool::EntryIntact(SlotId slot, const SlotEntry& e) const {
  if (e.order != 0 && (e.order != kRankMajorEntry || !sharded_slots_)) return false;
  return e.checksum == EntryChecksum(slot, e.key, e.parent, e.content_checksum, e.order);
}

Result<std::unique_ptr<Pool>> Pool::Create(const std::string& path, const std::string& model_namespace,
                                           const Geometry& geometry, uint64_t budget_bytes, uid_t creator_uid,
                                           const PoolSplit& split, uint64_t active_bytes) {
  static_assert(sizeof(SlotEntry) == 64);
  static_assert(sizeof(PoolHeader) <= kComponentTableOffset);
  const uint64_t block_bytes = geometry.host_block_bytes();
  auto plan = PlanPoolLayout(geometry, budget_bytes, split);
  if (!plan.ok()) return plan.status();
  const std::vector<uint64_t>* capacities = &plan->capacity;
  const uint32_t grants_per = plan->version == kDemandPoolLayoutVersion ? kDemandGrantsPerSubPool : kGrantsPerSubPool;
  const FileLayout layout = LayOut(geometry, *capacities);
  const uint64_t capacity = layout.slots;
  if ((*capacities)[0] == 0 || capacity > UINT32_MAX - 1) {
    return Status::InvalidArgument(fmt::format("pool of {} holds {} blocks of {}; expected 1..{}",
                                               FormatByteSize(budget_bytes), capacity, FormatByteSize(block_bytes),
                                               UINT32_MAX - 1));
  }
  const uint64_t table_offset = layout.table_offset;
  const uint64_t data_offset = layout.data_offset[0];
  const uint64_t file_bytes = layout.data_end;

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
  // The file is sized for the whole layout; only the header, the slot table and the active slots' data get space
  // (the rest is a hole until SetActive grows into it).
  std::vector<uint64_t> slot_bytes;
  for (size_t c = 0; c < capacities->size(); ++c) slot_bytes.push_back(geometry.Component(c).host_block_bytes());
  const std::vector<uint32_t> active =
      ScaledActive(*capacities, slot_bytes, plan->weights, std::min(active_bytes, budget_bytes), grants_per);
  struct statfs fs {};
  const uint64_t page_bytes = fstatfs(fd.get(), &fs) == 0 && fs.f_bsize > 0 ? static_cast<uint64_t>(fs.f_bsize) : 4096;
  // hugetlbfs sizes files in whole huge pages.
  const bool hugetlbfs = static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC;
  uint64_t allocated = data_offset;
  const uint64_t file_size = hugetlbfs ? AlignUp(file_bytes, page_bytes) : file_bytes;
  int rc = ftruncate(fd.get(), static_cast<off_t>(file_size)) == 0 ? 0 : errno;
  if (rc == 0) rc = posix_fallocate(fd.get(), 0, static_cast<off_t>(data_offset));
  for (size_t c = 0; rc == 0 && c < active.size(); ++c) {
    const uint64_t bytes = uint64_t{active[c]} * slot_bytes[c];
    rc = posix_fallocate(fd.get(), static_cast<off_t>(layout.data_offset[c]), static_cast<off_t>(bytes));
    allocated += bytes;
  }
  if (rc != 0) {
    ::unlink(tmp.c_str());
    return Status::ResourceExhausted(fmt::format(
        "cannot allocate the {} pool file {} ({} of it active): {}; free space in {} (df -h) or lower --pool-size",
        FormatByteSize(file_bytes), path, FormatByteSize(allocated), ErrnoText(rc), FilesystemOf(tmp, fd.get())));
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
  pool->SetSubPools(layout.base, *capacities, layout.data_offset, layout.data_end, grants_per);
  pool->demand_sized_ = plan->version == kDemandPoolLayoutVersion;
  pool->sharded_slots_ = HasShardedSlots(geometry);
  pool->default_weights_ = plan->weights;
  for (size_t c = 0; c < active.size(); ++c) pool->sub_pools_[c].active = active[c];
  pool->page_bytes_ = page_bytes;
  pool->fd_ = std::move(fd);
  if (Status recorded = pool->WriteActiveRecord(0, active[0]); !recorded.ok()) {
    ::unlink(tmp.c_str());
    return recorded;
  }

  PoolHeader h{};
  std::memcpy(h.magic, kPoolMagic, sizeof(h.magic));
  h.version = plan->version | (pool->sharded_slots_ ? kRankMajorSlotsFlag : 0);
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
  if (geometry.is_hybrid()) {
    ComponentTable t{};
    t.count = static_cast<uint32_t>(geometry.component_count());
    for (size_t c = 0; c < geometry.component_count(); ++c) {
      ComponentRecord& r = t.records[c];
      r.kind = static_cast<uint32_t>(geometry.component_kind(c));
      if (c > 0) {
        const ComponentSpec& spec = geometry.components[c - 1];
        r.num_layers = spec.num_layers;
        r.kv_planes = spec.kv_planes;
        r.kv_heads_per_rank = spec.kv_heads_per_rank;
        r.head_dim = spec.head_dim;
        r.dtype_bytes = spec.dtype_bytes;
        r.window_tokens = spec.window_tokens;
        r.state_bytes_per_layer = spec.state_bytes_per_layer;
      }
      r.slot_bytes = geometry.Component(c).host_block_bytes();
      r.capacity = (*capacities)[c];
      r.base_slot = layout.base[c];
      r.data_offset = layout.data_offset[c];
    }
    t.checksum = TableChecksum(t);
    std::memcpy(pool->map_.bytes() + kComponentTableOffset, &t, sizeof(t));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::FailedPrecondition(fmt::format("rename {} -> {}: {}", tmp, path, ErrnoText(errno)));
  }
  log::Info("pool", "created {}: {} slots of {} ({} active; {} in all, {} active), namespace '{}' created by uid {}{}",
            path, (*capacities)[0], FormatByteSize(block_bytes), active[0], FormatByteSize(file_bytes),
            FormatByteSize(pool->active_bytes()), model_namespace, creator_uid,
            pool->demand_sized_ ? "; the sub-pools' split follows demand (each laid out for the whole budget)" : "");
  for (size_t c = 1; c < geometry.component_count(); ++c) {
    log::Info("pool", "  component {} ({}): {} slots of {} ({} active)", c,
              ComponentKindName(geometry.component_kind(c)), (*capacities)[c],
              FormatByteSize(geometry.Component(c).host_block_bytes()), active[c]);
  }
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

Result<std::unique_ptr<Pool>> Pool::Open(const std::string& path, uint64_t budget_bytes, const PoolSplit& split) {
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return Status::NotFound(fmt::format("no pool file at {}", path));
    return Status::FailedPrecondition(fmt::format("cannot open pool file {}: {}", path, ErrnoText(errno)));
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Status::Internal(fmt::format("fstat {}: {}", path, ErrnoText(errno)));
  PoolHeader h{};
  ComponentTable t{};
  ActiveRecord active_record{};
  if (static_cast<uint64_t>(st.st_size) < kHeaderBytes || pread(fd.get(), &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h)) ||
      pread(fd.get(), &t, sizeof(t), kComponentTableOffset) != static_cast<ssize_t>(sizeof(t)) ||
      pread(fd.get(), &active_record, sizeof(active_record), kActiveRecordOffset) !=
          static_cast<ssize_t>(sizeof(active_record))) {
    return Status::DataLoss(fmt::format("pool file {} is {} bytes: too short for a header", path, st.st_size));
  }
  const std::string fix = "; start with --discard-pool to replace it (its blocks are lost)";
  if (std::memcmp(h.magic, kPoolMagic, sizeof(h.magic)) != 0) {
    return Status::DataLoss(fmt::format("{} is not a flexkvd pool file (bad magic){}", path, fix));
  }
  const uint32_t base_version = h.version & ~kRankMajorSlotsFlag;
  const bool rank_major_flag = (h.version & kRankMajorSlotsFlag) != 0;
  if (base_version != kPoolLayoutVersion && base_version != kHybridPoolLayoutVersion &&
      base_version != kDemandPoolLayoutVersion) {
    // Left untouched: the release that wrote it can still serve it (docs/operations.md, "Upgrades").
    const bool newer = base_version > kDemandPoolLayoutVersion;
    return Status::FailedPrecondition(fmt::format(
        "pool file {} has layout version {}, written by {} flexkvd; this flexkvd reads layout versions {}, {} and {} "
        "(plus {:#x} where slots hold several TP shards). To keep its blocks, run the flexkvd release that wrote it{}; "
        "to start with an empty cache, start with --discard-pool (its blocks are lost)",
        path, h.version, newer ? "a newer" : "an older", kPoolLayoutVersion, kHybridPoolLayoutVersion,
        kDemandPoolLayoutVersion, kRankMajorSlotsFlag, newer ? " (or a later one)" : ""));
  }
  if (h.checksum != HeaderChecksum(h)) return Status::DataLoss(fmt::format("pool file {} has a corrupt header{}", path, fix));
  const bool by_demand = base_version == kDemandPoolLayoutVersion;
  const bool hybrid = base_version == kHybridPoolLayoutVersion || by_demand;
  const uint32_t grants_per = by_demand ? kDemandGrantsPerSubPool : kGrantsPerSubPool;
  if (hybrid && (t.checksum != TableChecksum(t) || t.count < 2 || t.count > Geometry::kMaxComponents)) {
    return Status::DataLoss(fmt::format("pool file {} has a corrupt sub-pool table{}", path, fix));
  }
  h.model_namespace[sizeof(h.model_namespace) - 1] = '\0';
  Geometry g;
  g.tokens_per_block = h.geometry[0];
  g.num_layers = h.geometry[1];
  g.kv_planes = h.geometry[2];
  g.kv_heads_per_rank = h.geometry[3];
  g.head_dim = h.geometry[4];
  g.dtype_bytes = h.geometry[5];
  g.tp_size = h.geometry[6];
  std::vector<uint64_t> capacities{h.capacity};
  if (hybrid) {
    capacities.clear();
    for (uint32_t c = 0; c < t.count; ++c) {
      const ComponentRecord& r = t.records[c];
      capacities.push_back(r.capacity);
      if (c == 0) continue;
      ComponentSpec spec;
      spec.kind = static_cast<ComponentKind>(r.kind);
      spec.num_layers = r.num_layers;
      spec.kv_planes = r.kv_planes;
      spec.kv_heads_per_rank = r.kv_heads_per_rank;
      spec.head_dim = r.head_dim;
      spec.dtype_bytes = r.dtype_bytes;
      spec.window_tokens = r.window_tokens;
      spec.state_bytes_per_layer = r.state_bytes_per_layer;
      g.components.push_back(spec);
    }
  }
  Status valid = g.Validate();
  // The sizes must add up exactly as Create lays them out (a header that does not is not ours to trust).
  // The flag is set exactly for slots of several shards by the releases that know it (older ones never set it).
  bool consistent = valid.ok() && g.host_block_bytes() == h.block_bytes && h.table_offset == kHeaderBytes &&
                    (!rank_major_flag || HasShardedSlots(g));
  FileLayout layout;
  if (consistent) {
    uint64_t total = 0;
    for (size_t c = 0; c < capacities.size(); ++c) {
      consistent = consistent && capacities[c] >= 1 && capacities[c] <= UINT32_MAX - 1;
      total += capacities[c];
    }
    consistent = consistent && total == h.capacity && total <= UINT32_MAX - 1;
  }
  if (consistent) {
    layout = LayOut(g, capacities);
    consistent = h.data_offset == layout.data_offset[0] && h.file_bytes == layout.data_end;
    for (size_t c = 0; hybrid && consistent && c < capacities.size(); ++c) {
      consistent = t.records[c].base_slot == layout.base[c] && t.records[c].data_offset == layout.data_offset[c] &&
                   t.records[c].slot_bytes == g.Component(c).host_block_bytes() &&
                   t.records[c].kind == static_cast<uint32_t>(g.component_kind(c));
    }
  }
  if (!consistent) {
    return Status::DataLoss(fmt::format("pool file {} has an inconsistent header ({}){}", path,
                                        valid.ok() ? "sizes do not add up" : valid.message(), fix));
  }
  if (static_cast<uint64_t>(st.st_size) < h.file_bytes) {
    return Status::DataLoss(fmt::format(
        "pool file {} is {} bytes but its header says {}: it was truncated and its blocks are lost{}", path,
        st.st_size, h.file_bytes, fix));
  }
  if (by_demand) {
    // Its split follows demand: it serves only while the operator sets no share, at the budget it was laid out for.
    auto plan = PlanPoolLayout(g, budget_bytes, PoolSplit{});
    if (!split.demand_sized()) {
      return Status::FailedPrecondition(fmt::format(
          "pool file {} has sub-pools sized by demand, but --swa-share {} / --state-share {} fix the split; start "
          "without them to keep the cache{}",
          path, split.swa_share, split.state_share, fix));
    }
    if (!plan.ok() || plan->capacity != capacities) {
      return Status::FailedPrecondition(fmt::format(
          "pool file {} holds {} slots in {} sub-pools sized by demand, laid out for another --pool-size than {}; "
          "start with the pool size it was created with to keep the cache{}",
          path, h.capacity, capacities.size(), FormatByteSize(budget_bytes), fix));
    }
  }
  auto expected = SplitBudget(g, budget_bytes, split);
  // With automatic shares, a hybrid pool keeps the split it was created with (the default rule may change between
  // releases) as long as it was made for this budget: its sub-pools leave less than one slot of each unused.
  bool same_budget = by_demand;
  if (!by_demand && hybrid && split.swa_share == 0 && split.state_share == 0) {
    uint64_t used = 0, one_of_each = 0;
    for (size_t c = 0; c < capacities.size(); ++c) {
      used += capacities[c] * g.Component(c).host_block_bytes();
      one_of_each += g.Component(c).host_block_bytes();
    }
    same_budget = used <= budget_bytes && budget_bytes - used < one_of_each;
  }
  if (!same_budget && (!expected.ok() || *expected != capacities)) {
    uint64_t expected_slots = 0;
    if (expected.ok()) {
      for (uint64_t c : *expected) expected_slots += c;
    }
    const std::string gives = expected.ok() ? fmt::format("{} slots", expected_slots) : expected.status().message();
    if (!hybrid) {
      return Status::FailedPrecondition(fmt::format(
          "pool file {} holds {} slots ({}) but --pool-size {} gives {}; start with --pool-size {} to keep the "
          "cache{}",
          path, h.capacity, FormatByteSize(h.capacity * h.block_bytes), FormatByteSize(budget_bytes), gives,
          FormatByteSize(h.capacity * h.block_bytes), fix));
    }
    return Status::FailedPrecondition(fmt::format(
        "pool file {} holds {} slots in {} sub-pools but --pool-size {} with --swa-share {} and --state-share {} "
        "gives {} (the sub-pools differ); start with the pool size and shares it was created with to keep the "
        "cache{}",
        path, h.capacity, capacities.size(), FormatByteSize(budget_bytes), split.swa_share, split.state_share, gives,
        fix));
  }
  // The active capacities: none recorded (all zero: a file from before elastic pools) is fully active.
  std::vector<uint32_t> active;
  static constexpr ActiveRecord kNoRecord{};
  if (std::memcmp(&active_record, &kNoRecord, sizeof(active_record)) == 0) {
    for (uint64_t c : capacities) active.push_back(static_cast<uint32_t>(c));
  } else {
    bool valid_record = std::memcmp(active_record.magic, kActiveMagic, sizeof(kActiveMagic)) == 0 &&
                        active_record.version == kActiveRecordVersion &&
                        active_record.checksum == ActiveChecksum(active_record) &&
                        active_record.count == capacities.size();
    for (size_t c = 0; valid_record && c < capacities.size(); ++c) {
      const uint32_t a = active_record.active[c];
      const uint32_t grant = GrantOf(capacities[c], grants_per);
      valid_record = a >= grant && a <= capacities[c] && (a % grant == 0 || a == capacities[c]);
      active.push_back(a);
    }
    if (!valid_record) {
      return Status::DataLoss(fmt::format("pool file {} has a corrupt active-capacity record{}", path, fix));
    }
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
  pool->SetSubPools(layout.base, capacities, layout.data_offset, layout.data_end, grants_per);
  pool->demand_sized_ = by_demand;
  pool->sharded_slots_ = HasShardedSlots(g);
  pool->layer_major_file_ = pool->sharded_slots_ && !rank_major_flag;
  for (size_t c = 0; c < capacities.size(); ++c) {
    pool->default_weights_.push_back(capacities[c] * g.Component(c).host_block_bytes());
  }
  if (by_demand) pool->default_weights_ = PlanPoolLayout(g, budget_bytes, PoolSplit{})->weights;  // checked above
  struct statfs fs {};
  pool->page_bytes_ = fstatfs(fd.get(), &fs) == 0 && fs.f_bsize > 0 ? static_cast<uint64_t>(fs.f_bsize) : 4096;
  pool->fd_ = std::move(fd);
  for (size_t c = 0; c < active.size(); ++c) {
    SubPool& p = pool->sub_pools_[c];
    p.active = active[c];
    // A daemon that died in SetActive may have left the range beyond active allocated (a grow not yet recorded,
    // a shrink not yet punched): give it back.
    if (p.active < p.capacity) {
      pool->PunchHole(pool->DataOffset(c, p.active), uint64_t{p.capacity - p.active} * p.slot_bytes);
    }
  }
  return pool;
}

void Pool::SetSubPools(const std::vector<uint64_t>& base, const std::vector<uint64_t>& capacity,
                       const std::vector<uint64_t>& data_offset, uint64_t data_end, uint32_t grants_per_sub_pool) {
  sub_pools_.clear();
  for (size_t c = 0; c < capacity.size(); ++c) {
    sub_pools_.push_back(SubPool{geometry_.component_kind(c), static_cast<SlotId>(base[c]),
                                 static_cast<uint32_t>(capacity[c]), geometry_.Component(c).host_block_bytes(),
                                 map_.bytes() + data_offset[c], static_cast<uint32_t>(capacity[c]),
                                 GrantOf(capacity[c], grants_per_sub_pool)});
  }
  data_bytes_ = data_end - data_offset[0];
}

size_t Pool::ComponentOf(SlotId slot) const {
  size_t c = sub_pools_.size() - 1;
  while (c > 0 && slot < sub_pools_[c].base) --c;
  return c;
}

uint8_t* Pool::SlotData(SlotId slot) const {
  const SubPool& p = sub_pools_[ComponentOf(slot)];
  return p.data + uint64_t{slot - p.base} * p.slot_bytes;
}

Pool::~Pool() = default;

uint32_t SubPool::RoundToGrants(uint64_t slots) const { return RoundUpToGrants(slots, grant, capacity); }

uint64_t Pool::max_bytes() const {
  uint64_t bytes = 0;
  for (const SubPool& p : sub_pools_) bytes += uint64_t{p.capacity} * p.slot_bytes;
  return bytes;
}

uint64_t Pool::active_bytes() const {
  uint64_t bytes = 0;
  for (const SubPool& p : sub_pools_) bytes += uint64_t{p.active} * p.slot_bytes;
  return bytes;
}

std::vector<uint32_t> Pool::ActiveSlotsFor(uint64_t active_bytes) const {
  std::vector<uint64_t> capacity, slot_bytes, weights;
  for (const SubPool& p : sub_pools_) {
    capacity.push_back(p.capacity);
    slot_bytes.push_back(p.slot_bytes);
    // Layout 4: the split demand gave it; otherwise the layout's own (the capacities).
    weights.push_back((demand_sized_ ? p.active : p.capacity) * p.slot_bytes);
  }
  if (!demand_sized_) active_bytes = std::min(active_bytes, max_bytes());
  return ScaledActive(capacity, slot_bytes, weights, active_bytes,
                      demand_sized_ ? kDemandGrantsPerSubPool : kGrantsPerSubPool);
}

std::vector<uint32_t> Pool::DefaultSlotsFor(uint64_t active_bytes) const {
  std::vector<uint64_t> capacity, slot_bytes;
  for (const SubPool& p : sub_pools_) {
    capacity.push_back(p.capacity);
    slot_bytes.push_back(p.slot_bytes);
  }
  if (!demand_sized_) active_bytes = std::min(active_bytes, max_bytes());
  return ScaledActive(capacity, slot_bytes, default_weights_, active_bytes,
                      demand_sized_ ? kDemandGrantsPerSubPool : kGrantsPerSubPool);
}

uint64_t Pool::DataOffset(size_t c, uint64_t local) const {
  const SubPool& p = sub_pools_[c];
  return static_cast<uint64_t>(p.data - map_.bytes()) + local * p.slot_bytes;
}

Status Pool::WriteActiveRecord(size_t c, uint32_t slots) {
  ActiveRecord r{};
  std::memcpy(r.magic, kActiveMagic, sizeof(r.magic));
  r.version = kActiveRecordVersion;
  r.count = static_cast<uint32_t>(sub_pools_.size());
  for (size_t i = 0; i < sub_pools_.size(); ++i) r.active[i] = i == c ? slots : sub_pools_[i].active;
  r.checksum = ActiveChecksum(r);
  // One pwrite: a daemon killed at any point leaves the old record or the new one, never half of each.
  if (pwrite(fd_.get(), &r, sizeof(r), kActiveRecordOffset) != static_cast<ssize_t>(sizeof(r))) {
    return Status::Internal(fmt::format("writing the active-capacity record of pool file {}: {}", path_, ErrnoText(errno)));
  }
  return Status::Ok();
}

void Pool::PunchHole(uint64_t offset, uint64_t bytes) const {
  // Only whole pages of the filesystem inside the range: a partial one also holds bytes of a slot that stays
  // (hugetlbfs cannot punch part of a huge page at all).
  const uint64_t begin = AlignUp(offset, page_bytes_);
  const uint64_t end = (offset + bytes) / page_bytes_ * page_bytes_;
  if (end <= begin) return;
  if (fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(begin),
                static_cast<off_t>(end - begin)) != 0) {
    log::Warning("pool", "cannot release {} of pool file {} at offset {} (fallocate punch hole: {}); it stays allocated",
                 FormatByteSize(end - begin), path_, begin, ErrnoText(errno));
  }
}

Status Pool::AllocateData(size_t component, uint32_t from, uint32_t to) const {
  POOL_CHECK(component < sub_pools_.size() && from <= to && to <= sub_pools_[component].capacity,
             fmt::format("AllocateData of component {} slots {}..{}", component, from, to));
  const SubPool& p = sub_pools_[component];
  const uint64_t offset = DataOffset(component, from), bytes = uint64_t{to - from} * p.slot_bytes;
  if (bytes == 0) return Status::Ok();
  const int rc = posix_fallocate(fd_.get(), static_cast<off_t>(offset), static_cast<off_t>(bytes));
  if (rc != 0) {
    PunchHole(offset, bytes);  // whatever part of it was allocated
    return Status::ResourceExhausted(fmt::format(
        "cannot grow pool file {} by {} (component {}: slots {} -> {}): {}; free space in {} or lower the budget",
        path_, FormatByteSize(bytes), component, from, to, ErrnoText(rc), FilesystemOf(path_, fd_.get())));
  }
  return Status::Ok();
}

void Pool::FreeData(size_t component, uint32_t from, uint32_t to) const {
  POOL_CHECK(component < sub_pools_.size() && from >= sub_pools_[component].active && from <= to &&
                 to <= sub_pools_[component].capacity,
             fmt::format("FreeData of component {} slots {}..{}", component, from, to));
  PunchHole(DataOffset(component, from), uint64_t{to - from} * sub_pools_[component].slot_bytes);
}

Status Pool::SetActive(size_t component, uint32_t slots, bool allocated) {
  POOL_CHECK(component < sub_pools_.size(), fmt::format("SetActive of component {} of {}", component, sub_pools_.size()));
  SubPool& p = sub_pools_[component];
  if (slots < p.grant || slots > p.capacity || (slots % p.grant != 0 && slots != p.capacity)) {
    return Status::InvalidArgument(fmt::format(
        "active capacity {} for component {} of pool file {}; expected a multiple of its grant of {} slots in [{}, {}]",
        slots, component, path_, p.grant, p.grant, p.capacity));
  }
  const uint32_t old = p.active;
  if (slots == old) return Status::Ok();
  if (slots > old) {
    const uint64_t offset = DataOffset(component, old), bytes = uint64_t{slots - old} * p.slot_bytes;
    const int rc = allocated ? 0 : posix_fallocate(fd_.get(), static_cast<off_t>(offset), static_cast<off_t>(bytes));
    if (rc != 0) {
      PunchHole(offset, bytes);  // whatever part of it was allocated
      return Status::ResourceExhausted(fmt::format(
          "cannot grow pool file {} by {} (component {}: {} -> {} slots): {}; free space in {} or lower the budget",
          path_, FormatByteSize(bytes), component, old, slots, ErrnoText(rc), FilesystemOf(path_, fd_.get())));
    }
    if (Status recorded = WriteActiveRecord(component, slots); !recorded.ok()) {
      PunchHole(offset, bytes);
      return recorded;
    }
    p.active = slots;
    return Status::Ok();
  }
  for (SlotId s = p.base + slots; s < p.base + old; ++s) {
    POOL_CHECK(entry(s)->state.load(std::memory_order_acquire) == 0,
               fmt::format("shrinking component {} to {} slots while slot {} holds a block", component, slots, s));
  }
  // Recorded first: a restart after a crash here must not take the punched slots for active ones.
  FLEXKV_RETURN_IF_ERROR(WriteActiveRecord(component, slots));
  p.active = slots;
  PunchHole(DataOffset(component, slots), uint64_t{old - slots} * p.slot_bytes);
  return Status::Ok();
}

Status Pool::AdoptRankMajorSlots() {
  if (!layer_major_file_) return Status::Ok();
  PoolHeader h{};
  std::memcpy(&h, map_.data(), sizeof(h));
  h.version |= kRankMajorSlotsFlag;
  h.checksum = HeaderChecksum(h);
  std::memcpy(map_.data(), &h, sizeof(h));
  // On tmpfs the mapping is the file; on a disk-backed path the header must reach it before any slot changes.
  if (msync(map_.data(), kHeaderBytes, MS_SYNC) != 0) {
    return Status::Internal(fmt::format("msync of pool file {}'s header: {}", path_, ErrnoText(errno)));
  }
  log::Warning("pool",
               "pool file {} was written by a flexkvd before the rank-major slot order (TP {} shards interleaved in "
               "each slot): its header now says layout version {:#x} (older releases refuse it from here on) and its "
               "blocks are rewritten in today's order as they are verified",
               path_, geometry_.tp_size, h.version);
  return Status::Ok();
}

void Pool::MarkCommitted(SlotId slot, const BlockKey& key, const BlockKey& parent, uint64_t content_checksum) {
  SlotEntry* e = entry(slot);
  e->key = key;
  e->parent = parent;
  e->content_checksum = content_checksum;
  e->order = sharded_slots_ ? kRankMajorEntry : 0;
  e->checksum = EntryChecksum(slot, key, parent, content_checksum, e->order);
  // Bytes first, then the entry's fields, then the state: a crash at any point leaves the slot either
  // absent or complete.
  e->state.store(kSlotCommitted, std::memory_order_release);
}

void Pool::MarkFree(SlotId slot) { entry(slot)->state.store(0, std::memory_order_release); }

std::optional<Pool::Committed> Pool::Entry(SlotId slot) const {
  const SlotEntry* e = entry(slot);
  if (e->state.load(std::memory_order_acquire) != kSlotCommitted || !EntryIntact(slot, *e)) return std::nullopt;
  return Committed{slot, e->key, e->parent, e->content_checksum, static_cast<uint32_t>(ComponentOf(slot)),
                   sharded_slots_ && e->order == 0};
}

bool Pool::ContentMatches(SlotId slot, uint64_t content_checksum) const {
  return BlockChecksum(SlotData(slot), SlotBytes(slot)) == content_checksum;
}

std::vector<Pool::Committed> Pool::Recover(uint64_t* dropped, uint64_t* corrupt) {
  *dropped = 0;
  uint64_t bad_entries = 0;
  // Pass 1: valid committed entries, by key (reserved once: no rehashing at 10 M blocks).
  // FULL blocks (component 0) form chains by parent; the other components' entries stand alone.
  // Entries beyond a sub-pool's active capacity have no bytes behind them (a hole): cleared.
  for (const SubPool& p : sub_pools_) {
    for (SlotId s = p.base + p.active; s < p.base + p.capacity; ++s) {
      SlotEntry* e = entry(s);
      if (e->state.load(std::memory_order_acquire) == 0) continue;
      e->state.store(0, std::memory_order_relaxed);
      ++*dropped;
    }
  }
  const SlotId full_end = sub_pools_[0].active;
  size_t committed = 0;
  for (SlotId s = 0; s < full_end; ++s) committed += entry(s)->state.load(std::memory_order_acquire) != 0 ? 1 : 0;
  std::unordered_map<BlockKey, SlotId, BlockKeyHash> by_key;
  by_key.reserve(committed);
  for (SlotId s = 0; s < full_end; ++s) {
    SlotEntry* e = entry(s);
    const uint32_t state = e->state.load(std::memory_order_acquire);
    if (state == 0) continue;
    const bool intact = state == kSlotCommitted && EntryIntact(s, *e);
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
        out.push_back(Committed{*it, e->key, e->parent, e->content_checksum, 0, sharded_slots_ && e->order == 0});
      } else {
        MarkFree(*it);
        ++*dropped;
      }
    }
  }
  for (size_t c = 1; c < sub_pools_.size(); ++c) {
    const SubPool& p = sub_pools_[c];
    std::unordered_map<BlockKey, SlotId, BlockKeyHash> seen;
    for (SlotId s = p.base; s < p.base + p.active; ++s) {
      SlotEntry* e = entry(s);
      const uint32_t state = e->state.load(std::memory_order_acquire);
      if (state == 0) continue;
      const bool intact = state == kSlotCommitted && EntryIntact(s, *e);
      if (!intact || e->key == BlockKey{} || !seen.emplace(e->key, s).second) {
        e->state.store(0, std::memory_order_relaxed);
        ++*dropped;
        if (!intact) ++bad_entries;
        continue;
      }
      out.push_back(Committed{s, e->key, e->parent, e->content_checksum, static_cast<uint32_t>(c),
                              sharded_slots_ && e->order == 0});
    }
  }
  if (corrupt != nullptr) *corrupt = bad_entries;
  return out;
}

}  // namespace flexkv

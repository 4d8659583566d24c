// SsdStore on real files with O_DIRECT (a temporary directory on a disk filesystem): byte-exact round trips,
// rebuild at reopen, corruption and torn writes never served, files of another geometry, version or domain
// refused or discarded, bounded queues, write and read errors, and tmpfs refused unless buffered I/O is allowed.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "daemon/tiers/ssd/ssd_format.h"
#include "daemon/tiers/ssd/ssd_store.h"

using flexkv::BlockKey;
using flexkv::SsdBlockId;
using flexkv::SsdDomain;
using flexkv::SsdEntry;
using flexkv::SsdMismatchPolicy;
using flexkv::SsdStore;
using flexkv::SsdStoreOptions;
using flexkv::Status;
using flexkv::StatusCode;

namespace {

constexpr uint64_t kTmpfsMagic = 0x01021994;

// A fresh directory on a filesystem that does direct I/O (not tmpfs), removed at the end.
class TempDir {
 public:
  TempDir() {
    for (const char* base : {"/var/tmp", "/tmp", "/work"}) {
      struct statfs s {};
      if (statfs(base, &s) != 0 || static_cast<uint64_t>(s.f_type) == kTmpfsMagic) continue;
      std::string tmpl = std::string(base) + "/flexkv-ssd-unit-XXXXXX";
      if (mkdtemp(tmpl.data()) != nullptr) {
        path_ = tmpl;
        return;
      }
    }
    FAIL("no directory on a disk filesystem for the SSD tests (tried /var/tmp, /tmp, /work)");
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const {
    std::string p = path_ + "/" + name;
    std::filesystem::create_directories(p);
    return p;
  }

 private:
  std::string path_;
};

// Memory aligned to 4 KiB (what O_DIRECT can use without a bounce).
struct AlignedBytes {
  explicit AlignedBytes(size_t n) : size(n) {
    void* p = nullptr;
    REQUIRE(posix_memalign(&p, 4096, n == 0 ? 4096 : n) == 0);
    data = static_cast<uint8_t*>(p);
    std::memset(data, 0, n);
  }
  ~AlignedBytes() { std::free(data); }
  AlignedBytes(const AlignedBytes&) = delete;
  AlignedBytes& operator=(const AlignedBytes&) = delete;
  std::span<uint8_t> span(size_t off, size_t n) const { return {data + off, n}; }
  uint8_t* data = nullptr;
  size_t size = 0;
};

// Waits for `done` callbacks and keeps their statuses.
class Completions {
 public:
  SsdStore::Done Add() {
    std::lock_guard<std::mutex> l(mu_);
    ++pending_;
    return [this](Status s) {
      std::lock_guard<std::mutex> l2(mu_);
      statuses_.push_back(std::move(s));
      if (--pending_ == 0) cv_.notify_all();
    };
  }
  std::vector<Status> Wait() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return pending_ == 0; });
    return std::move(statuses_);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  std::vector<Status> statuses_;
};

// Runs one request and returns its completion status (or the refusal).
Status Sync(const std::function<Status(SsdStore::Done)>& submit) {
  Completions c;
  const Status accepted = submit(c.Add());
  if (!accepted.ok()) return accepted;
  auto s = c.Wait();
  REQUIRE(s.size() == 1);
  return s[0];
}

const SsdDomain kDomain{0x1111, 0x2222};
const SsdDomain kOtherDomain{0x3333, 0x4444};

SsdBlockId Id(uint64_t i, SsdDomain domain = kDomain, uint32_t component = 0) {
  return SsdBlockId{BlockKey{i * 0x9E3779B97F4A7C15ull + 1, i}, domain, component};
}

void Fill(std::span<uint8_t> bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
}

SsdStoreOptions Options(std::vector<std::string> paths, uint64_t payload, uint64_t slots_per_path) {
  SsdStoreOptions o;
  o.size_bytes = (flexkv::kSsdHeaderSector + slots_per_path * flexkv::SsdSlotStride(payload)) * paths.size();
  o.paths = std::move(paths);
  o.payload_capacity = payload;
  o.queue_depth = 8;
  return o;
}

Status WriteSync(SsdStore& s, const SsdBlockId& id, std::span<const uint8_t> bytes, uint64_t checksum = 0) {
  return Sync([&](SsdStore::Done d) { return s.Write(id, BlockKey{}, bytes, checksum, std::move(d)); });
}
Status ReadSync(SsdStore& s, const SsdBlockId& id, std::span<uint8_t> bytes) {
  return Sync([&](SsdStore::Done d) { return s.Read(id, bytes, std::move(d)); });
}

std::string BlockFile(const std::string& dir) { return dir + "/" + flexkv::kSsdFileName; }

// pread/pwrite on the block file behind the store's back (buffered; the store is closed or the bytes are its own).
void PatchFile(const std::string& path, uint64_t off, const void* bytes, size_t n) {
  const int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, bytes, n, static_cast<off_t>(off)) == static_cast<ssize_t>(n));
  REQUIRE(::fsync(fd) == 0);
  ::close(fd);
}
std::vector<uint8_t> ReadFile(const std::string& path, uint64_t off, size_t n) {
  std::vector<uint8_t> out(n);
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pread(fd, out.data(), n, static_cast<off_t>(off)) == static_cast<ssize_t>(n));
  ::close(fd);
  return out;
}

// The slot a committed block is in, found by scanning the file's slot headers.
int64_t SlotOf(const std::string& file, uint64_t payload, const SsdBlockId& id, uint64_t slots) {
  const uint64_t stride = flexkv::SsdSlotStride(payload);
  for (uint64_t s = 0; s < slots; ++s) {
    auto sec = ReadFile(file, flexkv::kSsdHeaderSector + s * stride, flexkv::kSsdHeaderSector);
    auto d = flexkv::DecodeSlotHeader(std::span<const uint8_t, flexkv::kSsdHeaderSector>(sec.data(), sec.size()));
    if (d.kind == flexkv::SsdSectorKind::kValid && d.header.id == id) return static_cast<int64_t>(s);
  }
  return -1;
}

}  // namespace

TEST_CASE("ssd format: headers round-trip, and a changed byte, another version or no magic are told apart",
          "[unit][ssd]") {
  std::vector<uint8_t> sec(flexkv::kSsdHeaderSector);
  std::span<uint8_t, flexkv::kSsdHeaderSector> s(sec.data(), sec.size());
  flexkv::SsdSlotHeader h;
  h.file_id = 7;
  h.slot = 3;
  h.generation = 99;
  h.id = Id(5, kDomain, 2);
  h.parent = BlockKey{1, 2};
  h.payload_bytes = 12345;
  h.payload_xxh3 = 0xABCDEF;
  h.content_checksum = 42;
  flexkv::EncodeSlotHeader(h, s);
  auto d = flexkv::DecodeSlotHeader(s);
  REQUIRE(d.kind == flexkv::SsdSectorKind::kValid);
  CHECK(d.header.id == h.id);
  CHECK(d.header.parent == h.parent);
  CHECK(d.header.generation == 99);
  CHECK(d.header.payload_bytes == 12345);
  CHECK(d.header.content_checksum == 42);
  sec[50] ^= 1;
  CHECK(flexkv::DecodeSlotHeader(s).kind == flexkv::SsdSectorKind::kCorrupt);
  sec[50] ^= 1;
  h.format_version = flexkv::kSsdFormatVersion + 1;
  flexkv::EncodeSlotHeader(h, s);
  auto other = flexkv::DecodeSlotHeader(s);
  CHECK(other.kind == flexkv::SsdSectorKind::kOtherVersion);
  CHECK(other.version == flexkv::kSsdFormatVersion + 1);
  std::fill(sec.begin(), sec.end(), 0);
  CHECK(flexkv::DecodeSlotHeader(s).kind == flexkv::SsdSectorKind::kEmpty);
  // A file header is not a slot header.
  flexkv::SsdFileHeader fh;
  fh.file_id = 1;
  fh.payload_capacity = 4096;
  fh.slot_stride = 8192;
  fh.slot_count = 10;
  flexkv::EncodeFileHeader(fh, s);
  CHECK(flexkv::DecodeSlotHeader(s).kind == flexkv::SsdSectorKind::kEmpty);
  CHECK(flexkv::DecodeFileHeader(s).kind == flexkv::SsdSectorKind::kValid);
  CHECK(flexkv::DecodeFileHeader(s).header.slot_count == 10);
  // Domains of the same namespace and another geometry differ.
  flexkv::Geometry g;
  g.num_layers = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 64;
  flexkv::Geometry g2 = g;
  g2.num_layers = 4;
  CHECK(SsdDomain::Of("ns", g).namespace_hash == SsdDomain::Of("ns", g2).namespace_hash);
  CHECK_FALSE(SsdDomain::Of("ns", g) == SsdDomain::Of("ns", g2));
}

TEST_CASE("ssd store: many blocks written and read back byte-exact from several threads over two drives",
          "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 16384;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 64;
  auto opened = SsdStore::Open(Options({dir.Sub("a"), dir.Sub("b")}, kPayload, 160));
  REQUIRE(opened.ok());
  SsdStore& store = **opened;
  CHECK(store.capacity_slots() == 320);
  CHECK(store.files().size() == 2);
  CHECK(store.files()[0].direct);
  CHECK(store.files()[0].filesystem != "tmpfs");
  // Aligned blocks in one buffer, plus unaligned ones (odd sizes, odd addresses) that go through a bounce buffer.
  AlignedBytes src(kThreads * kPerThread * kPayload + 64);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  auto size_of = [](int i) -> uint64_t { return i % 5 == 4 ? kPayload - 100 - static_cast<uint64_t>(i) : kPayload; };
  auto offset_of = [](int i) -> uint64_t { return static_cast<uint64_t>(i) * kPayload + (i % 5 == 4 ? 16 : 0); };
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Completions c;
      for (int k = 0; k < kPerThread; ++k) {
        const int i = t * kPerThread + k;
        auto bytes = src.span(offset_of(i), size_of(i));
        Fill(bytes, static_cast<uint64_t>(i));
        Status s = store.Write(Id(static_cast<uint64_t>(i)), BlockKey{0, static_cast<uint64_t>(i)}, bytes,
                               1000 + static_cast<uint64_t>(i), c.Add());
        while (s.code() == StatusCode::kResourceExhausted) {  // queue full: the caller decides; here, retry
          std::this_thread::yield();
          s = store.Write(Id(static_cast<uint64_t>(i)), BlockKey{0, static_cast<uint64_t>(i)}, bytes,
                          1000 + static_cast<uint64_t>(i), c.Add());
        }
        if (!s.ok()) ++failures;
      }
      for (const Status& s : c.Wait()) {
        if (!s.ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  REQUIRE(failures == 0);
  CHECK(store.stats().blocks == kThreads * kPerThread);
  CHECK(store.stats().bounced_ios > 0);
  // Read back concurrently into a second buffer, compare.
  AlignedBytes dst(src.size);
  threads.clear();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Completions c;
      for (int k = 0; k < kPerThread; ++k) {
        const int i = t * kPerThread + k;
        Status s = store.Read(Id(static_cast<uint64_t>(i)), dst.span(offset_of(i), size_of(i)), c.Add());
        while (s.code() == StatusCode::kResourceExhausted) {
          std::this_thread::yield();
          s = store.Read(Id(static_cast<uint64_t>(i)), dst.span(offset_of(i), size_of(i)), c.Add());
        }
        if (!s.ok()) ++failures;
      }
      for (const Status& s : c.Wait()) {
        if (!s.ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  REQUIRE(failures == 0);
  for (int i = 0; i < kThreads * kPerThread; ++i) {
    INFO("block " << i);
    REQUIRE(std::memcmp(src.data + offset_of(i), dst.data + offset_of(i), size_of(i)) == 0);
  }
  auto e = store.Lookup(Id(7));
  REQUIRE(e.has_value());
  CHECK(e->content_checksum == 1007);
  CHECK(e->parent == BlockKey{0, 7});
  CHECK(store.stats().data_loss_blocks == 0);
  CHECK(store.Write(Id(7), BlockKey{}, src.span(0, kPayload), 0, [](Status) {}).code() == StatusCode::kAlreadyExists);
  CHECK(store.Read(Id(100000), dst.span(0, kPayload), [](Status) {}).code() == StatusCode::kNotFound);
  CHECK(store.Read(Id(7), dst.span(0, kPayload - 4096), [](Status) {}).code() == StatusCode::kInvalidArgument);
  CHECK(store.Write(Id(100001), BlockKey{}, std::span<const uint8_t>(src.data, kPayload + 1), 0, [](Status) {}).code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("ssd store: reopened, it rebuilds its index from the slot headers and serves the same bytes",
          "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 8192;
  const auto opts = Options({dir.Sub("a"), dir.Sub("b")}, kPayload, 40);
  AlignedBytes src(50 * kPayload);
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    CHECK((*store)->rebuild_report().blocks == 0);
    for (int i = 0; i < 50; ++i) {
      Fill(src.span(i * kPayload, kPayload), 500 + static_cast<uint64_t>(i));
      REQUIRE(WriteSync(**store, Id(static_cast<uint64_t>(i)), src.span(i * kPayload, kPayload), 77).ok());
    }
    REQUIRE((*store)->Erase(Id(3)));
    CHECK_FALSE((*store)->Erase(Id(3)));
  }  // closed as SIGTERM would; a kill -9 leaves the same bytes on disk (every completed write is there)
  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  CHECK((*store)->rebuild_report().blocks == 49);
  CHECK((*store)->rebuild_report().corrupt_headers == 0);
  CHECK_FALSE((*store)->Lookup(Id(3)).has_value());  // an erased block does not come back
  std::vector<SsdEntry> entries = (*store)->Entries();
  REQUIRE(entries.size() == 49);
  for (size_t k = 1; k < entries.size(); ++k) CHECK(entries[k - 1].generation < entries[k].generation);
  AlignedBytes dst(kPayload);
  for (int i = 0; i < 50; ++i) {
    if (i == 3) continue;
    INFO("block " << i);
    REQUIRE(ReadSync(**store, Id(static_cast<uint64_t>(i)), dst.span(0, kPayload)).ok());
    REQUIRE(std::memcmp(dst.data, src.data + i * kPayload, kPayload) == 0);
    CHECK((*store)->Lookup(Id(static_cast<uint64_t>(i)))->content_checksum == 77);
  }
  // New writes get generations above every rebuilt one.
  REQUIRE(WriteSync(**store, Id(1000), src.span(0, kPayload)).ok());
  CHECK((*store)->Lookup(Id(1000))->generation > entries.back().generation);
}

TEST_CASE("ssd store: registered buffers carry the payloads (fixed-buffer I/O) and the bytes are the same",
          "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 65536;
  auto store = SsdStore::Open(Options({dir.Sub("a")}, kPayload, 16));
  REQUIRE(store.ok());
  AlignedBytes pool(16 * kPayload);
  flexkv::SsdRegion region{pool.data, pool.size};
  REQUIRE((*store)->RegisterBuffers(std::span<const flexkv::SsdRegion>(&region, 1)).ok());
  for (int i = 0; i < 8; ++i) Fill(pool.span(i * kPayload, kPayload), 900 + static_cast<uint64_t>(i));
  for (int i = 0; i < 8; ++i) REQUIRE(WriteSync(**store, Id(static_cast<uint64_t>(i)), pool.span(i * kPayload, kPayload)).ok());
  for (int i = 0; i < 8; ++i) REQUIRE(ReadSync(**store, Id(static_cast<uint64_t>(i)), pool.span((8 + i) * kPayload, kPayload)).ok());
  for (int i = 0; i < 8; ++i) CHECK(std::memcmp(pool.data + i * kPayload, pool.data + (8 + i) * kPayload, kPayload) == 0);
  CHECK((*store)->stats().fixed_buffer_ios == 16);
  // Memory outside the registered region still works, unregistered.
  AlignedBytes other(kPayload);
  REQUIRE(ReadSync(**store, Id(0), other.span(0, kPayload)).ok());
  CHECK(std::memcmp(other.data, pool.data, kPayload) == 0);
  CHECK((*store)->stats().fixed_buffer_ios == 16);
  const Status unreg = (*store)->RegisterBuffers({});
  INFO(unreg.ToString());
  REQUIRE(unreg.ok());
}

TEST_CASE("ssd store: a payload byte flipped on disk is DATA_LOSS, dropped, counted and gone after reopen",
          "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 8192;
  const std::string path = dir.Sub("a");
  const auto opts = Options({path}, kPayload, 8);
  AlignedBytes src(kPayload), dst(kPayload);
  Fill(src.span(0, kPayload), 1);
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    REQUIRE(WriteSync(**store, Id(1), src.span(0, kPayload)).ok());
    REQUIRE(WriteSync(**store, Id(2), src.span(0, kPayload)).ok());
  }
  const int64_t slot = SlotOf(BlockFile(path), kPayload, Id(1), 8);
  REQUIRE(slot >= 0);
  const uint64_t byte_off = flexkv::kSsdHeaderSector + static_cast<uint64_t>(slot) * flexkv::SsdSlotStride(kPayload) +
                            flexkv::kSsdHeaderSector + 1234;
  uint8_t b = ReadFile(BlockFile(path), byte_off, 1)[0] ^ 0x20;
  PatchFile(BlockFile(path), byte_off, &b, 1);
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    CHECK((*store)->rebuild_report().blocks == 2);  // headers are intact: the damage shows at the read
    const Status s = ReadSync(**store, Id(1), dst.span(0, kPayload));
    CHECK(s.code() == StatusCode::kDataLoss);
    CHECK_THAT(s.message(), Catch::Contains("did not verify") && Catch::Contains("checksum") &&
                                Catch::Contains(BlockFile(path)));
    CHECK_FALSE((*store)->Lookup(Id(1)).has_value());
    CHECK((*store)->stats().data_loss_blocks == 1);
    CHECK(ReadSync(**store, Id(1), dst.span(0, kPayload)).code() == StatusCode::kNotFound);
    REQUIRE(ReadSync(**store, Id(2), dst.span(0, kPayload)).ok());
    CHECK(std::memcmp(dst.data, src.data, kPayload) == 0);
  }
  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  CHECK((*store)->rebuild_report().blocks == 1);  // the dropped block's header was cleared
  CHECK_FALSE((*store)->Lookup(Id(1)).has_value());
}

TEST_CASE("ssd store: a torn write - a newer header over the old payload - is never served", "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 8192;
  const std::string path = dir.Sub("a");
  const auto opts = Options({path}, kPayload, 8);
  AlignedBytes a(kPayload), bb(kPayload), dst(kPayload);
  Fill(a.span(0, kPayload), 11);
  Fill(bb.span(0, kPayload), 12);
  uint64_t generation = 0;
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    REQUIRE(WriteSync(**store, Id(1), a.span(0, kPayload)).ok());
    generation = (*store)->Lookup(Id(1))->generation;
  }
  // The crash: block 2 (generation g+1) was being written into block 1's slot; its header reached the drive,
  // its payload did not.
  const int64_t slot = SlotOf(BlockFile(path), kPayload, Id(1), 8);
  REQUIRE(slot >= 0);
  const uint64_t off = flexkv::kSsdHeaderSector + static_cast<uint64_t>(slot) * flexkv::SsdSlotStride(kPayload);
  auto sec = ReadFile(BlockFile(path), off, flexkv::kSsdHeaderSector);
  std::span<uint8_t, flexkv::kSsdHeaderSector> s(sec.data(), sec.size());
  flexkv::SsdSlotHeader h = flexkv::DecodeSlotHeader(s).header;
  h.generation = generation + 1;
  h.id = Id(2);
  h.payload_xxh3 = flexkv::SsdPayloadChecksum(bb.span(0, kPayload));
  flexkv::EncodeSlotHeader(h, s);
  PatchFile(BlockFile(path), off, sec.data(), sec.size());

  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  CHECK_FALSE((*store)->Lookup(Id(1)).has_value());  // its header is gone
  REQUIRE((*store)->Lookup(Id(2)).has_value());
  const Status st = ReadSync(**store, Id(2), dst.span(0, kPayload));
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK_FALSE((*store)->Lookup(Id(2)).has_value());
  CHECK((*store)->stats().data_loss_blocks == 1);

  // A header torn inside itself (a changed byte in the sector) is skipped at rebuild and counted.
  REQUIRE(WriteSync(**store, Id(3), a.span(0, kPayload)).ok());
  store->reset();
  const int64_t slot3 = SlotOf(BlockFile(path), kPayload, Id(3), 8);
  REQUIRE(slot3 >= 0);
  const uint64_t off3 = flexkv::kSsdHeaderSector + static_cast<uint64_t>(slot3) * flexkv::SsdSlotStride(kPayload) + 45;
  uint8_t x = ReadFile(BlockFile(path), off3, 1)[0] ^ 0xFF;
  PatchFile(BlockFile(path), off3, &x, 1);
  auto again = SsdStore::Open(opts);
  REQUIRE(again.ok());
  CHECK((*again)->rebuild_report().corrupt_headers == 1);
  CHECK_FALSE((*again)->Lookup(Id(3)).has_value());
}

TEST_CASE("ssd store: a truncated file keeps the blocks before the cut and loses the one cut through", "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 8192;
  const std::string path = dir.Sub("a");
  const auto opts = Options({path}, kPayload, 8);
  AlignedBytes src(kPayload), dst(kPayload);
  Fill(src.span(0, kPayload), 3);
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    for (uint64_t i = 0; i < 8; ++i) REQUIRE(WriteSync(**store, Id(i), src.span(0, kPayload)).ok());
  }
  const int64_t last = SlotOf(BlockFile(path), kPayload, Id(7), 8);
  REQUIRE(last >= 0);
  // Cut in the middle of that block's payload.
  const uint64_t cut = flexkv::kSsdHeaderSector + static_cast<uint64_t>(last) * flexkv::SsdSlotStride(kPayload) +
                       flexkv::kSsdHeaderSector + 4096;
  REQUIRE(::truncate(BlockFile(path).c_str(), static_cast<off_t>(cut)) == 0);
  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  REQUIRE_FALSE((*store)->rebuild_report().warnings.empty());
  CHECK_THAT((*store)->rebuild_report().warnings[0], Catch::Contains("truncated"));
  CHECK((*store)->rebuild_report().truncated >= 1);
  CHECK_FALSE((*store)->Lookup(Id(7)).has_value());
  for (uint64_t i = 0; i < 8; ++i) {
    if (static_cast<int64_t>(i) == 7) continue;
    const int64_t s = SlotOf(BlockFile(path), kPayload, Id(i), static_cast<uint64_t>(last));
    if (s < 0) continue;  // after the cut slot: lost too
    REQUIRE(ReadSync(**store, Id(i), dst.span(0, kPayload)).ok());
    CHECK(std::memcmp(dst.data, src.data, kPayload) == 0);
  }
  CHECK((*store)->stats().data_loss_blocks == 0);
}

TEST_CASE("ssd store: a file of another geometry or format version is refused, or discarded when allowed",
          "[unit][ssd]") {
  TempDir dir;
  const std::string path = dir.Sub("a");
  AlignedBytes src(8192);
  {
    auto store = SsdStore::Open(Options({path}, 8192, 8));
    REQUIRE(store.ok());
    REQUIRE(WriteSync(**store, Id(1), src.span(0, 8192)).ok());
  }
  auto other = Options({path}, 16384, 8);
  auto refused = SsdStore::Open(other);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused.status().message(), Catch::Contains(BlockFile(path)) && Catch::Contains("another geometry") &&
                                             Catch::Contains("nothing was changed"));
  // Untouched: the original geometry still opens with its block.
  {
    auto store = SsdStore::Open(Options({path}, 8192, 8));
    REQUIRE(store.ok());
    CHECK((*store)->Lookup(Id(1)).has_value());
  }
  other.on_mismatch = SsdMismatchPolicy::kDiscard;
  {
    auto store = SsdStore::Open(other);
    REQUIRE(store.ok());
    CHECK((*store)->rebuild_report().files_reformatted == 1);
    CHECK((*store)->rebuild_report().blocks == 0);
    REQUIRE((*store)->rebuild_report().warnings.size() == 1);
    CHECK_THAT((*store)->rebuild_report().warnings[0], Catch::Contains("discarded"));
  }
  // Another format version in the file header.
  std::vector<uint8_t> sec(flexkv::kSsdHeaderSector);
  std::span<uint8_t, flexkv::kSsdHeaderSector> s(sec.data(), sec.size());
  flexkv::SsdFileHeader fh;
  fh.format_version = 99;
  fh.file_id = 5;
  fh.payload_capacity = 16384;
  fh.slot_stride = flexkv::SsdSlotStride(16384);
  fh.slot_count = 8;
  flexkv::EncodeFileHeader(fh, s);
  PatchFile(BlockFile(path), 0, sec.data(), sec.size());
  other.on_mismatch = SsdMismatchPolicy::kRefuse;
  auto v = SsdStore::Open(other);
  REQUIRE_FALSE(v.ok());
  CHECK(v.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(v.status().message(), Catch::Contains("format version 99"));
  // Not a block file at all.
  std::vector<uint8_t> junk(flexkv::kSsdHeaderSector, 'x');
  PatchFile(BlockFile(path), 0, junk.data(), junk.size());
  auto j = SsdStore::Open(other);
  REQUIRE_FALSE(j.ok());
  CHECK_THAT(j.status().message(), Catch::Contains("no flexkv SSD file header"));
}

TEST_CASE("ssd store: blocks of a domain not configured are refused, or discarded when allowed", "[unit][ssd]") {
  TempDir dir;
  const std::string path = dir.Sub("a");
  AlignedBytes src(8192);
  auto opts = Options({path}, 8192, 8);
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    REQUIRE(WriteSync(**store, Id(1, kDomain), src.span(0, 8192)).ok());
    REQUIRE(WriteSync(**store, Id(2, kOtherDomain), src.span(0, 8192)).ok());
  }
  opts.domains = {kDomain};
  auto refused = SsdStore::Open(opts);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused.status().message(), Catch::Contains(kOtherDomain.ToString()) && Catch::Contains(BlockFile(path)));
  opts.on_mismatch = SsdMismatchPolicy::kDiscard;
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    CHECK((*store)->rebuild_report().other_domain == 1);
    CHECK((*store)->Lookup(Id(1, kDomain)).has_value());
    CHECK_FALSE((*store)->Lookup(Id(2, kOtherDomain)).has_value());
  }
  opts.domains.clear();  // every domain: the discarded block is gone for good
  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  CHECK((*store)->rebuild_report().blocks == 1);
}

TEST_CASE("ssd store: a full queue refuses at once with RESOURCE_EXHAUSTED and nothing waits", "[unit][ssd]") {
  TempDir dir;
  auto opts = Options({dir.Sub("a")}, 4096, 32);
  opts.queue_depth = 1;
  opts.max_queued = 2;
  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  AlignedBytes src(4096);
  // The first write's callback holds the drive thread, so what is accepted next stays queued.
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, release = false;
  REQUIRE((*store)->Write(Id(0), BlockKey{}, src.span(0, 4096), 0, [&](Status) {
    std::unique_lock<std::mutex> l(mu);
    entered = true;
    cv.notify_all();
    cv.wait(l, [&] { return release; });
  }).ok());
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return entered; });
  }
  Completions c;
  for (uint64_t i = 1; i <= 3; ++i) REQUIRE((*store)->Write(Id(i), BlockKey{}, src.span(0, 4096), 0, c.Add()).ok());
  const Status full = (*store)->Write(Id(4), BlockKey{}, src.span(0, 4096), 0, [](Status) { FAIL("called"); });
  CHECK(full.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(full.message(), Catch::Contains("queue is full"));
  AlignedBytes dst(4096);
  CHECK((*store)->Read(Id(0), dst.span(0, 4096), [](Status) { FAIL("called"); }).code() ==
        StatusCode::kResourceExhausted);
  CHECK((*store)->stats().refused == 2);
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  for (const Status& s : c.Wait()) CHECK(s.ok());
  (*store)->WaitIdle();
  CHECK((*store)->stats().blocks == 4);
}

TEST_CASE("ssd store: when full, the least recently used block makes room", "[unit][ssd]") {
  TempDir dir;
  auto store = SsdStore::Open(Options({dir.Sub("a")}, 4096, 4));
  REQUIRE(store.ok());
  AlignedBytes src(4096), dst(4096);
  for (uint64_t i = 0; i < 4; ++i) REQUIRE(WriteSync(**store, Id(i), src.span(0, 4096)).ok());
  REQUIRE(ReadSync(**store, Id(0), dst.span(0, 4096)).ok());  // 0 becomes most recently used
  REQUIRE(WriteSync(**store, Id(10), src.span(0, 4096)).ok());
  REQUIRE(WriteSync(**store, Id(11), src.span(0, 4096)).ok());
  CHECK((*store)->Lookup(Id(0)).has_value());
  CHECK_FALSE((*store)->Lookup(Id(1)).has_value());
  CHECK_FALSE((*store)->Lookup(Id(2)).has_value());
  CHECK((*store)->Lookup(Id(3)).has_value());
  CHECK((*store)->stats().evictions == 2);
  CHECK((*store)->stats().blocks == 4);
}

// Issue 29 item 6: a hot system prompt (DRAM always hits it, SSD never reads it) was the first block overwritten,
// leaving every prompt under it unreachable after a reboot.
TEST_CASE("ssd store: when full, leaves go before the blocks others hang under, at open too, and Touch keeps a leaf",
          "[unit][ssd]") {
  TempDir dir;
  const SsdStoreOptions options = Options({dir.Sub("a")}, 4096, 4);
  AlignedBytes src(4096);
  const auto write = [&](SsdStore& s, uint64_t i, std::optional<uint64_t> parent) {
    return Sync([&](SsdStore::Done d) {
      return s.Write(Id(i), parent ? Id(*parent).key : BlockKey{}, src.span(0, 4096), 0, std::move(d));
    });
  };
  {
    auto store = SsdStore::Open(options);
    REQUIRE(store.ok());
    // root 0 (written first: the least recently used) <- 1 <- 2, and root 0 <- 3.
    REQUIRE(write(**store, 0, std::nullopt).ok());
    REQUIRE(write(**store, 1, 0).ok());
    REQUIRE(write(**store, 2, 1).ok());
    REQUIRE(write(**store, 3, 0).ok());
    REQUIRE(write(**store, 10, std::nullopt).ok());  // overwrites leaf 2, the least recently used leaf
    CHECK((*store)->Lookup(Id(0)).has_value());
    CHECK((*store)->Lookup(Id(1)).has_value());
    CHECK_FALSE((*store)->Lookup(Id(2)).has_value());
    (*store)->Touch(std::vector<SsdBlockId>{Id(1)});  // 1 is a leaf now: used, it outlives 3
    REQUIRE(write(**store, 11, std::nullopt).ok());
    CHECK_FALSE((*store)->Lookup(Id(3)).has_value());
    CHECK((*store)->Lookup(Id(1)).has_value());
    CHECK((*store)->Lookup(Id(0)).has_value());  // the oldest block: others hang under it
  }
  // Reopened: LRU order is generation order, and the root - the oldest generation - is not overwritten before the
  // block under it.
  auto store = SsdStore::Open(options);
  REQUIRE(store.ok());
  REQUIRE((*store)->stats().blocks == 4);  // 0, 1, 10, 11
  REQUIRE(write(**store, 12, std::nullopt).ok());
  CHECK((*store)->Lookup(Id(0)).has_value());
  CHECK_FALSE((*store)->Lookup(Id(1)).has_value());
  // Its last child gone, the root is a leaf at the least recently used end (as in DRAM): the next to go.
  REQUIRE(write(**store, 13, std::nullopt).ok());
  CHECK_FALSE((*store)->Lookup(Id(0)).has_value());
  CHECK((*store)->Lookup(Id(10)).has_value());
  CHECK((*store)->Lookup(Id(11)).has_value());
}

TEST_CASE("ssd store: a second store on the same path is refused while the first is open", "[unit][ssd]") {
  TempDir dir;
  const auto opts = Options({dir.Sub("a")}, 4096, 4);
  auto first = SsdStore::Open(opts);
  REQUIRE(first.ok());
  auto second = SsdStore::Open(opts);
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(second.status().message(), Catch::Contains("in use by another process"));
}

TEST_CASE("ssd store: on tmpfs (/dev/shm) O_DIRECT is refused with the path and filesystem named, and buffered "
          "I/O works when allowed", "[unit][ssd]") {
  struct statfs s {};
  if (statfs("/dev/shm", &s) != 0 || static_cast<uint64_t>(s.f_type) != kTmpfsMagic) {
    WARN("no tmpfs at /dev/shm: skipped");
    return;
  }
  std::string tmpl = "/dev/shm/flexkv-ssd-unit-XXXXXX";
  REQUIRE(mkdtemp(tmpl.data()) != nullptr);
  struct Cleanup {
    std::string p;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  } cleanup{tmpl};
  auto opts = Options({tmpl}, 8192, 8);
  auto refused = SsdStore::Open(opts);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused.status().message(), Catch::Contains(tmpl) && Catch::Contains("tmpfs") &&
                                             Catch::Contains("--ssd-allow-buffered"));
  CHECK_FALSE(std::filesystem::exists(BlockFile(tmpl)));  // nothing left behind
  opts.allow_buffered = true;
  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  CHECK_FALSE((*store)->files()[0].direct);
  CHECK((*store)->files()[0].filesystem == "tmpfs");
  REQUIRE((*store)->rebuild_report().warnings.size() == 1);
  CHECK_THAT((*store)->rebuild_report().warnings[0], Catch::Contains("buffered") && Catch::Contains("slower"));
  AlignedBytes src(8192), dst(8192);
  Fill(src.span(0, 8192), 5);
  REQUIRE(WriteSync(**store, Id(1), src.span(0, 8192)).ok());
  REQUIRE(ReadSync(**store, Id(1), dst.span(0, 8192)).ok());
  CHECK(std::memcmp(src.data, dst.data, 8192) == 0);
}

TEST_CASE("ssd store: a file truncated under the open store fails the read of a block past the cut as DATA_LOSS",
          "[unit][ssd]") {
  TempDir dir;
  const std::string path = dir.Sub("a");
  auto store = SsdStore::Open(Options({path}, 8192, 8));
  REQUIRE(store.ok());
  AlignedBytes src(8192), dst(8192);
  for (uint64_t i = 0; i < 4; ++i) REQUIRE(WriteSync(**store, Id(i), src.span(0, 8192)).ok());
  const int64_t slot = SlotOf(BlockFile(path), 8192, Id(3), 8);
  REQUIRE(slot >= 0);
  REQUIRE(::truncate(BlockFile(path).c_str(),
                     static_cast<off_t>(flexkv::kSsdHeaderSector + static_cast<uint64_t>(slot) * flexkv::SsdSlotStride(8192))) == 0);
  const Status st = ReadSync(**store, Id(3), dst.span(0, 8192));
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK_THAT(st.message(), Catch::Contains(BlockFile(path)) && Catch::Contains("truncated"));
  CHECK((*store)->stats().read_errors == 1);
  CHECK((*store)->stats().data_loss_blocks == 1);
  CHECK_FALSE((*store)->Lookup(Id(3)).has_value());
}

namespace {

// Runs `body` in a forked child (single-threaded here: no store is open at the fork) and returns its exit code;
// the body returns 0 for success or a line number.
int InChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int rc = body();
    _exit(rc > 255 ? 255 : rc);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status);
}

#define CHILD_CHECK(cond) \
  do {                    \
    if (!(cond)) return __LINE__ % 250 + 1; \
  } while (0)

// Drops the capabilities that let root read and write any file (so a mode of 000 means what it says).
bool DropDacOverride() {
  if (geteuid() != 0) return true;
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  for (int cap : {CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH}) {
    data[cap / 32].effective &= ~(1u << (cap % 32));
  }
  return syscall(SYS_capset, &hdr, data) == 0;
}

}  // namespace

TEST_CASE("ssd store: a block file the daemon may not read is a clear PERMISSION_DENIED at open", "[unit][ssd]") {
  TempDir dir;
  const std::string path = dir.Sub("a");
  const auto opts = Options({path}, 8192, 8);
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
  }
  REQUIRE(::chmod(BlockFile(path).c_str(), 0) == 0);
  const int rc = InChild([&]() -> int {
    CHILD_CHECK(DropDacOverride());
    auto store = SsdStore::Open(opts);
    CHILD_CHECK(!store.ok());
    CHILD_CHECK(store.status().code() == StatusCode::kPermissionDenied);
    CHILD_CHECK(store.status().message().find(BlockFile(path)) != std::string::npos);
    CHILD_CHECK(store.status().message().find("read and write access") != std::string::npos);
    return 0;
  });
  CHECK(rc == 0);
  REQUIRE(::chmod(BlockFile(path).c_str(), 0600) == 0);
}

TEST_CASE("ssd store: a file that may not grow (EFBIG) fails Open, and a write past the limit fails with the "
          "caller's bytes untouched", "[unit][ssd]") {
  TempDir dir;
  const std::string path = dir.Sub("a");
  constexpr uint64_t kPayload = 65536;
  const auto opts = Options({path}, kPayload, 64);  // ~4.2 MiB
  // Preallocation refused: the file size limit is below the file.
  int rc = InChild([&]() -> int {
    signal(SIGXFSZ, SIG_IGN);
    rlimit lim{1 << 20, 1 << 20};
    CHILD_CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    auto store = SsdStore::Open(opts);
    CHILD_CHECK(!store.ok());
    CHILD_CHECK(store.status().code() == StatusCode::kResourceExhausted);
    CHILD_CHECK(store.status().message().find(BlockFile(path)) != std::string::npos);
    CHILD_CHECK(store.status().message().find("EFBIG") != std::string::npos);
    return 0;
  });
  CHECK(rc == 0);
  CHECK_FALSE(std::filesystem::exists(BlockFile(path)));  // removed again
  { REQUIRE(SsdStore::Open(opts).ok()); }  // created here, without the limit
  // Writes: the limit now cuts the file after 16 slots; the store writes slots in order, so the 17th write fails.
  rc = InChild([&]() -> int {
    signal(SIGXFSZ, SIG_IGN);
    const uint64_t limit = flexkv::kSsdHeaderSector + 16 * flexkv::SsdSlotStride(kPayload);
    rlimit lim{limit, limit};
    CHILD_CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    auto store = SsdStore::Open(opts);
    CHILD_CHECK(store.ok());
    AlignedBytes src(kPayload);
    Fill(src.span(0, kPayload), 77);
    std::vector<uint8_t> copy(src.data, src.data + kPayload);
    for (uint64_t i = 0; i < 16; ++i) CHILD_CHECK(WriteSync(**store, Id(i), src.span(0, kPayload)).ok());
    const Status st = WriteSync(**store, Id(16), src.span(0, kPayload));
    CHILD_CHECK(st.code() == StatusCode::kResourceExhausted);
    CHILD_CHECK(st.message().find(BlockFile(path)) != std::string::npos);
    CHILD_CHECK(st.message().find("offset") != std::string::npos);
    CHILD_CHECK(st.message().find("stays in DRAM") != std::string::npos);
    CHILD_CHECK(!(*store)->Lookup(Id(16)).has_value());
    CHILD_CHECK((*store)->stats().write_errors == 1);
    CHILD_CHECK(std::memcmp(copy.data(), src.data, kPayload) == 0);
    AlignedBytes dst(kPayload);
    CHILD_CHECK(ReadSync(**store, Id(5), dst.span(0, kPayload)).ok());
    CHILD_CHECK(std::memcmp(dst.data, src.data, kPayload) == 0);
    return 0;
  });
  CHECK(rc == 0);
}

TEST_CASE("ssd store: a drive too small for --ssd-size is a clear RESOURCE_EXHAUSTED (ENOSPC) at open",
          "[unit][ssd]") {
  // A real ENOSPC needs a small filesystem: an ext4 image on a loop device, which needs root and loop devices.
  TempDir dir;
  const std::string img = dir.path() + "/small.img";
  const std::string mnt = dir.Sub("mnt");
  const std::string setup = "truncate -s 16M " + img + " && mkfs.ext4 -q -F " + img + " >/dev/null 2>&1 && mount -o loop " +
                            img + " " + mnt + " 2>/dev/null";
  if (geteuid() != 0 || std::system(setup.c_str()) != 0) {
    WARN("cannot mount a small ext4 image here (needs root and loop devices): skipped");
    return;
  }
  struct Unmount {
    std::string m;
    ~Unmount() { (void)!std::system(("umount " + m).c_str()); }
  } unmount{mnt};
  auto opts = Options({mnt}, 65536, 512);  // ~34 MiB on a 16 MiB filesystem
  auto store = SsdStore::Open(opts);
  REQUIRE_FALSE(store.ok());
  CHECK(store.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(store.status().message(), Catch::Contains("ENOSPC") && Catch::Contains(mnt) &&
                                           Catch::Contains("lower --ssd-size"));
  CHECK_FALSE(std::filesystem::exists(BlockFile(mnt)));
  opts = Options({mnt}, 65536, 64);
  REQUIRE(SsdStore::Open(opts).ok());
}

TEST_CASE("ssd store: after kill -9 the reopened store serves every block whose write had completed", "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 8192;
  const auto opts = Options({dir.Sub("a"), dir.Sub("b")}, kPayload, 32);
  const pid_t pid = fork();  // no store is open here
  REQUIRE(pid >= 0);
  if (pid == 0) {
    auto store = SsdStore::Open(opts);
    if (!store.ok()) _exit(3);
    AlignedBytes src(kPayload);
    for (uint64_t i = 0; i < 40; ++i) {  // 40 blocks in 64 slots; the last ones may still be in flight at the kill
      Fill(src.span(0, kPayload), 7000 + i);
      if (i < 32) {
        if (!WriteSync(**store, Id(i), src.span(0, kPayload)).ok()) _exit(4);
      } else {
        static std::vector<std::unique_ptr<AlignedBytes>> keep;  // in flight at the kill: must stay valid
        keep.push_back(std::make_unique<AlignedBytes>(kPayload));
        std::memcpy(keep.back()->data, src.data, kPayload);
        (void)(*store)->Write(Id(i), BlockKey{}, keep.back()->span(0, kPayload), 0, [](Status) {});
      }
    }
    ::raise(SIGKILL);
    _exit(5);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  REQUIRE(WTERMSIG(status) == SIGKILL);
  ::sync();
  if (FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w")) {  // as after a reboot, where root may
    std::fputs("3\n", f);
    std::fclose(f);
  }
  auto store = SsdStore::Open(opts);
  INFO(store.status().ToString());
  REQUIRE(store.ok());
  CHECK((*store)->rebuild_report().blocks >= 32);
  CHECK((*store)->rebuild_report().corrupt_headers == 0);
  AlignedBytes want(kPayload), got(kPayload);
  for (uint64_t i = 0; i < 40; ++i) {
    if (!(*store)->Lookup(Id(i)).has_value()) {
      CHECK(i >= 32);  // only a write that had not completed may be missing
      continue;
    }
    INFO("block " << i);
    Fill(want.span(0, kPayload), 7000 + i);
    REQUIRE(ReadSync(**store, Id(i), got.span(0, kPayload)).ok());
    CHECK(std::memcmp(want.data, got.data, kPayload) == 0);
  }
  CHECK((*store)->stats().data_loss_blocks == 0);
}

TEST_CASE("ssd store: a directory standing where the block file should be is a clear error", "[unit][ssd]") {
  TempDir dir;
  const std::string path = dir.Sub("a");
  std::filesystem::create_directories(BlockFile(path));
  auto store = SsdStore::Open(Options({path}, 4096, 4));
  REQUIRE_FALSE(store.ok());
  CHECK(store.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(store.status().message(), Catch::Contains(BlockFile(path)) && Catch::Contains("remove it"));
  auto missing = SsdStore::Open(Options({dir.path() + "/nope"}, 4096, 4));
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK_THAT(missing.status().message(), Catch::Contains("does not exist"));
}

TEST_CASE("ssd store: one key in another component or domain is another block", "[unit][ssd]") {
  TempDir dir;
  auto opts = Options({dir.Sub("a")}, 8192, 8);
  opts.sync_writes = true;  // O_DSYNC: the same contract, slower
  auto store = SsdStore::Open(opts);
  REQUIRE(store.ok());
  const SsdBlockId ids[] = {Id(1, kDomain, 0), Id(1, kDomain, 1), Id(1, kOtherDomain, 0)};
  AlignedBytes src(3 * 8192), dst(8192);
  for (int i = 0; i < 3; ++i) {
    Fill(src.span(i * 8192, 8192), 40 + static_cast<uint64_t>(i));
    REQUIRE(WriteSync(**store, ids[i], src.span(i * 8192, 8192)).ok());
  }
  for (int i = 0; i < 3; ++i) {
    REQUIRE(ReadSync(**store, ids[i], dst.span(0, 8192)).ok());
    CHECK(std::memcmp(dst.data, src.data + i * 8192, 8192) == 0);
  }
  CHECK((*store)->stats().blocks == 3);
}

TEST_CASE("ssd store: a key found in two slots at rebuild keeps the newer generation and clears the older",
          "[unit][ssd]") {
  TempDir dir;
  constexpr uint64_t kPayload = 8192;
  const std::string path = dir.Sub("a");
  const auto opts = Options({path}, kPayload, 8);
  AlignedBytes src(kPayload), dst(kPayload);
  Fill(src.span(0, kPayload), 99);
  uint64_t generation = 0;
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    REQUIRE(WriteSync(**store, Id(1), src.span(0, kPayload)).ok());
    generation = (*store)->Lookup(Id(1))->generation;
  }
  // A later write of the same key into another slot (as after an eviction and a new write-back), whose header made it
  // while the old slot's header was never cleared (a crash in between).
  const uint64_t stride = flexkv::SsdSlotStride(kPayload);
  const int64_t old_slot = SlotOf(BlockFile(path), kPayload, Id(1), 8);
  REQUIRE(old_slot >= 0);
  const uint64_t new_slot = old_slot == 5 ? 6 : 5;
  auto bytes = ReadFile(BlockFile(path), flexkv::kSsdHeaderSector + static_cast<uint64_t>(old_slot) * stride, stride);
  std::span<uint8_t, flexkv::kSsdHeaderSector> sec(bytes.data(), flexkv::kSsdHeaderSector);
  flexkv::SsdSlotHeader h = flexkv::DecodeSlotHeader(sec).header;
  h.slot = new_slot;
  h.generation = generation + 5;
  flexkv::EncodeSlotHeader(h, sec);
  PatchFile(BlockFile(path), flexkv::kSsdHeaderSector + new_slot * stride, bytes.data(), bytes.size());
  {
    auto store = SsdStore::Open(opts);
    REQUIRE(store.ok());
    CHECK((*store)->rebuild_report().superseded == 1);
    CHECK((*store)->rebuild_report().blocks == 1);
    REQUIRE((*store)->Lookup(Id(1)).has_value());
    CHECK((*store)->Lookup(Id(1))->generation == generation + 5);
    REQUIRE(ReadSync(**store, Id(1), dst.span(0, kPayload)).ok());
    CHECK(std::memcmp(dst.data, src.data, kPayload) == 0);
    // New writes get generations above it.
    REQUIRE(WriteSync(**store, Id(2), src.span(0, kPayload)).ok());
    CHECK((*store)->Lookup(Id(2))->generation > generation + 5);
  }
  CHECK(SlotOf(BlockFile(path), kPayload, Id(1), 8) == static_cast<int64_t>(new_slot));  // the older header is gone
}

// The SSD tier in a real flexkvd (issue 15, acceptance): block files on a disk filesystem (/var/tmp), engines in
// other processes (flexkv-test-client) that store and then load and compare every byte. More blocks than DRAM
// holds come back byte exact through promotion (long prompts and many short ones: write-back keeps up when paced);
// kill -9 under write-backs and a "reboot" (pool file deleted, page cache dropped) serve only right bytes; corrupted
// and truncated block files are never served (the rest is); a bad --ssd-path stops the start with a clear error and
// loses nothing that was in DRAM; a read error under the running daemon ends the hit there and the daemon serves on;
// more blocks than the SSD holds overwrite the oldest, never serving them; a full drive under the running daemon
// fails write-backs, not stores.
#include <fcntl.h>
#include <linux/falloc.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::FlexkvctlPath;
using flexkv::testing::FlexkvdPath;
using flexkv::testing::RunCommand;
using flexkv::testing::TestClientPath;

namespace {

constexpr uint64_t kTmpfsMagic = 0x01021994;
constexpr char kNamespace[] = "test-model";  // the test client's default namespace
constexpr uint32_t kBlocks = 8;              // blocks per seed (a prompt of 8 blocks of 16 tokens)
constexpr uint64_t kSector = 4096;
constexpr char kBlockFile[] = "flexkv-ssd.blocks";

// A fresh directory on a disk filesystem (not tmpfs) for a daemon's socket, pool file and SSD block file
// (`ssd()`), mode 0755; removed at the end.
class SsdDir {
 public:
  SsdDir() {
    struct statfs s {};
    REQUIRE(statfs("/var/tmp", &s) == 0);
    REQUIRE(static_cast<uint64_t>(s.f_type) != kTmpfsMagic);
    char tmpl[] = "/var/tmp/flexkv-ssd-it-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path_ = tmpl;
    std::filesystem::permissions(path_, std::filesystem::perms(0755));
    std::filesystem::create_directories(ssd());
  }
  ~SsdDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  SsdDir(const SsdDir&) = delete;
  SsdDir& operator=(const SsdDir&) = delete;
  const std::string& path() const { return path_; }
  std::string ssd() const { return path_ + "/ssd"; }
  std::string block_file() const { return ssd() + "/" + kBlockFile; }
  std::string pool() const { return path_ + "/pool"; }

 private:
  std::string path_;
};

// flexkvd's arguments: an 8 MiB pool (64 blocks of 128 KiB for the test client's --layers 2) and a 64 MiB SSD tier
// in `dir` (496 slots).
std::vector<std::string> SsdArgs(const SsdDir& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--pool-size", "8MiB", "--ssd-path", dir.ssd(), "--ssd-size", "64MiB"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// An engine process (flexkv-test-client) of 2 layers (128 KiB blocks) with 64 KV blocks.
ChildProcess Engine(const DaemonUnderTest& d, const std::string& name, const std::vector<std::string>& steps) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", d.socket(), "--name", name,
                                   "--layers",       "2",        "--kv-blocks", "64"};
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

// An engine of 2 layers whose prompts all start with the `prefix_blocks` blocks of `prefix_seed` (a shared system
// prompt; flexkv-test-client --prefix-seed), with `kv_blocks` KV blocks.
ChildProcess PrefixEngine(const DaemonUnderTest& d, const std::string& name, uint64_t prefix_seed,
                          uint32_t prefix_blocks, const std::vector<std::string>& steps, uint32_t kv_blocks = 64) {
  std::vector<std::string> argv = {TestClientPath(), "--socket",   d.socket(), "--name", name, "--layers", "2",
                                   "--kv-blocks",    std::to_string(kv_blocks), "--prefix-seed", std::to_string(prefix_seed),
                                   "--prefix-blocks", std::to_string(prefix_blocks)};
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

// The engine's lines after ATTACHED, once it exits.
std::vector<std::string> Run(ChildProcess p) {
  std::vector<std::string> out;
  while (auto line = p.ReadLine(30s)) {
    if (line->rfind("ATTACHED", 0) != 0) out.push_back(*line);
  }
  return out;
}

std::string fmt_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

struct Loaded {
  uint32_t hits = 0, loaded = 0;
  int equal = -1;
  std::string status;
};

// A "LOADED <hits> <loaded> <equal> <STATUS>" line.
Loaded ParseLoaded(const std::string& line) {
  Loaded l;
  char status[64] = {};
  INFO(line);
  REQUIRE(std::sscanf(line.c_str(), "LOADED %u %u %d %63s", &l.hits, &l.loaded, &l.equal, status) == 4);
  l.status = status;
  return l;
}

std::string LoadSteps(uint64_t seed, uint32_t n = kBlocks) { return "load:" + std::to_string(seed) + ":" + std::to_string(n); }
std::string StoreStep(uint64_t seed, uint32_t n = kBlocks) {
  return "store:" + std::to_string(seed) + ":" + std::to_string(n);
}

// One process loads every seed of `seeds` (in that order); returns its LOADED lines, one per seed.
std::vector<Loaded> LoadAll(const DaemonUnderTest& d, const std::vector<uint64_t>& seeds, const std::string& name,
                            uint32_t n = kBlocks) {
  std::vector<std::string> steps;
  for (uint64_t s : seeds) steps.push_back(LoadSteps(s, n));
  const std::vector<std::string> lines = Run(Engine(d, name, steps));
  INFO(fmt_lines(lines));
  REQUIRE(lines.size() == seeds.size());
  std::vector<Loaded> out;
  for (const auto& line : lines) out.push_back(ParseLoaded(line));
  return out;
}

flexkv::DaemonStatus Status(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto s = (*c)->GetStatus();
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  return *s;
}

const flexkv::DaemonStatus::Tier& Ssd(const flexkv::DaemonStatus& s) {
  REQUIRE(s.tiers.size() == 1);
  REQUIRE(s.tiers[0].name == "ssd");
  return s.tiers[0];
}

uint64_t Counter(const flexkv::DaemonStatus::Tier& t, const std::string& name) {
  INFO("SSD tier counter " << name);
  REQUIRE(t.counters.contains(name));
  return t.counters.at(name);
}

std::string TierText(const flexkv::DaemonStatus::Tier& t) {
  std::string out = t.name + " " + t.state + " used " + std::to_string(t.used_blocks) + "/" +
                    std::to_string(t.capacity_blocks) + ":";
  for (const auto& [k, v] : t.counters) out += " " + k + "=" + std::to_string(v);
  return out;
}

// Waits (up to 30 s) until the SSD tier has no write in flight and its written_back_blocks has not moved over a few
// polls (the mover has caught up with the last store); returns that status.
flexkv::DaemonStatus SettledStatus(const DaemonUnderTest& d) {
  uint64_t last_written = UINT64_MAX;
  int stable = 0;
  for (int i = 0; i < 1500; ++i) {
    flexkv::DaemonStatus s = Status(d);
    const auto& t = Ssd(s);
    const uint64_t written = Counter(t, "written_back_blocks");
    if (t.state == "serving" && Counter(t, "writes_in_flight") == 0 && written == last_written) {
      if (++stable >= 3) return s;
    } else {
      stable = 0;
    }
    last_written = written;
    std::this_thread::sleep_for(20ms);
  }
  FAIL("the SSD tier's writes did not settle within 30 s");
  return {};
}

// Loads each seed from a process of its own, one at a time, each once the mover has settled: the cold policy
// writes ahead of eviction, and a burst of promotions larger than its window may evict blocks it has not written
// yet (counted, by design); paced, none is.
std::vector<Loaded> LoadPaced(const DaemonUnderTest& d, const std::vector<uint64_t>& seeds, const std::string& name,
                              uint32_t n = kBlocks) {
  std::vector<Loaded> out;
  for (uint64_t s : seeds) {
    std::vector<Loaded> one = LoadAll(d, {s}, name, n);
    out.push_back(one.at(0));
    (void)SettledStatus(d);
  }
  return out;
}

// Waits (up to 30 s) until the restored DRAM blocks are verified (served from then on).
flexkv::DaemonStatus VerifiedStatus(const DaemonUnderTest& d) {
  for (int i = 0; i < 600; ++i) {
    flexkv::DaemonStatus s = Status(d);
    if (s.pool.unverified_blocks == 0) return s;
    std::this_thread::sleep_for(50ms);
  }
  FAIL("the restored blocks were not verified within 30 s");
  return {};
}

// Stores SEED (n blocks) from its own process; a store may find every DRAM slot pinned by
// writes (RESOURCE_EXHAUSTED), which an engine retries: returns once all n are cached.
void StoreSeed(const DaemonUnderTest& d, uint64_t seed, const std::string& name, uint32_t n = kBlocks) {
  std::string last;
  for (int attempt = 0; attempt < 200; ++attempt) {
    const std::vector<std::string> lines = Run(Engine(d, name, {StoreStep(seed, n)}));
    REQUIRE(lines.size() == 1);
    last = lines[0];
    unsigned cached = 0, stored = 0;
    char status[64] = {};
    INFO(last);
    REQUIRE(std::sscanf(last.c_str(), "STORED %u %u %63s", &cached, &stored, status) == 3);
    if (std::string(status) == "OK") {
      CHECK(cached + stored == n);
      return;
    }
    REQUIRE(std::string(status) == "RESOURCE_EXHAUSTED");
    std::this_thread::sleep_for(20ms);
  }
  FAIL("store of seed " << seed << " kept failing: " << last);
}

// The test client's tokens of SEED (tests/support/test_client.cc), for keys computed here.
std::vector<int32_t> Tokens(uint64_t seed, uint32_t blocks, uint32_t tokens_per_block) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(uint64_t{blocks} * tokens_per_block);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 128000);
  return t;
}

std::vector<flexkv::BlockKey> KeysOf(uint64_t seed) {
  return flexkv::ComputeBlockKeys(kNamespace, Tokens(seed, kBlocks, 16), 16);
}

uint64_t U64At(const std::vector<uint8_t>& b, size_t off) {
  uint64_t v = 0;
  std::memcpy(&v, b.data() + off, 8);
  return v;
}

// The block file's layout (docs/ssd.md, format version 1) and which block of which seed each slot holds.
struct BlockFileMap {
  uint64_t stride = 0, slots = 0, file_bytes = 0;
  struct Where {
    uint64_t seed;
    uint32_t index;
  };
  std::map<uint64_t, Where> slot_of;  // slot -> the block it holds (only the seeds asked for)
  uint64_t SlotOffset(uint64_t slot) const { return kSector + slot * stride; }
  std::optional<uint64_t> Find(uint64_t seed, uint32_t index) const {
    for (const auto& [slot, w] : slot_of) {
      if (w.seed == seed && w.index == index) return slot;
    }
    return std::nullopt;
  }
};

BlockFileMap MapBlockFile(const std::string& path, const std::vector<uint64_t>& seeds) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::vector<uint8_t> header(kSector);
  REQUIRE(in.read(reinterpret_cast<char*>(header.data()), kSector).good());
  REQUIRE(std::memcmp(header.data(), "FKVSSDF1", 8) == 0);
  BlockFileMap m;
  m.stride = U64At(header, 32);
  m.slots = U64At(header, 40);
  m.file_bytes = std::filesystem::file_size(path);
  REQUIRE(m.stride == kSector + 128 * 1024);  // a 4 KiB header sector and a 128 KiB payload
  std::map<std::pair<uint64_t, uint64_t>, BlockFileMap::Where> wanted;
  for (uint64_t seed : seeds) {
    const auto keys = KeysOf(seed);
    for (uint32_t i = 0; i < keys.size(); ++i) wanted[{keys[i].lo, keys[i].hi}] = {seed, i};
  }
  std::vector<uint8_t> slot_header(kSector);
  for (uint64_t s = 0; s < m.slots; ++s) {
    in.seekg(static_cast<std::streamoff>(m.SlotOffset(s)));
    if (!in.read(reinterpret_cast<char*>(slot_header.data()), kSector)) break;
    if (std::memcmp(slot_header.data(), "FKVSSDB1", 8) != 0) continue;
    auto it = wanted.find({U64At(slot_header, 40), U64At(slot_header, 48)});
    if (it != wanted.end()) m.slot_of[s] = it->second;
  }
  return m;
}

// XORs 0xFF into `len` bytes of `path` at `offset`.
void FlipBytes(const std::string& path, uint64_t offset, size_t len) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  std::vector<char> b(len);
  f.seekg(static_cast<std::streamoff>(offset));
  REQUIRE(f.read(b.data(), static_cast<std::streamsize>(len)).good());
  for (auto& c : b) c = static_cast<char>(c ^ 0xFF);
  f.seekp(static_cast<std::streamoff>(offset));
  REQUIRE(f.write(b.data(), static_cast<std::streamsize>(len)).good());
}

// As after a reboot: nothing of the block file left in the page cache (where this process may).
void DropCaches() {
  ::sync();
  if (FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w")) {
    std::fputs("3\n", f);
    std::fclose(f);
  } else {
    WARN("cannot drop the page cache (not root): the restart reads what the page cache holds");
  }
}

void StopDaemon(DaemonUnderTest& d, int sig) {
  d.process().Signal(sig);
  const std::optional<int> status = d.process().Wait(20s);
  REQUIRE(status.has_value());
  if (sig == SIGKILL) {
    CHECK(WIFSIGNALED(*status));
  } else {
    INFO(d.process().Stderr());
    CHECK((WIFEXITED(*status) && WEXITSTATUS(*status) == 0));
  }
}

std::vector<uint64_t> Seeds(uint64_t first, uint64_t last) {
  std::vector<uint64_t> v;
  for (uint64_t s = first; s <= last; ++s) v.push_back(s);
  return v;
}

// Part of test 1: A stores 24 seeds x 8 blocks (3 times DRAM) paced by the mover, B loads them all.
void StoreThreeDramsThenLoadElsewhere(bool write_all) {
  SsdDir dir;
  DaemonUnderTest d(SsdArgs(dir, write_all ? std::vector<std::string>{"--ssd-write-policy", "all"}
                                           : std::vector<std::string>{"--ssd-write-policy", "cold"}),
                    dir.path());
  REQUIRE(d.WaitReady());
  constexpr uint64_t kSeeds = 24;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    StoreSeed(d, seed, "engine-a");
    (void)SettledStatus(d);  // paced: the mover catches up before the next store
  }
  const flexkv::DaemonStatus stored = SettledStatus(d);
  const auto& st = Ssd(stored);
  INFO("after A: " << TierText(st));
  REQUIRE(stored.pool.capacity_blocks == 64);  // 192 blocks stored: 3 times what DRAM holds
  CHECK(stored.pool.used_blocks <= 64);
  CHECK(st.state == "serving");
  CHECK(st.block_bytes == 128 * 1024);
  CHECK(st.capacity_blocks == (64ULL << 20) / (kSector + 128 * 1024));
  CHECK(Counter(st, "evicted_unwritten_blocks") == 0);
  CHECK(Counter(st, "evicted_written_blocks") >= kSeeds * kBlocks - 64);
  CHECK(st.used_blocks >= kSeeds * kBlocks - 64);  // every block DRAM no longer holds is on SSD
  if (write_all) CHECK(Counter(st, "written_back_blocks") == kSeeds * kBlocks);

  // B, another process, loads every seed, oldest first: the 16 oldest seeds only exist on SSD. (With the cold
  // policy paced: see LoadPaced.)
  const std::vector<Loaded> loads =
      write_all ? LoadAll(d, Seeds(1, kSeeds), "engine-b") : LoadPaced(d, Seeds(1, kSeeds), "engine-b");
  for (size_t i = 0; i < loads.size(); ++i) {
    INFO("seed " << i + 1);
    CHECK(loads[i].hits == kBlocks);
    CHECK(loads[i].loaded == kBlocks);
    CHECK(loads[i].equal == 1);
    CHECK(loads[i].status == "OK");
  }
  const flexkv::DaemonStatus after = Status(d);
  const auto& t = Ssd(after);
  INFO("after B: " << TierText(t));
  CHECK(Counter(t, "promoted_blocks") >= (kSeeds * kBlocks - 64));  // at least every block not in DRAM
  CHECK(Counter(t, "promotion_failed_blocks") == 0);
  CHECK(Counter(t, "data_loss_blocks") == 0);
  CHECK(Counter(t, "read_errors") == 0);
  CHECK(Counter(t, "evicted_unwritten_blocks") == 0);
}

}  // namespace

TEST_CASE("ssd tier: engine A stores more blocks than DRAM holds, engine B loads all of them byte exact, the older "
          "through promotion",
          "[integration][ssd_tier]") {
  SECTION("write policy cold (the default): the cold end ahead of eviction") { StoreThreeDramsThenLoadElsewhere(false); }
  SECTION("write policy all: every stored block") { StoreThreeDramsThenLoadElsewhere(true); }
}

TEST_CASE("ssd tier: write-back of the cold end keeps up with many short prompts - paced, none is evicted unwritten",
          "[integration][ssd_tier]") {
  // 40 prompts of 4 blocks, one store at a time, each only once the mover has settled: every store evicts at most 4
  // blocks, far less than the write-back window (25% of 64 slots: 16 blocks), so each eviction must find its block
  // on SSD already. DRAM holds 16 of the prompts; the other 24 must come back from SSD.
  SsdDir dir;
  DaemonUnderTest d(SsdArgs(dir, {"--ssd-write-policy", "cold"}), dir.path());
  REQUIRE(d.WaitReady());
  constexpr uint64_t kSeeds = 40;
  constexpr uint32_t kShort = 4;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    StoreSeed(d, seed, "engine-a", kShort);
    (void)SettledStatus(d);
  }
  const flexkv::DaemonStatus stored = SettledStatus(d);
  const auto& st = Ssd(stored);
  INFO("after A: " << TierText(st));
  REQUIRE(stored.pool.capacity_blocks == 64);
  CHECK(Counter(st, "evicted_written_blocks") + Counter(st, "evicted_unwritten_blocks") == kSeeds * kShort - 64);
  CHECK(Counter(st, "evicted_unwritten_blocks") == 0);
  const std::vector<Loaded> loads = LoadPaced(d, Seeds(1, kSeeds), "engine-b", kShort);
  size_t full = 0;
  for (size_t i = 0; i < loads.size(); ++i) {
    INFO("seed " << i + 1);
    CHECK(loads[i].equal == 1);
    CHECK(loads[i].hits == kShort);
    if (loads[i].hits == kShort) ++full;
  }
  CHECK(full == kSeeds);
}

TEST_CASE("ssd tier: kill -9 under stores and write-backs, restart serves only right bytes", "[integration][ssd_tier]") {
  const bool reboot = GENERATE(false, true);
  INFO((reboot ? "reboot: pool file deleted, page cache dropped, write policy all" : "kill -9, pool file kept, write policy cold"));
  SsdDir dir;
  const std::vector<std::string> args =
      SsdArgs(dir, reboot ? std::vector<std::string>{"--ssd-write-policy=all"}
                          : std::vector<std::string>{"--ssd-write-policy=cold"});
  // Seeds 1..6 are known on SSD before the storm: paced stores of 1..14 push them out of DRAM with none evicted
  // unwritten (so SSD holds all of them). The storm then adds at most 40 x 8 blocks: 112 + 320 < 496 slots, so
  // nothing known is overwritten on SSD.
  const std::vector<uint64_t> known = Seeds(1, 6);
  const std::vector<uint64_t> paced = Seeds(1, 14);
  const std::vector<uint64_t> storm = Seeds(1000, 1039);
  {
    DaemonUnderTest d(args, dir.path());
    REQUIRE(d.WaitReady());
    for (uint64_t seed : paced) {
      StoreSeed(d, seed, "engine-paced");
      (void)SettledStatus(d);
    }
    const flexkv::DaemonStatus before = SettledStatus(d);
    INFO("before the storm: " << TierText(Ssd(before)));
    REQUIRE(Counter(Ssd(before), "evicted_unwritten_blocks") == 0);
    REQUIRE(Counter(Ssd(before), "evicted_written_blocks") >= known.size() * kBlocks);

    std::vector<std::string> steps;
    for (uint64_t seed : storm) steps.push_back(StoreStep(seed));
    ChildProcess writer = Engine(d, "engine-storm", steps);
    int stored = 0;
    while (stored < 15) {
      auto line = writer.ReadLine(30s);
      REQUIRE(line.has_value());
      if (line->rfind("STORED", 0) == 0) ++stored;
    }
    const flexkv::DaemonStatus mid = Status(d);
    INFO("at the kill: " << TierText(Ssd(mid)));
    StopDaemon(d, SIGKILL);  // mid-stream: stores and SSD writes in flight
    writer.Signal(SIGKILL);
    (void)writer.Wait(5s);
  }
  if (reboot) {
    REQUIRE(std::filesystem::remove(dir.pool()));
    DropCaches();
  }
  {
    DaemonUnderTest d(args, dir.path());
    REQUIRE(d.WaitReady());
    const flexkv::DaemonStatus restarted = VerifiedStatus(d);
    const auto& t = Ssd(restarted);
    INFO("restarted: " << TierText(t));
    CHECK(t.state == "serving");  // opened at start from the block file
    CHECK(Counter(t, "rebuilt_blocks") >= known.size() * kBlocks);
    CHECK(Counter(t, "rebuild_corrupt_headers") == 0);
    std::vector<uint64_t> all = paced;
    all.insert(all.end(), storm.begin(), storm.end());
    const std::vector<Loaded> loads = LoadAll(d, all, "engine-reader");
    size_t full = 0;
    for (size_t i = 0; i < loads.size(); ++i) {
      INFO("seed " << all[i] << ": hits " << loads[i].hits << " loaded " << loads[i].loaded);
      CHECK(loads[i].equal == 1);  // never a wrong byte
      CHECK(loads[i].status == "OK");
      CHECK(loads[i].loaded == loads[i].hits);
      if (loads[i].hits == kBlocks) ++full;
      if (i < known.size()) CHECK(loads[i].hits == kBlocks);  // written before the kill: all of it
    }
    CHECK(full >= known.size());
    const flexkv::DaemonStatus after = Status(d);
    INFO("after the loads: " << TierText(Ssd(after)));
    CHECK(Counter(Ssd(after), "promoted_blocks") >= known.size() * kBlocks);
  }
}

TEST_CASE("ssd tier: corrupted and truncated block files are not served, the rest is", "[integration][ssd_tier]") {
  SsdDir dir;
  const std::vector<std::string> args = SsdArgs(dir, {"--ssd-write-policy=all"});
  const std::vector<uint64_t> seeds = Seeds(1, 12);
  {
    DaemonUnderTest d(args, dir.path());
    REQUIRE(d.WaitReady());
    for (uint64_t seed : seeds) StoreSeed(d, seed, "engine-a");
    const flexkv::DaemonStatus s = SettledStatus(d);
    INFO(TierText(Ssd(s)));
    REQUIRE(Counter(Ssd(s), "written_back_blocks") == seeds.size() * kBlocks);
    StopDaemon(d, SIGTERM);
  }
  REQUIRE(std::filesystem::remove(dir.pool()));  // the blocks now only exist on SSD

  const BlockFileMap map = MapBlockFile(dir.block_file(), seeds);
  REQUIRE(map.slot_of.size() == seeds.size() * kBlocks);  // every block in its own slot
  // Damage: a payload byte range of seed 3's first block and of seed 5's block 4; the header of seed 7's block 2;
  // and the file cut through the highest used slot's payload.
  const uint64_t payload_a = *map.Find(3, 0), payload_b = *map.Find(5, 4), header_c = *map.Find(7, 2);
  const uint64_t last_slot = map.slot_of.rbegin()->first;
  const BlockFileMap::Where cut = map.slot_of.rbegin()->second;
  INFO("cut: seed " << cut.seed << " block " << cut.index << " in slot " << last_slot);
  REQUIRE(cut.seed != 3);
  REQUIRE(cut.seed != 5);
  REQUIRE(cut.seed != 7);
  FlipBytes(dir.block_file(), map.SlotOffset(payload_a) + kSector + 1000, 16);
  FlipBytes(dir.block_file(), map.SlotOffset(payload_b) + kSector + 64 * 1024, 16);
  FlipBytes(dir.block_file(), map.SlotOffset(header_c) + 44, 4);  // inside the key
  REQUIRE(truncate(dir.block_file().c_str(), static_cast<off_t>(map.SlotOffset(last_slot) + kSector + 512)) == 0);
  DropCaches();

  std::map<uint64_t, uint32_t> expected;  // seed -> its hits: up to its first damaged block
  for (uint64_t s : seeds) expected[s] = kBlocks;
  expected[3] = 0;
  expected[5] = 4;
  expected[7] = 2;
  expected[cut.seed] = std::min(expected[cut.seed], cut.index);

  DaemonUnderTest d(args, dir.path());
  REQUIRE(d.WaitReady());
  {
    const flexkv::DaemonStatus s = Status(d);
    const auto& t = Ssd(s);
    INFO("restarted: " << TierText(t));
    CHECK(t.state == "serving");
    CHECK(Counter(t, "rebuild_corrupt_headers") >= 1);
    CHECK(Counter(t, "rebuild_truncated") >= 1);
    CHECK(Counter(t, "rebuilt_blocks") == seeds.size() * kBlocks - 2);  // the torn header and the cut slot
  }
  for (int round = 0; round < 2; ++round) {  // the second time, the dropped blocks are gone for good
    const std::vector<Loaded> loads = LoadAll(d, seeds, "engine-b");
    size_t full = 0;
    for (size_t i = 0; i < seeds.size(); ++i) {
      INFO("round " << round << " seed " << seeds[i]);
      CHECK(loads[i].equal == 1);
      CHECK(loads[i].status == "OK");
      CHECK(loads[i].hits == expected[seeds[i]]);
      if (loads[i].hits == kBlocks) ++full;
    }
    size_t undamaged = 0;
    for (const auto& [seed, hits] : expected) undamaged += hits == kBlocks ? 1 : 0;
    CHECK(full == undamaged);
    CHECK(undamaged >= seeds.size() - 4);
  }
  const flexkv::DaemonStatus s = Status(d);
  const auto& t = Ssd(s);
  INFO("after the loads: " << TierText(t));
  CHECK(Counter(t, "data_loss_blocks") >= 2);        // the two flipped payloads
  CHECK(Counter(t, "promotion_failed_blocks") >= 2);
  CHECK(Counter(t, "promoted_blocks") >= (seeds.size() - 4) * kBlocks);
}

TEST_CASE("ssd tier: O_DIRECT refused, missing path and a full drive stop the start with a clear error",
          "[integration][ssd_tier]") {
  SsdDir dir;
  const std::string socket = dir.path() + "/flexkvd.sock";
  auto flexkvd = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {FlexkvdPath(), "--socket", socket, "--pool-path", dir.pool(), "--pool-size",
                                     "8MiB"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunCommand(argv, 30s);
  };

  SECTION("tmpfs is refused, and used buffered with --ssd-allow-buffered") {
    struct statfs shm {};
    if (statfs("/dev/shm", &shm) != 0 || static_cast<uint64_t>(shm.f_type) != kTmpfsMagic) {
      WARN("no tmpfs at /dev/shm: skipped");
      return;
    }
    char tmpl[] = "/dev/shm/flexkv-ssd-it-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    struct Remove {
      std::string p;
      ~Remove() {
        std::error_code ec;
        std::filesystem::remove_all(p, ec);
      }
    } remove{tmpl};
    const flexkv::testing::CommandResult refused = flexkvd({"--ssd-path", tmpl, "--ssd-size", "64MiB"});
    INFO(refused.output);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.output, Catch::Contains("cannot use the SSD tier") && Catch::Contains("FAILED_PRECONDITION") &&
                                   Catch::Contains("tmpfs") && Catch::Contains("--ssd-allow-buffered") &&
                                   Catch::Contains(tmpl));
    CHECK_FALSE(std::filesystem::exists(std::string(tmpl) + "/" + kBlockFile));

    DaemonUnderTest d({"--pool-size", "8MiB", "--ssd-path", tmpl, "--ssd-size", "64MiB", "--ssd-allow-buffered"},
                      dir.path());
    REQUIRE(d.WaitReady());
    CHECK(Run(Engine(d, "engine-a", {"store:1:8"})) == std::vector<std::string>{"STORED 0 8 OK"});
    CHECK(Run(Engine(d, "engine-b", {"load:1:8"})) == std::vector<std::string>{"LOADED 8 8 1 OK"});
    // The block files exist once the first pool does; status shows them buffered.
    flexkv::DaemonStatus s = Status(d);
    for (int i = 0; i < 1500 && Ssd(s).files.empty(); ++i) {
      std::this_thread::sleep_for(20ms);
      s = Status(d);
    }
    const auto& t = Ssd(s);
    REQUIRE(t.files.size() == 1);
    CHECK(t.files[0].direct_io == false);
    CHECK(t.files[0].filesystem == "tmpfs");
    const flexkv::testing::CommandResult status = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "status"});
    INFO(status.output);
    CHECK(status.exit_code == 0);
    CHECK_THAT(status.output, Catch::Contains("BUFFERED I/O") && Catch::Contains(std::string(tmpl) + "/" + kBlockFile));
    CHECK_THAT(d.process().Stderr(), Catch::Contains("buffered"));
  }

  SECTION("a missing path is NOT_FOUND") {
    const std::string missing = dir.path() + "/no-such-dir";
    const flexkv::testing::CommandResult refused = flexkvd({"--ssd-path", missing, "--ssd-size", "64MiB"});
    INFO(refused.output);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.output, Catch::Contains("cannot use the SSD tier") && Catch::Contains("NOT_FOUND") &&
                                   Catch::Contains(missing));
    CHECK_FALSE(std::filesystem::exists(missing));
  }

  SECTION("--ssd-size above the free space is RESOURCE_EXHAUSTED, and no file is left") {
    struct statfs s {};
    REQUIRE(statfs(dir.ssd().c_str(), &s) == 0);
    const uint64_t free_bytes = static_cast<uint64_t>(s.f_bavail) * s.f_bsize;
    const uint64_t ask_gib = free_bytes / (1ULL << 30) * 4 + 1024;  // well above what is free
    const flexkv::testing::CommandResult refused =
        flexkvd({"--ssd-path", dir.ssd(), "--ssd-size", std::to_string(ask_gib) + "GiB"});
    INFO(refused.output);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.output, Catch::Contains("cannot use the SSD tier") && Catch::Contains("RESOURCE_EXHAUSTED") &&
                                   Catch::Contains(dir.ssd()));
    CHECK_FALSE(std::filesystem::exists(dir.block_file()));
  }

  SECTION("a refused start loses nothing that was in DRAM") {
    const std::vector<uint64_t> seeds = Seeds(1, 4);
    {
      DaemonUnderTest d({"--pool-size", "8MiB"}, dir.path());
      REQUIRE(d.WaitReady());
      for (uint64_t seed : seeds) {
        CHECK(Run(Engine(d, "engine-a", {StoreStep(seed)})) == std::vector<std::string>{"STORED 0 8 OK"});
      }
      StopDaemon(d, SIGTERM);
    }
    REQUIRE(std::filesystem::exists(dir.pool()));
    const auto pool_bytes = std::filesystem::file_size(dir.pool());
    const std::string missing = dir.path() + "/no-such-dir";
    const flexkv::testing::CommandResult refused = flexkvd({"--ssd-path", missing, "--ssd-size", "64MiB"});
    INFO(refused.output);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.output, Catch::Contains("NOT_FOUND"));
    REQUIRE(std::filesystem::exists(dir.pool()));
    CHECK(std::filesystem::file_size(dir.pool()) == pool_bytes);
    {
      DaemonUnderTest d({"--pool-size", "8MiB"}, dir.path());  // without the SSD tier: the pool is re-attached
      REQUIRE(d.WaitReady());
      (void)VerifiedStatus(d);
      const std::vector<Loaded> loads = LoadAll(d, seeds, "engine-b");
      for (const Loaded& l : loads) {
        CHECK(l.hits == kBlocks);
        CHECK(l.equal == 1);
      }
      StopDaemon(d, SIGTERM);
    }
    {
      DaemonUnderTest d(SsdArgs(dir), dir.path());  // with a good --ssd-path: the same blocks, and the tier opened
      REQUIRE(d.WaitReady());
      (void)VerifiedStatus(d);
      const std::vector<Loaded> loads = LoadAll(d, seeds, "engine-b");
      for (const Loaded& l : loads) {
        CHECK(l.hits == kBlocks);
        CHECK(l.equal == 1);
      }
      CHECK(Ssd(Status(d)).state == "serving");
      CHECK(std::filesystem::exists(dir.block_file()));
    }
  }
}

TEST_CASE("ssd tier: a read error under the running daemon ends the hit there and the daemon serves on",
          "[integration][ssd_tier]") {
  SsdDir dir;
  DaemonUnderTest d(SsdArgs(dir, {"--ssd-write-policy=all"}), dir.path());
  REQUIRE(d.WaitReady());
  const std::vector<uint64_t> ssd_only = Seeds(1, 8), in_dram = Seeds(9, 16);
  for (uint64_t seed = 1; seed <= 16; ++seed) StoreSeed(d, seed, "engine-a");
  {
    const flexkv::DaemonStatus s = SettledStatus(d);
    INFO(TierText(Ssd(s)));
    REQUIRE(Counter(Ssd(s), "written_back_blocks") == 16 * kBlocks);
    REQUIRE(s.pool.capacity_blocks == 64);  // seeds 9..16 fill DRAM; 1..8 are on SSD only
  }
  // The block file loses every slot under the running daemon: only its file header is left.
  REQUIRE(truncate(dir.block_file().c_str(), static_cast<off_t>(kSector)) == 0);
  DropCaches();

  const std::vector<Loaded> lost = LoadAll(d, ssd_only, "engine-b");
  for (size_t i = 0; i < lost.size(); ++i) {
    INFO("seed " << ssd_only[i]);
    CHECK(lost[i].equal == 1);
    CHECK(lost[i].status == "OK");
    CHECK(lost[i].hits == 0);  // its first block cannot be read
  }
  {
    const flexkv::DaemonStatus s = Status(d);
    const auto& t = Ssd(s);
    INFO(TierText(t));
    CHECK(Counter(t, "read_errors") + Counter(t, "data_loss_blocks") > 0);
    CHECK(Counter(t, "promotion_failed_blocks") > 0);
    CHECK(Counter(t, "promoted_blocks") == 0);
  }
  // The blocks DRAM holds are served whatever happened on SSD (the most recent ones at least; a promotion's pending
  // slots may have taken the coldest).
  const std::vector<Loaded> kept = LoadAll(d, in_dram, "engine-c");
  for (size_t i = 0; i < kept.size(); ++i) {
    INFO("seed " << in_dram[i]);
    CHECK(kept[i].equal == 1);
    CHECK(kept[i].status == "OK");
    if (in_dram[i] >= 13) CHECK(kept[i].hits == kBlocks);
  }
  // The daemon serves on: new stores and loads, and flexkvctl status.
  CHECK(Run(Engine(d, "engine-d", {"store:500:8", "load:500:8"})) ==
        (std::vector<std::string>{"STORED 0 8 OK", "LOADED 8 8 1 OK"}));
  const flexkv::testing::CommandResult status = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "status"});
  INFO(status.output);
  CHECK(status.exit_code == 0);
  CHECK_THAT(status.output, Catch::Contains("ssd ") && Catch::Contains("serving"));

  // Seed 500 was written (write policy all) into the file cut under the daemon. After a stop and a "reboot" the daemon
  // starts from that file, serves seed 500 from SSD and nothing of what was cut.
  (void)SettledStatus(d);
  StopDaemon(d, SIGTERM);
  REQUIRE(std::filesystem::remove(dir.pool()));
  DropCaches();
  DaemonUnderTest again(SsdArgs(dir, {"--ssd-write-policy=all"}), dir.path());
  REQUIRE(again.WaitReady());
  {
    const flexkv::DaemonStatus s = Status(again);
    INFO(TierText(Ssd(s)));
    CHECK(Ssd(s).state == "serving");
    CHECK(Counter(Ssd(s), "rebuilt_blocks") >= kBlocks);
  }
  const std::vector<Loaded> reloaded = LoadAll(again, Seeds(1, 8), "engine-e");
  for (size_t i = 0; i < reloaded.size(); ++i) {
    INFO("seed " << i + 1);
    CHECK(reloaded[i].equal == 1);
    CHECK(reloaded[i].hits == 0);
  }
  CHECK(Run(Engine(again, "engine-f", {"load:500:8"})) == std::vector<std::string>{"LOADED 8 8 1 OK"});
}

TEST_CASE("ssd tier: more blocks than the SSD holds - the oldest are overwritten and never served",
          "[integration][ssd_tier]") {
  SsdDir dir;
  // 16 MiB of SSD: 124 slots of 132 KiB; 30 seeds x 8 = 240 blocks, all written (write policy all).
  DaemonUnderTest d({"--pool-size", "8MiB", "--ssd-path", dir.ssd(), "--ssd-size", "16MiB", "--ssd-write-policy=all"},
                    dir.path());
  REQUIRE(d.WaitReady());
  constexpr uint64_t kSeeds = 30;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    StoreSeed(d, seed, "engine-a");
    (void)SettledStatus(d);
  }
  const flexkv::DaemonStatus s = SettledStatus(d);
  const auto& t = Ssd(s);
  INFO(TierText(t));
  REQUIRE(t.capacity_blocks == (16ULL << 20) / (kSector + 128 * 1024));
  REQUIRE(Counter(t, "written_back_blocks") == kSeeds * kBlocks);
  CHECK(t.used_blocks == t.capacity_blocks);
  CHECK(Counter(t, "evicted_blocks") == kSeeds * kBlocks - t.capacity_blocks);  // overwritten on SSD
  CHECK(Counter(t, "evicted_unwritten_blocks") == 0);

  // Newest first: the 15 newest seeds (120 blocks) are on SSD (and the 8 newest in DRAM too).
  std::vector<uint64_t> newest;
  for (uint64_t seed = kSeeds; seed > kSeeds - 15; --seed) newest.push_back(seed);
  const std::vector<Loaded> fresh = LoadAll(d, newest, "engine-b");
  for (size_t i = 0; i < fresh.size(); ++i) {
    INFO("seed " << newest[i]);
    CHECK(fresh[i].hits == kBlocks);
    CHECK(fresh[i].equal == 1);
  }
  // The oldest ones were overwritten on SSD (least recently used; each prompt's blocks leaves first, as in DRAM), so
  // nothing of them is served - in particular no block of another prompt that now sits in their slots.
  const std::vector<Loaded> old = LoadAll(d, Seeds(1, 14), "engine-c");
  for (size_t i = 0; i < old.size(); ++i) {
    INFO("seed " << i + 1);
    CHECK(old[i].hits == 0);
    CHECK(old[i].equal == 1);
  }
  const flexkv::DaemonStatus after = Status(d);
  INFO(TierText(Ssd(after)));
  CHECK(Counter(Ssd(after), "data_loss_blocks") == 0);
  CHECK(Counter(Ssd(after), "promotion_failed_blocks") == 0);
}

TEST_CASE("ssd tier: a full drive while running fails write-backs, not stores, and the tier writes again once there "
          "is space",
          "[integration][ssd_tier]") {
  // The block file is preallocated, so a full drive cannot hit a running daemon's writes - unless its free slots lose
  // their blocks: here they are punched out of the file and the filesystem is then filled, so the next writes need
  // blocks the drive no longer has (ENOSPC). A small ext4 image over a loop device (needs root and loop devices).
  SsdDir dir;
  const std::string img = dir.path() + "/small.img";
  const std::string mnt = dir.path() + "/mnt";
  std::filesystem::create_directories(mnt);
  const std::string setup = "truncate -s 32M " + img + " && mkfs.ext4 -q -F " + img + " >/dev/null 2>&1 && mount -o loop " +
                            img + " " + mnt + " 2>/dev/null";
  if (geteuid() != 0 || std::system(setup.c_str()) != 0) {
    WARN("cannot mount a small ext4 image here (needs root and loop devices): skipped");
    return;
  }
  struct Unmount {
    std::string m;
    ~Unmount() { (void)!std::system(("umount " + m + " 2>/dev/null").c_str()); }
  } unmount{mnt};
  const std::string block_file = mnt + "/" + kBlockFile;
  const std::string filler = mnt + "/filler";

  DaemonUnderTest d({"--pool-size", "8MiB", "--ssd-path", mnt, "--ssd-size", "16MiB", "--ssd-write-policy=all"},
                    dir.path());
  REQUIRE(d.WaitReady());
  StoreSeed(d, 1, "engine-a");
  {
    const flexkv::DaemonStatus s = SettledStatus(d);
    INFO(TierText(Ssd(s)));
    REQUIRE(Counter(Ssd(s), "written_back_blocks") == kBlocks);
  }
  // Punch out every slot after the used ones, then fill the filesystem.
  const BlockFileMap map = MapBlockFile(block_file, {1});
  REQUIRE(map.slot_of.size() == kBlocks);
  const uint64_t first_free = map.slot_of.rbegin()->first + 1;
  {
    const int fd = ::open(block_file.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd >= 0);
    const off_t from = static_cast<off_t>(map.SlotOffset(first_free));
    REQUIRE(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, from,
                      static_cast<off_t>(map.file_bytes) - from) == 0);
    ::close(fd);
    const int ffd = ::open(filler.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(ffd >= 0);
    std::vector<char> chunk(64 * 1024, 'x');
    uint64_t filled = 0;
    for (;;) {
      const ssize_t n = ::write(ffd, chunk.data(), chunk.size());
      if (n <= 0) break;
      filled += static_cast<uint64_t>(n);
    }
    CHECK(errno == ENOSPC);
    ::fsync(ffd);
    ::close(ffd);
    struct statfs fs {};
    REQUIRE(statfs(mnt.c_str(), &fs) == 0);
    INFO("filled " << filled << " bytes; " << fs.f_bfree << " blocks free");
    REQUIRE(fs.f_bavail * fs.f_bsize < 128 * 1024);  // not room for one payload
  }

  // Stores go on (their blocks stay in DRAM); their writes fail with ENOSPC.
  const std::vector<uint64_t> during = Seeds(2, 5);
  for (uint64_t seed : during) StoreSeed(d, seed, "engine-a");
  flexkv::DaemonStatus s = Status(d);
  for (int i = 0; i < 1500 && Counter(Ssd(s), "writeback_failed_blocks") == 0; ++i) {
    std::this_thread::sleep_for(20ms);
    s = Status(d);
  }
  {
    const auto& t = Ssd(s);
    INFO("drive full: " << TierText(t));
    CHECK(Counter(t, "writeback_failed_blocks") > 0);
    CHECK(Counter(t, "write_errors") > 0);
    CHECK(Counter(t, "data_loss_blocks") == 0);
    CHECK(t.state == "serving");
  }
  CHECK_THAT(d.process().Stderr(), Catch::Contains("ENOSPC") && Catch::Contains(block_file));
  const std::vector<Loaded> loads = LoadAll(d, Seeds(1, 5), "engine-b");
  for (size_t i = 0; i < loads.size(); ++i) {
    INFO("seed " << i + 1);
    CHECK(loads[i].hits == kBlocks);  // all in DRAM (40 blocks of 64)
    CHECK(loads[i].equal == 1);
  }
  {
    const flexkv::testing::CommandResult status = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "status"});
    INFO(status.output);
    CHECK(status.exit_code == 0);
  }

  // Space again: new blocks are written, and the blocks whose writes failed are written before DRAM evicts them
  // (paced stores push seeds 1..5 out of DRAM; each then loads whole from SSD).
  REQUIRE(std::filesystem::remove(filler));
  ::sync();
  const uint64_t written_before = Counter(Ssd(Status(d)), "written_back_blocks");
  const std::vector<uint64_t> after = Seeds(6, 15);  // 80 blocks: more than DRAM holds
  uint64_t stored_after = 0;
  for (uint64_t seed : after) {
    StoreSeed(d, seed, "engine-a");
    stored_after += kBlocks;
    // Paced by the mover itself: this seed's writes done means a whole round (the commit queue,
    // then the cold end) ran after the store, with space on the drive (the mover slows to a round a second after
    // failures: generous deadline).
    flexkv::DaemonStatus s2 = Status(d);
    for (int i = 0; i < 1500 && Counter(Ssd(s2), "written_back_blocks") < written_before + stored_after; ++i) {
      std::this_thread::sleep_for(20ms);
      s2 = Status(d);
    }
    INFO("seed " << seed << ": " << TierText(Ssd(s2)));
    REQUIRE(Counter(Ssd(s2), "written_back_blocks") >= written_before + stored_after);
    (void)SettledStatus(d);
  }
  const flexkv::DaemonStatus recovered = SettledStatus(d);
  const auto& t = Ssd(recovered);
  INFO("space again: " << TierText(t));
  CHECK(Counter(t, "written_back_blocks") >= written_before + after.size() * kBlocks);
  CHECK(Counter(t, "evicted_unwritten_blocks") == 0);
  const std::vector<Loaded> reloads = LoadAll(d, Seeds(1, 15), "engine-c");
  for (size_t i = 0; i < reloads.size(); ++i) {
    INFO("seed " << i + 1);
    CHECK(reloads[i].equal == 1);
    CHECK(reloads[i].hits == kBlocks);
  }
}

// Issue 29 item 6: with --ssd-write-policy all, a system prompt every request starts with (always a DRAM hit, never
// read from SSD) was the least recently used SSD block and the first overwritten; after a reboot none of the latest
// prompts, all still on SSD, was reachable behind it.
TEST_CASE("ssd tier: a hot system prompt outlives the prompts under it on SSD, so a reboot serves the latest ones",
          "[integration][ssd_tier]") {
  SsdDir dir;
  // 8 MiB of DRAM (64 blocks) and 16 MiB of SSD (124 slots): 40 requests of 2 shared + 6 own blocks write 242 blocks,
  // so SSD overwrites about half of them.
  const std::vector<std::string> args = {"--pool-size", "8MiB", "--ssd-path", dir.ssd(), "--ssd-size", "16MiB",
                                         "--ssd-write-policy=all"};
  constexpr uint64_t kSystem = 7777;
  constexpr uint32_t kShared = 2;
  const std::vector<uint64_t> requests = Seeds(100, 139);
  const std::vector<uint64_t> latest = Seeds(130, 139);  // 60 blocks + the 2 shared: half the SSD
  {
    DaemonUnderTest d(args, dir.path());
    REQUIRE(d.WaitReady());
    // Each request matches (the system prompt hits in DRAM) and stores its prompt, in batches so the run stays short;
    // every batch settles so that the write-back has written each block before the next (nothing is evicted
    // unwritten: what is tested here is which blocks SSD keeps).
    for (size_t i = 0; i < requests.size(); i += 5) {
      std::vector<std::string> steps;
      for (size_t j = i; j < std::min(requests.size(), i + 5); ++j) {
        steps.push_back(LoadSteps(requests[j]));
        steps.push_back(StoreStep(requests[j]));
      }
      const std::vector<std::string> lines = Run(PrefixEngine(d, "engine-a", kSystem, kShared, steps));
      INFO(fmt_lines(lines));
      REQUIRE(lines.size() == steps.size());
      for (size_t k = 0; k < lines.size(); k += 2) {
        if (i + k > 0) CHECK(ParseLoaded(lines[k]).hits >= kShared);  // the system prompt: a DRAM hit
        CHECK_THAT(lines[k + 1], Catch::EndsWith(" OK"));
      }
      // Write policy all: every block stored so far is written (a busy machine may stall the mover longer than
      // SettledStatus's polls).
      const uint64_t stored = kShared + std::min(requests.size(), i + 5) * (kBlocks - kShared);
      flexkv::DaemonStatus s = Status(d);
      for (int k = 0; k < 1500 && Counter(Ssd(s), "written_back_blocks") < stored; ++k) {
        std::this_thread::sleep_for(20ms);
        s = Status(d);
      }
      INFO(TierText(Ssd(s)));
      REQUIRE(Counter(Ssd(s), "written_back_blocks") == stored);
    }
    const flexkv::DaemonStatus s = SettledStatus(d);
    const auto& t = Ssd(s);
    INFO(TierText(t));
    REQUIRE(Counter(t, "written_back_blocks") == kShared + requests.size() * (kBlocks - kShared));
    REQUIRE(Counter(t, "evicted_blocks") > 100);  // SSD overwrote blocks: the case in question
    CHECK(Counter(t, "evicted_unwritten_blocks") == 0);
    StopDaemon(d, SIGKILL);
  }
  // A reboot: the DRAM pool is gone, SSD keeps its blocks.
  REQUIRE(std::filesystem::remove(dir.pool()));
  DropCaches();
  DaemonUnderTest d(args, dir.path());
  REQUIRE(d.WaitReady());
  std::vector<std::string> steps;
  for (uint64_t seed : latest) steps.push_back(LoadSteps(seed));
  const std::vector<std::string> lines = Run(PrefixEngine(d, "engine-b", kSystem, kShared, steps));
  INFO(fmt_lines(lines));
  REQUIRE(lines.size() == latest.size());
  size_t whole = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const Loaded l = ParseLoaded(lines[i]);
    INFO("seed " << latest[i]);
    CHECK(l.equal == 1);
    CHECK(l.status == "OK");
    if (l.hits == kBlocks) ++whole;
  }
  const flexkv::DaemonStatus after = Status(d);
  INFO("after the reboot: " << TierText(Ssd(after)));
  CHECK(whole == latest.size());
  CHECK(Counter(Ssd(after), "promoted_blocks") >= latest.size() * (kBlocks - kShared) + kShared);
}

// Issue 29 item 6: a burst of stores through DRAM outran the write-back (cold policy): blocks were evicted before
// SSD held them, and after kill -9 and a restart 100-111 of 120 prompts came back whole. DRAM now evicts blocks SSD
// holds first, and a store that could only go on by evicting a block SSD does not hold waits for the write-back
// (--ssd-store-wait); what is dropped all the same is counted in evicted_unwritten_blocks.
TEST_CASE("ssd tier: a burst of stores, quiet, kill -9 and a restart: every prompt comes back whole",
          "[integration][ssd_tier]") {
  SsdDir dir;
  // 32 MiB of DRAM (256 blocks of 128 KiB) and 100 MiB of SSD (775 slots, 3x DRAM); 24 prompts of 25 blocks
  // (600 blocks) stored back to back from one engine.
  // A generous store wait: the test is about the mechanism (stores wait for the write-back instead of dropping),
  // not about how fast a loaded or sanitizer-built daemon writes.
  const std::vector<std::string> args = {"--pool-size", "32MiB", "--ssd-path", dir.ssd(), "--ssd-size", "100MiB",
                                         "--ssd-store-wait", "60"};
  constexpr uint32_t kLong = 25;
  const std::vector<uint64_t> prompts = Seeds(200, 223);
  uint64_t dropped = 0;
  {
    DaemonUnderTest d(args, dir.path());
    REQUIRE(d.WaitReady());
    std::vector<std::string> steps;
    for (uint64_t seed : prompts) steps.push_back(StoreStep(seed, kLong));
    const std::vector<std::string> lines = Run(Engine(d, "engine-burst", steps));
    INFO(fmt_lines(lines));
    REQUIRE(lines.size() == prompts.size());
    for (const std::string& line : lines) CHECK(line == "STORED 0 25 OK");
    std::this_thread::sleep_for(5s);  // quiet
    const flexkv::DaemonStatus s = SettledStatus(d);
    const auto& t = Ssd(s);
    INFO("before the kill: " << TierText(t));
    REQUIRE(s.pool.capacity_blocks == 256);
    dropped = Counter(t, "evicted_unwritten_blocks");
    CHECK(Counter(t, "evicted_written_blocks") + dropped == prompts.size() * kLong - s.pool.used_blocks);
    CHECK(Counter(t, "store_wait_expired") == 0);
    CHECK(dropped == 0);
    StopDaemon(d, SIGKILL);
  }
  DaemonUnderTest d(args, dir.path());
  REQUIRE(d.WaitReady());
  (void)VerifiedStatus(d);
  // Newest first: the prompts in DRAM are checked before promotions of the older ones evict them.
  std::vector<uint64_t> order(prompts.rbegin(), prompts.rend());
  const std::vector<Loaded> loads = LoadAll(d, order, "engine-reader", kLong);
  size_t whole = 0;
  uint64_t missing = 0;
  for (size_t i = 0; i < loads.size(); ++i) {
    INFO("seed " << order[i] << ": hits " << loads[i].hits);
    CHECK(loads[i].equal == 1);  // never a wrong byte
    CHECK(loads[i].status == "OK");
    if (loads[i].hits == kLong) ++whole;
    missing += kLong - loads[i].hits;
  }
  const flexkv::DaemonStatus after = Status(d);
  INFO("after the restart: " << TierText(Ssd(after)) << "; " << whole << " of " << prompts.size()
                             << " whole, dropped " << dropped);
  CHECK(whole == prompts.size());
  CHECK(missing == dropped);  // nothing lost beyond what the counter says
}

// --- Hybrid models through the SSD tier (issue 30; docs/ssd.md, "Hybrid domains").

namespace {

// gpt-oss-like: 2 full-attention and 2 sliding-window layers of a 64-token (4-block) window, 2 KV heads x 64 at bf16
// (16 KiB blocks of each). Qwen3-Next-like: 2 full-attention layers and 4 linear-attention layers of a 4 KiB state
// (16 KiB snapshots), a state every 4 blocks (chunked prefill) and at the end.
const std::vector<std::string> kGptOssLike = {"--layers", "2", "--heads", "2", "--head-dim", "64",
                                              "--swa-layers", "2", "--window-tokens", "64"};
const std::vector<std::string> kQwen3NextLike = {"--layers", "2", "--heads", "2", "--head-dim", "64",
                                                 "--state-layers", "4", "--state-bytes", "4096", "--state-every", "4"};

ChildProcess HybridEngine(const DaemonUnderTest& d, const std::string& name, const std::vector<std::string>& geometry,
                          const std::vector<std::string>& steps) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", d.socket(), "--name", name, "--kv-blocks", "64"};
  argv.insert(argv.end(), geometry.begin(), geometry.end());
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

// Loads every seed from one process, first whole (kLen blocks: the end at 8) then its first chunk (the end at 4), and
// checks each is a hit of all its blocks, every component's bytes equal to what was stored and no other byte of the
// engine's buffers written.
constexpr uint32_t kLen = 8, kChunk = 4;
void LoadEveryPromptWhole(const DaemonUnderTest& d, const std::vector<std::string>& geometry,
                          const std::vector<uint64_t>& seeds, const std::string& name) {
  std::vector<std::string> steps;
  for (uint64_t s : seeds) {
    steps.push_back(LoadSteps(s, kLen));
    steps.push_back(LoadSteps(s, kChunk));
  }
  const std::vector<std::string> lines = Run(HybridEngine(d, name, geometry, steps));
  INFO(fmt_lines(lines));
  INFO("the tier after these loads: " << TierText(Ssd(Status(d))));
  REQUIRE(lines.size() == 2 * seeds.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    const uint32_t n = i % 2 == 0 ? kLen : kChunk;
    INFO("seed " << seeds[i / 2] << ", " << n << " blocks: " << lines[i]);
    CHECK(lines[i] == "LOADED " + std::to_string(n) + " " + std::to_string(n) + " 1 OK 1");
  }
}

}  // namespace

TEST_CASE("ssd tier: hybrid models - every component evicted from DRAM comes back from SSD byte exact, also after "
          "kill -9 and after a reboot",
          "[integration][ssd_tier][hybrid]") {
  const bool gpt_oss = GENERATE(true, false);
  const std::vector<std::string>& geometry = gpt_oss ? kGptOssLike : kQwen3NextLike;
  INFO((gpt_oss ? "gpt-oss-like (FULL + SLIDING_WINDOW)" : "Qwen3-Next-like (FULL + STATE)"));
  SsdDir dir;
  // 2 MiB of DRAM: 128 slots of 16 KiB, a quarter for the windows or the states (32), the rest (96) for FULL blocks:
  // 12 prompts of 8 blocks at most. 24 prompts go through it; 16 MiB of SSD (819 slots) hold them all. Write policy
  // all: every piece is on SSD soon after its store (the cold policy, with stores that wait for the write-back, is
  // the next test).
  const std::vector<std::string> args = {"--pool-size", "2MiB", "--swa-share", "0.25", "--state-share", "0.25",
                                         "--ssd-path", dir.ssd(), "--ssd-size", "16MiB", "--ssd-write-policy", "all"};
  const std::vector<uint64_t> prompts = Seeds(300, 323);
  {
    DaemonUnderTest d(args, dir.path());
    REQUIRE(d.WaitReady());
    // Each prompt in two chunks, as a chunked prefill stores it: ends at 4 and 8, each with its window or state.
    // Paced: each prompt written before the next evicts it.
    for (uint64_t seed : prompts) {
      const std::vector<std::string> lines = Run(
          HybridEngine(d, "engine-store", geometry, {StoreStep(seed, kChunk), StoreStep(seed, kLen)}));
      REQUIRE(lines.size() == 2);
      CHECK(lines[0] == "STORED 0 4 OK");
      CHECK(lines[1] == "STORED 4 4 OK");
      (void)SettledStatus(d);
    }
    const flexkv::DaemonStatus stored = SettledStatus(d);
    const auto& t = Ssd(stored);
    INFO("after the stores: " << TierText(t));
    REQUIRE(t.state == "serving");
    CHECK(Counter(t, "evicted_unwritten_blocks") == 0);
    CHECK(Counter(t, "evicted_written_blocks") > 0);
    CHECK(stored.index_blocks < prompts.size() * kLen);  // DRAM could not keep them all
    // Every prompt is a hit of all 8 blocks with its window or state, the older ones promoted from SSD.
    LoadEveryPromptWhole(d, geometry, prompts, "engine-load");
    const flexkv::DaemonStatus loaded = Status(d);
    INFO("after the loads: " << TierText(Ssd(loaded)));
    CHECK(Counter(Ssd(loaded), "promoted_blocks") > 0);
    CHECK(Counter(Ssd(loaded), "promotion_failed_blocks") == 0);
    (void)SettledStatus(d);
    StopDaemon(d, SIGKILL);
  }
  {
    // kill -9, the pool file kept: what DRAM kept is re-attached, the rest comes from SSD.
    DaemonUnderTest d(args, dir.path());
    REQUIRE(d.WaitReady());
    const flexkv::DaemonStatus restarted = VerifiedStatus(d);
    INFO("restarted: " << TierText(Ssd(restarted)));
    CHECK(Ssd(restarted).state == "serving");
    CHECK(Counter(Ssd(restarted), "rebuild_corrupt_headers") == 0);
    LoadEveryPromptWhole(d, geometry, prompts, "engine-after-kill");
    (void)SettledStatus(d);
    StopDaemon(d, SIGKILL);
  }
  // A reboot: the pool file is gone (/dev/shm), the page cache dropped; SSD alone serves every prompt.
  REQUIRE(std::filesystem::remove(dir.pool()));
  DropCaches();
  DaemonUnderTest d(args, dir.path());
  REQUIRE(d.WaitReady());
  LoadEveryPromptWhole(d, geometry, prompts, "engine-after-reboot");
  const flexkv::DaemonStatus after = Status(d);
  INFO("after the reboot: " << TierText(Ssd(after)));
  CHECK(Counter(Ssd(after), "promoted_blocks") > 0);
  CHECK(Counter(Ssd(after), "promotion_failed_blocks") == 0);
  CHECK(after.counters.at("data_loss_blocks") == 0);
}

TEST_CASE("ssd tier: hybrid stores under the cold write policy wait for the write-back - a burst loses no piece and "
          "every prompt comes back whole",
          "[integration][ssd_tier][hybrid]") {
  const bool gpt_oss = GENERATE(true, false);
  const std::vector<std::string>& geometry = gpt_oss ? kGptOssLike : kQwen3NextLike;
  INFO((gpt_oss ? "gpt-oss-like (FULL + SLIDING_WINDOW)" : "Qwen3-Next-like (FULL + STATE)"));
  SsdDir dir;
  // The sizes of the test above, the default (cold) write policy, and no pacing: the 24 prompts' stores come as one
  // burst from one engine. A store that could go on only by evicting a FULL block, window or state SSD does not hold
  // yet waits for the write-back (a long --ssd-store-wait, so that a slow CI disk does not run it out).
  const std::vector<std::string> args = {"--pool-size", "2MiB", "--swa-share", "0.25", "--state-share", "0.25",
                                         "--ssd-path", dir.ssd(), "--ssd-size", "16MiB", "--ssd-store-wait", "30"};
  const std::vector<uint64_t> prompts = Seeds(400, 423);
  DaemonUnderTest d(args, dir.path());
  REQUIRE(d.WaitReady());
  std::vector<std::string> steps;
  for (uint64_t seed : prompts) {
    steps.push_back(StoreStep(seed, kChunk));
    steps.push_back(StoreStep(seed, kLen));
  }
  const std::vector<std::string> lines = Run(HybridEngine(d, "engine-burst", geometry, steps));
  INFO(fmt_lines(lines));
  REQUIRE(lines.size() == 2 * prompts.size());
  for (size_t i = 0; i < lines.size(); ++i) CHECK(lines[i] == (i % 2 == 0 ? "STORED 0 4 OK" : "STORED 4 4 OK"));
  const flexkv::DaemonStatus stored = SettledStatus(d);
  const auto& t = Ssd(stored);
  INFO("after the burst: " << TierText(t));
  CHECK(Counter(t, "evicted_unwritten_blocks") == 0);
  CHECK(Counter(t, "store_wait_expired") == 0);
  CHECK(Counter(t, "evicted_written_blocks") > 0);
  CHECK(stored.index_blocks < prompts.size() * kLen);  // DRAM could not keep them all
  // Newest first: under the cold policy the newest entries are in DRAM only (the mover writes the cold end). A
  // promotion evicts only what SSD holds: one that would evict an unwritten piece of a prompt not loaded yet waits for
  // the write-back instead (CI once lost the 4 window entries of a prompt that way, before promotions waited).
  LoadEveryPromptWhole(d, geometry, std::vector<uint64_t>(prompts.rbegin(), prompts.rend()), "engine-load");
  const flexkv::DaemonStatus loaded = Status(d);
  INFO("after the loads: " << TierText(Ssd(loaded)));
  CHECK(Counter(Ssd(loaded), "promoted_blocks") > 0);
  CHECK(Counter(Ssd(loaded), "promotion_failed_blocks") == 0);
  CHECK(Counter(Ssd(loaded), "evicted_unwritten_blocks") == 0);
  CHECK(Counter(Ssd(loaded), "promotion_wait_expired") == 0);
}

// flexkv-bench ssd [--dir DIR] [--block-size 1MiB] [--queue-depth 32] [--bytes 4GiB] [--rounds 3] [--no-fixed]
//                  [--fio-fixedbufs] [--rebuild 100K,1M] [--rebuild-payload 4KiB] [--no-fio] [--json]
// The SSD tier's block store (daemon/tiers/ssd/), in-process, against fio in the same run, same directory:
//   write-back  SsdStore::Write of --bytes / --block-size distinct blocks, --queue-depth requests outstanding,
//               from a buffer standing in for the DRAM pool: unregistered (one vectored I/O per block: header
//               sector + payload), then registered (fixed-buffer payload I/O, the header linked after it: two
//               I/Os per block; --no-fixed skips this run)
//   promotion   SsdStore::Read of the same blocks back (the payload alone, its XXH3 verified against the index),
//               in the order written
//   fio         --ioengine=io_uring --direct=1 --bs=<block size> --iodepth=<queue depth> --rw=write, then
//               --rw=read, on a file of the same size in the same directory: the ceiling. Rounds alternate store
//               and fio; medians are reported.
//   rebuild     for each N of --rebuild: a child process opens a store of N slots (--rebuild-payload blocks),
//               writes N blocks and is killed with SIGKILL; the page cache is dropped (when this process may);
//               then SsdStore::Open is timed: it rebuilds the index from the slot headers.
// The store's slots are 4 KiB larger than a block (the header sector): its MB/s count block bytes only, so the
// ratio is what a user sees. Files are removed at the end; a directory made here is too.
#include "ssd_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_json.h"
#include "bench_process.h"
#include "common/units.h"
#include "daemon/tiers/ssd/ssd_store.h"

namespace {

using Clock = std::chrono::steady_clock;
using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Rounded;
using flexkv::bench::Whole;

double SecondsBetween(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct SsdBenchOptions {
  std::string dir;
  uint64_t block_size = 1 << 20;
  uint32_t queue_depth = 32;
  uint64_t bytes = uint64_t{4} << 30;
  int rounds = 3;
  bool fixed = true;           // also run the store with its buffer registered (fixed-buffer payload I/O)
  bool fio_fixedbufs = false;
  std::vector<std::string> rebuild = {"100K", "1M"};
  uint64_t rebuild_payload = 4096;
  bool no_fio = false;
  bool json = false;
};

// At most `limit` requests outstanding: Acquire before a request, the request's done releases.
class Window {
 public:
  explicit Window(uint32_t limit) : free_(limit), limit_(limit) {}
  void Acquire() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return free_ > 0; });
    --free_;
  }
  void Release(const flexkv::Status& s) {
    std::lock_guard<std::mutex> l(mu_);
    ++free_;
    if (!s.ok() && first_error_.ok()) first_error_ = s;
    cv_.notify_all();
  }
  flexkv::Status Drain() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return free_ == limit_; });
    return first_error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t free_;
  const uint32_t limit_;
  flexkv::Status first_error_;
};

struct AlignedBuffer {
  explicit AlignedBuffer(uint64_t n) : size(n) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, n) != 0) std::abort();
    data = static_cast<uint8_t*>(p);
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data;
  uint64_t size;
};

flexkv::SsdBlockId Id(uint64_t i) {
  return flexkv::SsdBlockId{flexkv::BlockKey{i * 0x9E3779B97F4A7C15ull + 1, i}, flexkv::SsdDomain{1, 2}, 0};
}

// Runs one request per block through `submit` with at most `depth` outstanding; retries a refusal.
flexkv::Status Drive(uint64_t blocks, uint32_t depth,
                     const std::function<flexkv::Status(uint64_t, flexkv::SsdStore::Done)>& submit) {
  Window w(depth);
  for (uint64_t i = 0; i < blocks; ++i) {
    w.Acquire();
    flexkv::Status s = submit(i, [&w](flexkv::Status st) { w.Release(st); });
    if (!s.ok()) {
      w.Release(flexkv::Status::Ok());
      (void)w.Drain();
      return s;
    }
  }
  return w.Drain();
}

struct StoreRun {
  double write_s = 0, read_s = 0;
  uint64_t fixed_ios = 0;
};

std::optional<StoreRun> RunStore(const SsdBenchOptions& o, const std::string& dir, AlignedBuffer& pool, uint64_t pool_blocks,
                                 bool registered) {
  const uint64_t blocks = o.bytes / o.block_size;
  flexkv::SsdStoreOptions so;
  so.paths = {dir};
  so.payload_capacity = o.block_size;
  so.size_bytes = flexkv::kSsdHeaderSector + blocks * flexkv::SsdSlotStride(o.block_size);
  so.queue_depth = o.queue_depth;
  so.max_queued = o.queue_depth;
  std::error_code ec;
  std::filesystem::remove(dir + "/" + flexkv::kSsdFileName, ec);
  auto store = flexkv::SsdStore::Open(so);
  if (!store.ok()) {
    std::fprintf(stderr, "flexkv-bench ssd: %s\n", store.status().ToString().c_str());
    return std::nullopt;
  }
  if (registered) {
    flexkv::SsdRegion r{pool.data, pool.size};
    if (auto s = (*store)->RegisterBuffers(std::span<const flexkv::SsdRegion>(&r, 1)); !s.ok()) {
      std::fprintf(stderr, "flexkv-bench ssd: %s\n", s.ToString().c_str());
      return std::nullopt;
    }
  }
  StoreRun run;
  auto slot = [&](uint64_t i) { return std::span<uint8_t>(pool.data + (i % pool_blocks) * o.block_size, o.block_size); };
  const auto t0 = Clock::now();
  flexkv::Status s = Drive(blocks, o.queue_depth, [&](uint64_t i, flexkv::SsdStore::Done d) {
    return (*store)->Write(Id(i), flexkv::BlockKey{}, slot(i), 0, std::move(d));
  });
  const auto t1 = Clock::now();
  if (!s.ok()) {
    std::fprintf(stderr, "flexkv-bench ssd: write: %s\n", s.ToString().c_str());
    return std::nullopt;
  }
  s = Drive(blocks, o.queue_depth, [&](uint64_t i, flexkv::SsdStore::Done d) {
    return (*store)->Read(Id(i), slot(i), std::move(d));
  });
  const auto t2 = Clock::now();
  if (!s.ok()) {
    std::fprintf(stderr, "flexkv-bench ssd: read: %s\n", s.ToString().c_str());
    return std::nullopt;
  }
  run.write_s = SecondsBetween(t0, t1);
  run.read_s = SecondsBetween(t1, t2);
  run.fixed_ios = (*store)->stats().fixed_buffer_ios;
  store->reset();
  std::filesystem::remove(dir + "/" + flexkv::kSsdFileName, ec);
  return run;
}

std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  std::string d;
  while (std::getline(ss, d, ':')) {
    const std::string p = d + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return {};
}

// fio's bandwidth in bytes/s for `rw` ("write" or "read"), or nullopt (why printed).
std::optional<double> RunFio(const std::string& fio, const SsdBenchOptions& o, const std::string& dir, const std::string& rw) {
  const std::string out = dir + "/fio-" + rw + ".json";
  std::vector<std::string> argv = {fio,
                                   "--name=flexkv-ssd-ceiling",
                                   "--filename=" + dir + "/fio.bench",
                                   "--ioengine=io_uring",
                                   "--direct=1",
                                   fmt::format("--bs={}", o.block_size),
                                   fmt::format("--iodepth={}", o.queue_depth),
                                   "--rw=" + rw,
                                   fmt::format("--size={}", (o.bytes / o.block_size) * o.block_size),
                                   "--numjobs=1",
                                   "--output-format=json",
                                   "--output=" + out};
  if (o.fio_fixedbufs) argv.push_back("--fixedbufs");
  auto child = flexkv::bench::Spawn(argv, {}, dir + "/fio.log");
  if (!child) return std::nullopt;
  const int status = child->Wait();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::ifstream log(dir + "/fio.log");
    std::stringstream text;
    text << log.rdbuf();
    std::fprintf(stderr, "flexkv-bench ssd: fio --rw=%s failed (status 0x%x): %s\n", rw.c_str(), status,
                 text.str().c_str());
    return std::nullopt;
  }
  try {
    std::ifstream f(out);
    const Json j = Json::parse(f);
    return j.at("jobs").at(0).at(rw).at("bw_bytes").get<double>();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flexkv-bench ssd: cannot read fio's JSON output %s: %s\n", out.c_str(), e.what());
    return std::nullopt;
  }
}

double MedianOf(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct RebuildRun {
  uint64_t blocks = 0;
  uint64_t file_bytes = 0;
  double fill_s = 0;
  double open_s = 0;
  uint64_t rebuilt = 0;
  bool dropped_cache = false;
};

// N blocks written by a child that is then SIGKILLed; the parent times the reopen.
std::optional<RebuildRun> RunRebuild(const SsdBenchOptions& o, const std::string& dir, uint64_t n) {
  flexkv::SsdStoreOptions so;
  so.paths = {dir};
  so.payload_capacity = o.rebuild_payload;
  so.size_bytes = flexkv::kSsdHeaderSector + n * flexkv::SsdSlotStride(o.rebuild_payload);
  so.queue_depth = o.queue_depth;
  so.max_queued = o.queue_depth;
  std::error_code ec;
  std::filesystem::remove(dir + "/" + flexkv::kSsdFileName, ec);
  RebuildRun run;
  run.blocks = n;
  run.file_bytes = so.size_bytes;
  int pipefd[2];
  if (::pipe(pipefd) != 0) return std::nullopt;
  const auto t0 = Clock::now();
  const pid_t pid = fork();  // no store is open here: this process has one thread
  if (pid < 0) return std::nullopt;
  if (pid == 0) {
    ::close(pipefd[0]);
    auto store = flexkv::SsdStore::Open(so);
    if (!store.ok()) {
      std::fprintf(stderr, "flexkv-bench ssd: rebuild fill: %s\n", store.status().ToString().c_str());
      _exit(3);
    }
    AlignedBuffer payload(std::max<uint64_t>(o.rebuild_payload, 4096));
    std::mt19937_64 rng(n);
    for (uint64_t i = 0; i < payload.size; ++i) payload.data[i] = static_cast<uint8_t>(rng());
    const flexkv::Status s = Drive(n, o.queue_depth, [&](uint64_t i, flexkv::SsdStore::Done d) {
      return (*store)->Write(Id(i), flexkv::BlockKey{}, std::span<const uint8_t>(payload.data, o.rebuild_payload), 0,
                             std::move(d));
    });
    if (!s.ok()) {
      std::fprintf(stderr, "flexkv-bench ssd: rebuild fill: %s\n", s.ToString().c_str());
      _exit(4);
    }
    const char ok = 'k';
    (void)!::write(pipefd[1], &ok, 1);
    ::raise(SIGKILL);  // kill -9: nothing is flushed, closed or checkpointed
    _exit(5);
  }
  ::close(pipefd[1]);
  char c = 0;
  const bool filled = ::read(pipefd[0], &c, 1) == 1;
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  run.fill_s = SecondsBetween(t0, Clock::now());
  if (!filled || !WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
    std::fprintf(stderr, "flexkv-bench ssd: the rebuild fill child did not finish its writes (status 0x%x)\n", status);
    return std::nullopt;
  }
  ::sync();
  {
    std::ofstream drop("/proc/sys/vm/drop_caches");
    if (drop) {
      drop << "3\n";
      drop.flush();
      run.dropped_cache = drop.good();
    }
  }
  const auto t1 = Clock::now();
  auto store = flexkv::SsdStore::Open(so);
  const auto t2 = Clock::now();
  if (!store.ok()) {
    std::fprintf(stderr, "flexkv-bench ssd: rebuild open: %s\n", store.status().ToString().c_str());
    return std::nullopt;
  }
  run.open_s = SecondsBetween(t1, t2);
  run.rebuilt = (*store)->rebuild_report().blocks;
  store->reset();
  std::filesystem::remove(dir + "/" + flexkv::kSsdFileName, ec);
  return run;
}

}  // namespace

int RunSsdBench(int argc, char** argv) {
  SsdBenchOptions o;
  std::string block_size = "1MiB", bytes = "4GiB", rebuild_payload = "4KiB";
  CLI::App app{"flexkv-bench ssd: the SSD tier's store (write-back, promotion, rebuild) against fio, same run"};
  app.add_option("--dir", o.dir, "Directory on the drive to measure (default: a new one under /var/tmp)");
  app.add_option("--block-size", block_size, "Block size (the DRAM pool's block), default 1MiB");
  app.add_option("--queue-depth", o.queue_depth, "Requests outstanding, store and fio (default 32)")
      ->check(CLI::Range(1u, 4096u));
  app.add_option("--bytes", bytes, "Bytes written and read per round (default 4GiB)");
  app.add_option("--rounds", o.rounds, "Rounds of store and fio, alternating (default 3; medians)")->check(CLI::Range(1, 100));
  app.add_flag("!--no-fixed", o.fixed, "Skip the store run with a registered buffer (fixed-buffer payload I/O)");
  app.add_flag("--fio-fixedbufs", o.fio_fixedbufs, "Run fio with --fixedbufs");
  app.add_option("--rebuild", o.rebuild, "Rebuild sizes in blocks, e.g. 100K,1M (K, M: powers of 1000); empty: none")
      ->delimiter(',');
  app.add_option("--rebuild-payload", rebuild_payload, "Block size for the rebuild runs (default 4KiB)");
  app.add_flag("--no-fio", o.no_fio, "Skip fio (the ceiling)");
  app.add_flag("--json", o.json, "One JSON object");
  CLI11_PARSE(app, argc, argv);
  for (auto [text, out] : {std::pair<std::string*, uint64_t*>{&block_size, &o.block_size}, {&bytes, &o.bytes},
                           {&rebuild_payload, &o.rebuild_payload}}) {
    auto v = flexkv::ParseByteSize(*text);
    if (!v.ok() || *v == 0) {
      std::fprintf(stderr, "flexkv-bench ssd: %s: %s\n", text->c_str(), v.ok() ? "must be > 0" : v.status().message().c_str());
      return 2;
    }
    *out = *v;
  }
  if (o.block_size % 4096 != 0 || o.bytes < o.block_size * o.queue_depth) {
    std::fprintf(stderr, "flexkv-bench ssd: --block-size must be a multiple of 4KiB and --bytes at least "
                         "--queue-depth blocks\n");
    return 2;
  }
  std::vector<uint64_t> rebuild_sizes;
  for (const std::string& r : o.rebuild) {
    if (r.empty()) continue;
    char* end = nullptr;
    const double v = std::strtod(r.c_str(), &end);
    const std::string unit = end ? end : "";
    const double mult = unit == "K" || unit == "k" ? 1e3 : unit == "M" || unit == "m" ? 1e6 : unit.empty() ? 1 : 0;
    if (v <= 0 || mult == 0) {
      std::fprintf(stderr, "flexkv-bench ssd: --rebuild %s: expected a count like 100K or 1M\n", r.c_str());
      return 2;
    }
    rebuild_sizes.push_back(static_cast<uint64_t>(v * mult));
  }

  // Our own directory, inside --dir when given.
  std::string base = o.dir.empty() ? "/var/tmp" : o.dir;
  std::string dir = base + "/flexkv-bench-ssd-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    std::fprintf(stderr, "flexkv-bench ssd: cannot make a directory in %s: %s\n", base.c_str(), std::strerror(errno));
    return 3;
  }
  struct Cleanup {
    std::string d;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  } cleanup{dir};
  const std::string fio = o.no_fio ? "" : FindOnPath("fio");
  if (!o.no_fio && fio.empty()) {
    std::fprintf(stderr, "flexkv-bench ssd: fio not found on PATH (Debian: apt-get install fio; or --no-fio)\n");
    return 3;
  }

  // The buffer: up to 256 MiB of distinct random blocks (at least two windows' worth), reused cyclically.
  const uint64_t pool_blocks =
      std::max<uint64_t>(2 * o.queue_depth, std::min<uint64_t>(o.bytes, uint64_t{256} << 20) / o.block_size);
  AlignedBuffer pool(pool_blocks * o.block_size);
  std::mt19937_64 rng(20261203);
  for (uint64_t i = 0; i < pool.size / 8; ++i) {
    const uint64_t v = rng();
    std::memcpy(pool.data + i * 8, &v, 8);
  }

  const uint64_t blocks = o.bytes / o.block_size;
  const double moved = static_cast<double>(blocks * o.block_size);
  std::vector<double> store_w, store_r, fixed_w, fixed_r, fio_w, fio_r;
  uint64_t fixed_ios = 0;
  for (int round = 0; round < o.rounds; ++round) {
    auto s = RunStore(o, dir, pool, pool_blocks, false);
    if (!s) return 1;
    store_w.push_back(moved / s->write_s);
    store_r.push_back(moved / s->read_s);
    if (o.fixed) {
      auto f = RunStore(o, dir, pool, pool_blocks, true);
      if (!f) return 1;
      fixed_w.push_back(moved / f->write_s);
      fixed_r.push_back(moved / f->read_s);
      fixed_ios = f->fixed_ios;
    }
    if (!o.no_fio) {
      auto w = RunFio(fio, o, dir, "write");
      auto r = w ? RunFio(fio, o, dir, "read") : std::nullopt;
      if (!w || !r) return 1;
      fio_w.push_back(*w);
      fio_r.push_back(*r);
      std::error_code ec;
      std::filesystem::remove(dir + "/fio.bench", ec);
    }
  }
  std::vector<RebuildRun> rebuilds;
  for (uint64_t n : rebuild_sizes) {
    auto r = RunRebuild(o, dir, n);
    if (!r) return 1;
    rebuilds.push_back(*r);
  }

  const double sw = MedianOf(store_w), sr = MedianOf(store_r), fw = MedianOf(fio_w), fr = MedianOf(fio_r);
  const double xw = MedianOf(fixed_w), xr = MedianOf(fixed_r);
  const std::string fs = flexkv::SsdFilesystemName(dir);
  if (o.json) {
    Json report{{"bench", "ssd"},
                {"dir", dir},
                {"filesystem", fs},
                {"block_bytes", o.block_size},
                {"queue_depth", o.queue_depth},
                {"bytes_per_round", blocks * o.block_size},
                {"rounds", o.rounds},
                {"fio_fixedbufs", o.fio_fixedbufs},
                {"store_write_mb_s", Whole(sw / 1e6)},
                {"store_read_mb_s", Whole(sr / 1e6)}};
    if (o.fixed) {
      report["store_fixed_write_mb_s"] = Whole(xw / 1e6);
      report["store_fixed_read_mb_s"] = Whole(xr / 1e6);
    }
    if (!o.no_fio) {
      report["fio_write_mb_s"] = Whole(fw / 1e6);
      report["fio_read_mb_s"] = Whole(fr / 1e6);
      report["write_ratio"] = Rounded(fw > 0 ? sw / fw : 0, 3);
      report["read_ratio"] = Rounded(fr > 0 ? sr / fr : 0, 3);
      if (o.fixed) {
        report["fixed_write_ratio"] = Rounded(fw > 0 ? xw / fw : 0, 3);
        report["fixed_read_ratio"] = Rounded(fr > 0 ? xr / fr : 0, 3);
      }
    }
    Json rb = Json::array();
    for (const RebuildRun& r : rebuilds) {
      rb.push_back({{"blocks", r.blocks},
                    {"payload_bytes", o.rebuild_payload},
                    {"file_bytes", r.file_bytes},
                    {"rebuilt", r.rebuilt},
                    {"open_s", Rounded(r.open_s, 3)},
                    {"blocks_per_s", Whole(static_cast<double>(r.rebuilt) / r.open_s)},
                    {"page_cache_dropped", r.dropped_cache}});
    }
    report["rebuild"] = std::move(rb);
    fmt::print("{}", DumpLine(report));
  } else {
    fmt::print("SSD store vs fio: {} ({}), blocks of {}, queue depth {}, {} per round, {} round(s), medians; fio {}\n",
               dir, fs, flexkv::FormatByteSize(o.block_size), o.queue_depth,
               flexkv::FormatByteSize(blocks * o.block_size), o.rounds,
               o.fio_fixedbufs ? "with --fixedbufs" : "without --fixedbufs");
    fmt::print("{:<52} {:>11} {:>9} {:>7}\n", "direction, store I/O", "store MB/s", "fio MB/s", "ratio");
    auto line = [&](const std::string& what, double s, double f) {
      if (o.no_fio) fmt::print("{:<52} {:>11.0f} {:>9} {:>7}\n", what, s / 1e6, "-", "-");
      else fmt::print("{:<52} {:>11.0f} {:>9.0f} {:>7.3f}\n", what, s / 1e6, f / 1e6, f > 0 ? s / f : 0.0);
    };
    line("write-back (DRAM -> SSD), one vectored I/O", sw, fw);
    if (o.fixed) line(fmt::format("write-back, fixed buffers (2 I/Os, {} fixed)", fixed_ios), xw, fw);
    line("promotion (SSD -> DRAM, verified), payload read", sr, fr);
    if (o.fixed) line("promotion, fixed buffer payload read", xr, fr);
    for (const RebuildRun& r : rebuilds) {
      fmt::print("rebuild after kill -9: {} blocks of {} ({} file): Open {:.3f} s ({:.0f} blocks/s, {} rebuilt; "
                 "page cache {}; fill took {:.1f} s)\n",
                 r.blocks, flexkv::FormatByteSize(o.rebuild_payload), flexkv::FormatByteSize(r.file_bytes), r.open_s,
                 static_cast<double>(r.rebuilt) / r.open_s, r.rebuilt, r.dropped_cache ? "dropped" : "not dropped",
                 r.fill_s);
    }
  }
  return 0;
}

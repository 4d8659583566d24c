// flexkv-gpu-test-client: an engine stand-in with a vLLM-shaped KV cache in GPU memory (per TP rank, one
// tensor per layer: [2][blocks][chunk], LAYER_FIRST, as FLASH_ATTN's; with --layout layer-block-regions
// [blocks][2][chunk], as FlashInfer's and Triton's). Attaches, registers every rank with CUDA IPC
// handles, then runs --do steps, printing one line each:
//   ATTACHED <id> <block_bytes> <capacity> <gpu uuid> attach_us=<us> register_us=<us>
//   STORED <already_cached> <stored> <STATUS> <us>                                  (store:SEED:N)
//   LOADED <hits> <loaded> <equal 0|1> <STATUS> <us> <layer0_us> <in_order 0|1>     (load:SEED:N, layer-wise)
//   FIRSTSTORE <attempts> <us after Attach> <STATUS> <stored>                      (firststore:SEED:N)
//   BENCH store_gbps=… load_gbps=… store_us=… load_us=… layer0_us=… blocks=… bytes=…  (bench:N)
// With --tp 2 the ranks live in two worker processes (this program with --worker), as TP workers of one
// engine: each allocates its own shard, describes it (DescribeGpuKv) and hands the description to the
// attached process, which registers both. Chunk (layer, plane, block, rank) of SEED holds bytes that are a
// pure function of those, so any process can check them.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/client.h"
#include "common/cuda_driver.h"
#include "flexkv/cuda.h"
#include "tests/support/spawn.h"

namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

void FillChunk(uint64_t seed, uint32_t block, uint32_t layer, uint32_t plane, uint32_t rank, uint8_t* dst,
               uint64_t bytes) {
  uint64_t s = Mix(seed * 0x9E3779B97F4A7C15ULL + (uint64_t{block} << 24) + (uint64_t{layer} << 8) +
                   (uint64_t{plane} << 4) + rank);
  for (uint64_t off = 0; off < bytes; off += 8) {
    s = Mix(s + 0x9E3779B97F4A7C15ULL);
    std::memcpy(dst + off, &s, 8);
  }
}

std::vector<int32_t> Tokens(uint64_t seed, uint32_t blocks, uint32_t tokens_per_block) {
  std::vector<int32_t> t(uint64_t{blocks} * tokens_per_block);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(Mix(seed * 7919 + i) % 128000);
  return t;
}

double Us(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// One TP rank's cache. Fill/Poison/Check return false (Check: sets *equal) on CUDA errors.
class RankKv {
 public:
  virtual ~RankKv() = default;
  virtual flexkv::Result<flexkv::GpuKvRegistration> Registration() = 0;
  virtual bool Fill(uint64_t seed, uint32_t n) = 0;
  virtual bool Poison() = 0;
  virtual bool Check(uint64_t seed, uint32_t n, bool* equal) = 0;
};

class LocalRank final : public RankKv {
 public:
  // vmm: the layers live back to back in one cuMem address range backed by physical allocations of two
  // granules each (exportable as POSIX fds, like PyTorch's expandable segments), so allocations straddle
  // layers and a layer spans several allocations.
  LocalRank(const flexkv::Geometry& g, uint32_t blocks, uint32_t rank, bool vmm, flexkv::KvLayout layout)
      : g_(g), blocks_(blocks), rank_(rank), vmm_(vmm), layout_(layout) {
    chunk_ = g.chunk_bytes_per_rank();
    region_ = uint64_t{g.kv_planes} * blocks * chunk_;
    layers_.resize(g.num_layers, nullptr);
    if (vmm_) {
      ok_ = MapVmm();
    } else {
      for (auto& p : layers_) ok_ &= cudaMalloc(&p, region_) == cudaSuccess;
    }
    host_.resize(chunk_);
  }
  ~LocalRank() override {
    if (vmm_) {
      const flexkv::CudaDriver& drv = flexkv::CudaDriver::Get();
      for (size_t i = 0; i < mapped_; ++i) drv.mem_unmap(va_ + i * piece_, piece_);
      if (va_ != 0) drv.mem_address_free(va_, reserved_);
      for (auto h : handles_) drv.mem_release(h);
    } else {
      for (auto* p : layers_) cudaFree(p);
    }
  }
  bool ok() const { return ok_; }
  flexkv::Result<flexkv::GpuKvRegistration> Registration() override {
    return flexkv::DescribeGpuKv(layout_, layers_, region_, blocks_, rank_);
  }
  bool Fill(uint64_t seed, uint32_t n) override {
    for (uint32_t l = 0; l < g_.num_layers; ++l) {
      for (uint32_t p = 0; p < g_.kv_planes; ++p) {
        for (uint32_t b = 0; b < n; ++b) {
          FillChunk(seed, b, l, p, rank_, host_.data(), chunk_);
          if (cudaMemcpy(Chunk(l, p, b), host_.data(), chunk_, cudaMemcpyHostToDevice) != cudaSuccess) return false;
        }
      }
    }
    return true;
  }
  bool Poison() override {
    for (auto* p : layers_) {
      if (cudaMemset(p, 0xA5, region_) != cudaSuccess) return false;
    }
    return cudaDeviceSynchronize() == cudaSuccess;
  }
  bool Check(uint64_t seed, uint32_t n, bool* equal) override {
    std::vector<uint8_t> expect(chunk_);
    *equal = true;
    for (uint32_t l = 0; l < g_.num_layers && *equal; ++l) {
      for (uint32_t p = 0; p < g_.kv_planes && *equal; ++p) {
        for (uint32_t b = 0; b < n && *equal; ++b) {
          FillChunk(seed, b, l, p, rank_, expect.data(), chunk_);
          if (cudaMemcpy(host_.data(), Chunk(l, p, b), chunk_, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
          *equal = std::memcmp(expect.data(), host_.data(), chunk_) == 0;
        }
      }
    }
    return true;
  }

 private:
  bool MapVmm() {
    const flexkv::CudaDriver& drv = flexkv::CudaDriver::Get();
    int device = 0;
    if (!drv.complete || cudaGetDevice(&device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) return false;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granule = 0;
    if (drv.mem_get_allocation_granularity(&granule, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return false;
    const size_t piece = piece_ = 2 * granule;
    const uint64_t need = region_ * g_.num_layers;
    reserved_ = (need + piece - 1) / piece * piece;
    if (drv.mem_address_reserve(&va_, reserved_, 0, 0, 0) != CUDA_SUCCESS) {
      va_ = 0;
      return false;
    }
    for (size_t off = 0; off < reserved_; off += piece) {
      CUmemGenericAllocationHandle h = 0;
      if (drv.mem_create(&h, piece, &prop, 0) != CUDA_SUCCESS) return false;
      handles_.push_back(h);
      if (drv.mem_map(va_ + off, piece, 0, h, 0) != CUDA_SUCCESS) return false;
      ++mapped_;
    }
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (drv.mem_set_access(va_, reserved_, &access, 1) != CUDA_SUCCESS) return false;
    for (uint32_t l = 0; l < g_.num_layers; ++l) layers_[l] = reinterpret_cast<void*>(va_ + l * region_);
    return true;
  }

  // Where the engine keeps chunk (l, p, b): written here from the tensors' shapes, independently of the daemon.
  uint8_t* Chunk(uint32_t l, uint32_t p, uint32_t b) {
    const bool blocks_outer = layout_ == flexkv::KvLayout::kLayerBlockRegions;  // [blocks][2], else [2][blocks]
    const uint64_t index = blocks_outer ? uint64_t{b} * g_.kv_planes + p : uint64_t{p} * blocks_ + b;
    return static_cast<uint8_t*>(layers_[l]) + index * chunk_;
  }
  flexkv::Geometry g_;
  uint32_t blocks_, rank_;
  uint64_t chunk_ = 0, region_ = 0;
  bool vmm_ = false;
  flexkv::KvLayout layout_;
  std::vector<void*> layers_;
  std::vector<uint8_t> host_;
  bool ok_ = true;
  CUdeviceptr va_ = 0;  // vmm
  size_t reserved_ = 0, piece_ = 0, mapped_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;
};

std::string Hex(const std::string& bytes) {
  std::string out;
  char buf[3];
  for (unsigned char c : bytes) {
    std::snprintf(buf, sizeof(buf), "%02x", c);
    out += buf;
  }
  return out;
}

std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// "REG uuid layout blocks rank n hex:offset:bytes ..."
std::string Serialize(const flexkv::GpuKvRegistration& r) {
  std::ostringstream os;
  os << "REG " << r.gpu_uuid << ' ' << static_cast<int>(r.layout) << ' ' << r.num_blocks << ' ' << r.tp_rank << ' '
     << r.regions.size();
  for (const auto& region : r.regions) os << ' ' << Hex(region.ipc_handle) << ':' << region.offset << ':' << region.bytes;
  return os.str();
}

bool Deserialize(const std::string& line, flexkv::GpuKvRegistration* r) {
  std::istringstream is(line);
  std::string tag;
  int layout = 0;
  size_t n = 0;
  if (!(is >> tag >> r->gpu_uuid >> layout >> r->num_blocks >> r->tp_rank >> n) || tag != "REG") return false;
  r->layout = static_cast<flexkv::KvLayout>(layout);
  for (size_t i = 0; i < n; ++i) {
    std::string item;
    if (!(is >> item)) return false;
    const size_t a = item.find(':'), b = item.rfind(':');
    if (a == std::string::npos || a == b) return false;
    r->regions.push_back({Unhex(item.substr(0, a)), std::stoull(item.substr(a + 1, b - a - 1)), std::stoull(item.substr(b + 1))});
  }
  return true;
}

// A rank in a TP worker process, driven over its stdin/stdout.
class WorkerRank final : public RankKv {
 public:
  WorkerRank(const std::vector<std::string>& argv) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return;
    auto pid = flexkv::testing::SpawnChild(argv, {{STDIN_FILENO, in[0], "", 0}, {STDOUT_FILENO, out[1], "", 0}}, {},
                                           "/proc/self/exe");
    pid_ = pid.ok() ? *pid : -1;
    close(in[0]);
    close(out[1]);
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
  }
  ~WorkerRank() override {
    if (to_ != nullptr) fclose(to_);  // the worker exits on EOF
    if (from_ != nullptr) fclose(from_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  flexkv::Result<flexkv::GpuKvRegistration> Registration() override {
    const std::string line = ReadLine();
    flexkv::GpuKvRegistration r;
    if (!Deserialize(line, &r)) return flexkv::Status::Internal("worker said: " + line);
    return r;
  }
  bool Fill(uint64_t seed, uint32_t n) override { return Ask("fill " + std::to_string(seed) + " " + std::to_string(n)) == "OK"; }
  bool Poison() override { return Ask("poison") == "OK"; }
  bool Check(uint64_t seed, uint32_t n, bool* equal) override {
    const std::string r = Ask("check " + std::to_string(seed) + " " + std::to_string(n));
    *equal = r == "EQUAL 1";
    return r.rfind("EQUAL", 0) == 0;
  }

 private:
  std::string ReadLine() {
    char buf[65536];
    if (from_ == nullptr || std::fgets(buf, sizeof(buf), from_) == nullptr) return "EOF";
    std::string s = buf;
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  std::string Ask(const std::string& cmd) {
    if (to_ == nullptr) return "EOF";
    std::fprintf(to_, "%s\n", cmd.c_str());
    std::fflush(to_);
    return ReadLine();
  }
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

int RunWorker(const flexkv::Geometry& g, uint32_t blocks, uint32_t rank, flexkv::KvLayout layout) {
  LocalRank kv(g, blocks, rank, /*vmm=*/false, layout);  // a worker's description travels as text: IPC handles only
  auto reg = kv.ok() ? kv.Registration() : flexkv::Result<flexkv::GpuKvRegistration>(flexkv::Status::Internal("cudaMalloc"));
  if (!reg.ok()) {
    std::printf("ERROR %s\n", reg.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", Serialize(*reg).c_str());
  std::fflush(stdout);
  char line[256];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    unsigned long long seed = 0;
    unsigned n = 0;
    if (std::sscanf(line, "fill %llu %u", &seed, &n) == 2) {
      std::printf("%s\n", kv.Fill(seed, n) ? "OK" : "ERROR");
    } else if (std::strncmp(line, "poison", 6) == 0) {
      std::printf("%s\n", kv.Poison() ? "OK" : "ERROR");
    } else if (std::sscanf(line, "check %llu %u", &seed, &n) == 2) {
      bool equal = false;
      std::printf("%s\n", kv.Check(seed, n, &equal) ? (equal ? "EQUAL 1" : "EQUAL 0") : "ERROR");
    } else {
      std::printf("ERROR unknown command\n");
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexkv GPU test client"};
  std::string socket, name = "gpu-client", ns = "test-model";
  flexkv::Geometry g = flexkv::Llama3_8B();
  uint32_t kv_blocks = 1024, tp_rank = 0;
  bool worker = false, vmm = false;
  std::vector<std::string> steps;
  app.add_option("--socket", socket);
  app.add_option("--name", name);
  app.add_option("--namespace", ns);
  app.add_option("--layers", g.num_layers);
  app.add_option("--heads", g.kv_heads_per_rank, "KV heads per TP rank");
  app.add_option("--tp", g.tp_size, "TP ranks; each > 1 runs in its own worker process");
  app.add_option("--kv-blocks", kv_blocks);
  app.add_flag("--worker", worker, "internal: one TP rank, driven over stdin/stdout");
  app.add_option("--tp-rank", tp_rank);
  int64_t start_at_ms = 0;
  uint32_t load_repeat = 1;
  app.add_option("--load-repeat", load_repeat,
                 "load steps run K match+load+release rounds back to back and check the bytes once at the end; "
                 "LOADED's <us> is then the wall time of all K")->check(CLI::Range(1u, 1000u));
  app.add_option("--start-at-ms", start_at_ms,
                 "run the --do steps at this CLOCK_REALTIME time (ms since the epoch), after attaching and "
                 "registering: a start barrier for engines measured together");
  app.add_flag("--vmm", vmm, "allocate the KV cache with cuMem (VMM, shareable fds) instead of cudaMalloc");
  app.add_option("--do", steps, "store:SEED:N, firststore:SEED:N, load:SEED:N, bench:N, hold");
  std::string layout_name = "layer-first";
  app.add_option("--layout", layout_name,
                 "layer-first: per layer [2][blocks][chunk] (FLASH_ATTN); layer-block-regions: per layer "
                 "[blocks][2][chunk] (FlashInfer, Triton)")
      ->check(CLI::IsMember({"layer-first", "layer-block-regions"}));
  CLI11_PARSE(app, argc, argv);
  const flexkv::KvLayout layout =
      layout_name == "layer-first" ? flexkv::KvLayout::kLayerFirst : flexkv::KvLayout::kLayerBlockRegions;
  setvbuf(stdout, nullptr, _IOLBF, 0);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("NOGPU\n");
    return 0;
  }
  if (worker) return RunWorker(g, kv_blocks, tp_rank, layout);

  std::vector<std::unique_ptr<RankKv>> ranks;
  if (g.tp_size == 1) {
    auto local = std::make_unique<LocalRank>(g, kv_blocks, 0, vmm, layout);
    if (!local->ok()) {
      std::printf("ERROR INTERNAL %s of the KV cache failed\n", vmm ? "cuMem allocation" : "cudaMalloc");
      return 1;
    }
    ranks.push_back(std::move(local));
  } else {
    for (uint32_t r = 0; r < g.tp_size; ++r) {
      ranks.push_back(std::make_unique<WorkerRank>(std::vector<std::string>{
          "flexkv-gpu-test-client", "--worker", "--tp-rank", std::to_string(r), "--tp", std::to_string(g.tp_size),
          "--layers", std::to_string(g.num_layers), "--heads", std::to_string(g.kv_heads_per_rank), "--kv-blocks",
          std::to_string(kv_blocks), "--layout", layout_name}));
    }
  }

  auto client = flexkv::Client::Connect({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(30000)});
  if (!client.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(client.status().code()), client.status().message().c_str());
    return 3;
  }
  flexkv::Client& c = **client;
  flexkv::AttachOptions options{name, 0, 0, ns, g};
  const auto attach_t0 = std::chrono::steady_clock::now();
  auto session = c.Attach(options);
  const auto attached_at = std::chrono::steady_clock::now();
  if (!session.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(session.status().code()), session.status().message().c_str());
    return 1;
  }
  std::string uuid;
  for (auto& rank : ranks) {
    auto reg = rank->Registration();
    flexkv::Status registered = reg.ok() ? c.RegisterGpuKv(*reg) : reg.status();
    if (!registered.ok()) {
      std::printf("ERROR %s %s\n", flexkv::StatusCodeName(registered.code()), registered.message().c_str());
      return 1;
    }
    uuid = reg->gpu_uuid;
  }
  // attach_us: the Attach call; register_us: registering the GPU KV caches after it (both on an engine's start).
  std::printf("ATTACHED %llu %llu %llu %s attach_us=%.0f register_us=%.0f\n",
              static_cast<unsigned long long>(session->session_id),
              static_cast<unsigned long long>(session->block_bytes),
              static_cast<unsigned long long>(session->capacity_blocks), uuid.c_str(), Us(attach_t0, attached_at),
              Us(attached_at, std::chrono::steady_clock::now()));

  if (start_at_ms > 0) {
    std::this_thread::sleep_until(std::chrono::system_clock::time_point(std::chrono::milliseconds(start_at_ms)));
  }
  const auto timeout = std::chrono::seconds(60);
  for (const std::string& step : steps) {
    if (step == "hold") {
      for (;;) pause();
    }
    unsigned long long seed = 0;
    unsigned n = 0;
    char op[16] = {};
    if (std::sscanf(step.c_str(), "%15[a-z]:%llu:%u", op, &seed, &n) < 2) {
      std::printf("ERROR INVALID_ARGUMENT bad step '%s'\n", step.c_str());
      return 2;
    }
    const std::string what = op;
    if (what == "bench") {  // bench:N — fresh keys every run, so the store really copies
      n = static_cast<unsigned>(seed);
      seed = static_cast<unsigned long long>(getpid()) * 1000003ULL + static_cast<unsigned long long>(time(nullptr));
    }
    if (n == 0 || n > kv_blocks) {
      std::printf("ERROR INVALID_ARGUMENT block count in '%s'\n", step.c_str());
      return 2;
    }
    const auto keys = flexkv::ComputeBlockKeys(ns, Tokens(seed, n, g.tokens_per_block), g.tokens_per_block);
    std::vector<uint32_t> ids(n);
    for (uint32_t i = 0; i < n; ++i) ids[i] = i;
    auto fill = [&] {
      for (auto& rank : ranks) {
        if (!rank->Fill(seed, n)) return false;
      }
      return true;
    };
    auto store = [&](double* us) -> flexkv::Result<flexkv::OpResult> {
      const auto t0 = std::chrono::steady_clock::now();
      auto t = c.Store(flexkv::BlockKeyChain(keys), ids);
      if (!t.ok()) return t.status();
      auto r = c.Wait(*t, timeout);
      *us = Us(t0, std::chrono::steady_clock::now());
      return r;
    };
    // Match (pin), layer-wise Load, Release. Checks that layers are reported in order, each at most once.
    auto load = [&](double* us, double* layer0_us, uint32_t* hits, bool* in_order) -> flexkv::Result<flexkv::OpResult> {
      auto mt = c.Match(keys, true);
      if (!mt.ok()) return mt.status();
      auto m = c.Wait(*mt, timeout);
      if (!m.ok()) return m.status();
      *hits = m->matched_blocks;
      *in_order = true;
      if (*hits == 0) return flexkv::OpResult{};
      const auto t0 = std::chrono::steady_clock::now();
      auto lt = c.Load(m->match_handle, std::span(ids.data(), *hits), /*layerwise=*/true);
      if (!lt.ok()) return lt.status();
      uint32_t seen = 0;
      for (uint32_t layer = 1; layer <= g.num_layers; ++layer) {
        auto landed = c.WaitLayers(*lt, layer, timeout);
        if (!landed.ok()) return landed.status();
        if (layer == 1) *layer0_us = Us(t0, std::chrono::steady_clock::now());
        *in_order &= *landed >= layer && *landed >= seen;
        seen = *landed;
      }
      auto l = c.Wait(*lt, timeout);
      *us = Us(t0, std::chrono::steady_clock::now());
      auto rel = c.Release(m->match_handle);
      if (rel.ok()) (void)c.Wait(*rel, timeout);
      return l;
    };
    if (what == "store") {
      if (!fill()) {
        std::printf("ERROR INTERNAL filling the GPU cache failed\n");
        return 1;
      }
      double us = 0;
      auto r = store(&us);
      if (!r.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
        return 1;
      }
      std::printf("STORED %u %u %s %.0f\n", r->matched_blocks, r->done_blocks, flexkv::StatusCodeName(r->status.code()), us);
    } else if (what == "load") {
      for (auto& rank : ranks) {
        if (!rank->Poison()) {
          std::printf("ERROR INTERNAL poisoning the GPU cache failed\n");
          return 1;
        }
      }
      double us = 0, layer0 = 0, round_us = 0;
      uint32_t hits = 0;
      bool in_order = false;
      flexkv::Result<flexkv::OpResult> r = flexkv::Status::Internal("no load ran");
      for (uint32_t k = 0; k < load_repeat; ++k) {
        r = load(&round_us, &layer0, &hits, &in_order);
        us += round_us;
        if (!r.ok() || !r->status.ok()) break;
      }
      if (!r.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
        return 1;
      }
      bool equal = true;
      for (auto& rank : ranks) {
        bool rank_equal = false;
        if (!rank->Check(seed, r->done_blocks, &rank_equal)) {
          std::printf("ERROR INTERNAL reading the GPU cache back failed\n");
          return 1;
        }
        equal &= rank_equal;
      }
      std::printf("LOADED %u %u %d %s %.0f %.0f %d\n", hits, r->done_blocks, equal ? 1 : 0,
                  flexkv::StatusCodeName(r->status.code()), us, layer0, in_order ? 1 : 0);
    } else if (what == "firststore") {
      // firststore:SEED:N — a store retried every 10 ms while the daemon answers UNAVAILABLE (its pool is being
      // prepared in the background), for up to 120 s after Attach returned. Prints
      // FIRSTSTORE <attempts> <us from Attach's return to the first stored block> <STATUS> <stored>.
      if (!fill()) {
        std::printf("ERROR INTERNAL filling the GPU cache failed\n");
        return 1;
      }
      unsigned attempts = 0;
      double us = 0;
      flexkv::Result<flexkv::OpResult> r = flexkv::Status::Internal("no store ran");
      for (;;) {
        ++attempts;
        r = store(&us);
        const flexkv::StatusCode code = r.ok() ? r->status.code() : r.status().code();
        if (code != flexkv::StatusCode::kUnavailable ||
            Us(attached_at, std::chrono::steady_clock::now()) > 120e6) {
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!r.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
        return 1;
      }
      std::printf("FIRSTSTORE %u %.0f %s %u\n", attempts, Us(attached_at, std::chrono::steady_clock::now()),
                  flexkv::StatusCodeName(r->status.code()), r->done_blocks);
    } else if (what == "bench") {
      if (!fill()) return 1;
      double store_us = 0, load_us = 0, layer0 = 0;
      uint32_t hits = 0;
      bool in_order = false;
      auto s = store(&store_us);
      auto l = s.ok() ? load(&load_us, &layer0, &hits, &in_order) : s;
      if (!s.ok() || !l.ok() || !s->status.ok() || !l->status.ok() || s->done_blocks != n || l->done_blocks != n) {
        std::printf("ERROR INTERNAL bench store/load did not complete\n");
        return 1;
      }
      const double bytes = static_cast<double>(n) * static_cast<double>(g.host_block_bytes());
      std::printf("BENCH store_gbps=%.2f load_gbps=%.2f store_us=%.0f load_us=%.0f layer0_us=%.0f blocks=%u bytes=%.0f\n",
                  bytes / store_us / 1e3, bytes / load_us / 1e3, store_us, load_us, layer0, n, bytes);
    } else {
      std::printf("ERROR INVALID_ARGUMENT unknown step '%s'\n", step.c_str());
      return 2;
    }
  }
  return 0;
}

// See transfer_layer_events.h.
#include "transfer_layer_events.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "bench_process.h"
#include "flexkv/client.h"
#include "flexkv/cuda.h"

namespace flexkv::bench::transfer {
namespace {

using namespace std::chrono_literals;

double MedianUs(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Owns what the measurement allocates on the device; everything is freed on every path.
struct DeviceState {
  std::vector<void*> layers;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  std::vector<cudaEvent_t> marks;
  ~DeviceState() {
    for (cudaEvent_t e : marks) cudaEventDestroy(e);
    if (start != nullptr) cudaEventDestroy(start);
    if (stream != nullptr) cudaStreamDestroy(stream);
    for (void* p : layers) cudaFree(p);
  }
};

#define FLEXKV_BENCH_TRY_CUDA(expr)                                                                 \
  do {                                                                                              \
    const cudaError_t flexkv_e_ = (expr);                                                           \
    if (flexkv_e_ != cudaSuccess) return Fail(fmt::format("{}: {}", #expr, cudaGetErrorString(flexkv_e_))); \
  } while (0)
#define FLEXKV_BENCH_TRY(expr, what)                                                         \
  do {                                                                                       \
    const flexkv::Status flexkv_s_ = (expr);                                                 \
    if (!flexkv_s_.ok()) return Fail(fmt::format("{}: {}", what, flexkv_s_.ToString()));    \
  } while (0)

}  // namespace

DaemonLayerResult MeasureDaemonLayers(const DaemonLayerOptions& o) {
  DaemonLayerResult out;
  auto Fail = [&out](std::string why) {
    out = DaemonLayerResult{};
    out.error = std::move(why);
    return out;
  };
  Geometry g = Llama3_8B();
  g.num_layers = o.layers;
  const uint64_t chunk = g.chunk_bytes_per_rank();
  const uint64_t region = uint64_t{g.kv_planes} * o.blocks * chunk;
  const uint64_t bytes = region * o.layers;
  const uint64_t pool_mib = (bytes >> 20) + (bytes >> 21) + 64;  // the blocks and room to spare
  // One session pins the whole load (every block of it): the default cap (half the pool) would refuse it.
  auto daemon = OwnDaemon::Start("/dev/shm/flexkv-bench-events-XXXXXX",
                                 {"--pool-size", fmt::format("{}MiB", pool_mib), "--max-session-pin-share", "1"});
  if (daemon == nullptr) return Fail("could not start flexkvd (next to this executable)");
  auto connected = Client::Connect({daemon->socket(), 15000ms, 30000ms});
  if (!connected.ok()) return Fail("connect: " + connected.status().ToString());
  Client& c = **connected;
  AttachOptions attach;
  attach.client_name = "bench-layer-events";
  attach.model_namespace = "bench-llama3-8b";
  attach.geometry = g;
  auto session = c.Attach(attach);
  if (!session.ok()) return Fail("attach: " + session.status().ToString());

  DeviceState dev;
  FLEXKV_BENCH_TRY_CUDA(cudaSetDevice(0));
  dev.layers.assign(o.layers, nullptr);
  for (uint32_t l = 0; l < o.layers; ++l) {
    FLEXKV_BENCH_TRY_CUDA(cudaMalloc(&dev.layers[l], region));
    FLEXKV_BENCH_TRY_CUDA(cudaMemset(dev.layers[l], static_cast<int>(l + 1), region));
  }
  auto reg = DescribeGpuKv(KvLayout::kLayerFirst, dev.layers, region, o.blocks, 0);
  if (!reg.ok()) return Fail("DescribeGpuKv: " + reg.status().ToString());
  FLEXKV_BENCH_TRY(c.RegisterGpuKv(*reg), "RegisterGpuKv");
  FLEXKV_BENCH_TRY_CUDA(cudaStreamCreateWithFlags(&dev.stream, cudaStreamNonBlocking));
  FLEXKV_BENCH_TRY_CUDA(cudaEventCreate(&dev.start));
  dev.marks.assign(o.layers, nullptr);
  for (cudaEvent_t& e : dev.marks) FLEXKV_BENCH_TRY_CUDA(cudaEventCreate(&e));

  std::vector<int32_t> tokens(size_t{o.blocks} * g.tokens_per_block);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + 3);
  const std::vector<BlockKey> keys = ComputeBlockKeys(attach.model_namespace, tokens, g.tokens_per_block);
  std::vector<uint32_t> ids(o.blocks);
  for (uint32_t b = 0; b < o.blocks; ++b) ids[b] = b;
  auto stored = c.Store(BlockKeyChain(keys), ids);
  if (!stored.ok()) return Fail("store: " + stored.status().ToString());
  auto stored_r = c.Wait(*stored, 120s);
  if (!stored_r.ok() || !stored_r->status.ok() || stored_r->done_blocks != o.blocks) {
    return Fail("store: " + (stored_r.ok() ? stored_r->status.ToString() : stored_r.status().ToString()));
  }

  auto events = CudaLayerEvents::Create(o.layers, 0);
  if (!events.ok()) return Fail("CudaLayerEvents: " + events.status().ToString());
  const LayerEventHandles handles = events->handles();
  auto set = LayerEventSet::Register(c, std::span<const LayerEventHandles>(&handles, 1));
  if (!set.ok()) return Fail("RegisterLayerEvents: " + set.status().ToString());

  std::vector<double> pf, pl, ef, el, pg, eg;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    for (const bool use_events : {false, true}) {
      auto m = c.Match(keys, true);
      if (!m.ok()) return Fail("match: " + m.status().ToString());
      auto mr = c.Wait(*m, 30s);
      if (!mr.ok() || mr->matched_blocks != o.blocks) return Fail("match: not every block is cached");
      FLEXKV_BENCH_TRY_CUDA(cudaStreamSynchronize(dev.stream));
      FLEXKV_BENCH_TRY_CUDA(cudaEventRecord(dev.start, dev.stream));  // the stream is idle: this is "now"
      const auto t0 = std::chrono::steady_clock::now();
      auto t = use_events ? c.LoadWithEvents(mr->match_handle, ids, set->id()) : c.Load(mr->match_handle, ids, true);
      if (!t.ok()) return Fail("load: " + t.status().ToString());
      if (use_events) {
        FLEXKV_BENCH_TRY(c.WaitLaunched(*t, 60s), "WaitLaunched");
        for (uint32_t l = 0; l < o.layers; ++l) {  // no CPU wait between layers
          FLEXKV_BENCH_TRY(events->StreamWait(l, dev.stream), "StreamWait");
          FLEXKV_BENCH_TRY_CUDA(cudaEventRecord(dev.marks[l], dev.stream));
        }
      } else {
        for (uint32_t l = 0; l < o.layers; ++l) {  // the engine's CPU sees each layer, then launches on its stream
          auto landed = c.WaitLayers(*t, l + 1, 60s);
          if (!landed.ok()) return Fail("WaitLayers: " + landed.status().ToString());
          FLEXKV_BENCH_TRY_CUDA(cudaEventRecord(dev.marks[l], dev.stream));
        }
      }
      auto r = c.Wait(*t, 60s);
      const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!r.ok() || !r->status.ok()) return Fail("load: " + (r.ok() ? r->status.ToString() : r.status().ToString()));
      FLEXKV_BENCH_TRY_CUDA(cudaEventSynchronize(dev.marks.back()));
      float first = 0, last = 0;
      FLEXKV_BENCH_TRY_CUDA(cudaEventElapsedTime(&first, dev.start, dev.marks.front()));
      FLEXKV_BENCH_TRY_CUDA(cudaEventElapsedTime(&last, dev.start, dev.marks.back()));
      auto rel = c.Release(mr->match_handle);
      if (rel.ok()) (void)c.Wait(*rel, 30s);
      if (i < o.warmup) continue;
      (use_events ? ef : pf).push_back(first);
      (use_events ? el : pl).push_back(last);
      (use_events ? eg : pg).push_back(static_cast<double>(bytes) / total_s / 1e9);
    }
  }
  out.progress_first_ms = MedianUs(pf);
  out.progress_last_ms = MedianUs(pl);
  out.events_first_ms = MedianUs(ef);
  out.events_last_ms = MedianUs(el);
  out.load_gbps_progress = MedianUs(pg);
  out.load_gbps_events = MedianUs(eg);
  return out;
}

}  // namespace flexkv::bench::transfer

// flexkv-gpu-test-client: an engine stand-in with a vLLM-shaped KV cache in GPU memory (one tensor of
// [2][blocks][chunk] per layer, LAYERFIRST). Attaches, registers the cache with CUDA IPC handles, then
// runs --do steps, printing one line each:
//   ATTACHED <id> <block_bytes> <capacity> <gpu uuid>
//   STORED <already_cached> <stored> <STATUS> <us>                       (store:SEED:N)
//   LOADED <hits> <loaded> <equal 0|1> <STATUS> <us> <first_layer_us>  (load:SEED:N, layer-wise)
//   BENCH store_gbps=<x> load_gbps=<y> store_us=<a> load_us=<b> layer0_us=<c> blocks=<n> bytes=<m>  (bench:N)
// Chunk (layer, plane, block) of SEED holds bytes that are a pure function of (SEED, block, layer, plane).
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flexkv/client.h"
#include "flexkv/cuda.h"

namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

void FillChunk(uint64_t seed, uint32_t block, uint32_t layer, uint32_t plane, uint8_t* dst, uint64_t bytes) {
  uint64_t s = Mix(seed * 0x9E3779B97F4A7C15ULL + (uint64_t{block} << 20) + (uint64_t{layer} << 4) + plane);
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

#define CHECK_CUDA(expr)                                                                     \
  do {                                                                                       \
    cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::printf("ERROR INTERNAL %s: %s\n", #expr, cudaGetErrorString(e_));                 \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

double Us(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexkv GPU test client"};
  std::string socket, name = "gpu-client", ns = "test-model";
  flexkv::Geometry g = flexkv::Llama3_8B();
  uint32_t kv_blocks = 1024;
  std::vector<std::string> steps;
  app.add_option("--socket", socket);
  app.add_option("--name", name);
  app.add_option("--namespace", ns);
  app.add_option("--layers", g.num_layers);
  app.add_option("--heads", g.kv_heads_per_rank);
  app.add_option("--kv-blocks", kv_blocks);
  app.add_option("--do", steps, "store:SEED:N, load:SEED:N, bench:N, hold");
  CLI11_PARSE(app, argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("NOGPU\n");
    return 0;
  }
  const uint64_t chunk = g.chunk_bytes_per_rank();
  const uint64_t region = uint64_t{g.kv_planes} * kv_blocks * chunk;
  std::vector<void*> layers(g.num_layers);
  for (auto& p : layers) CHECK_CUDA(cudaMalloc(&p, region));

  auto client = flexkv::Client::Connect({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(10000)});
  if (!client.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(client.status().code()), client.status().message().c_str());
    return 3;
  }
  flexkv::Client& c = **client;
  flexkv::AttachOptions options{name, 0, 0, ns, g};
  auto session = c.Attach(options);
  if (!session.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(session.status().code()), session.status().message().c_str());
    return 1;
  }
  auto reg = flexkv::DescribeGpuKv(flexkv::KvLayout::kLayerFirst, layers, region, kv_blocks, 0);
  flexkv::Status registered = reg.ok() ? c.RegisterGpuKv(*reg) : reg.status();
  if (!registered.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(registered.code()), registered.message().c_str());
    return 1;
  }
  std::printf("ATTACHED %llu %llu %llu %s\n", static_cast<unsigned long long>(session->session_id),
              static_cast<unsigned long long>(session->block_bytes),
              static_cast<unsigned long long>(session->capacity_blocks), reg->gpu_uuid.c_str());

  std::vector<uint8_t> host(chunk);
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
    auto fill = [&]() -> int {
      for (uint32_t l = 0; l < g.num_layers; ++l) {
        for (uint32_t p = 0; p < g.kv_planes; ++p) {
          for (uint32_t b = 0; b < n; ++b) {
            FillChunk(seed, b, l, p, host.data(), chunk);
            auto* dst = static_cast<uint8_t*>(layers[l]) + (uint64_t{p} * kv_blocks + b) * chunk;
            CHECK_CUDA(cudaMemcpy(dst, host.data(), chunk, cudaMemcpyHostToDevice));
          }
        }
      }
      return 0;
    };
    auto store = [&](double* us) -> flexkv::Result<flexkv::OpResult> {
      const auto t0 = std::chrono::steady_clock::now();
      auto t = c.Store(keys, ids);
      if (!t.ok()) return t.status();
      auto r = c.Wait(*t, timeout);
      *us = Us(t0, std::chrono::steady_clock::now());
      return r;
    };
    auto load = [&](double* us, double* layer0_us, uint32_t* hits) -> flexkv::Result<flexkv::OpResult> {
      auto mt = c.Match(keys, true);
      if (!mt.ok()) return mt.status();
      auto m = c.Wait(*mt, timeout);
      if (!m.ok()) return m.status();
      *hits = m->matched_blocks;
      if (*hits == 0) return flexkv::OpResult{};
      const auto t0 = std::chrono::steady_clock::now();
      auto lt = c.Load(m->match_handle, std::span(ids.data(), *hits), /*layerwise=*/true);
      if (!lt.ok()) return lt.status();
      auto first = c.WaitLayers(*lt, 1, timeout);
      *layer0_us = Us(t0, std::chrono::steady_clock::now());
      if (!first.ok()) return first.status();
      auto l = c.Wait(*lt, timeout);
      *us = Us(t0, std::chrono::steady_clock::now());
      auto rel = c.Release(m->match_handle);
      if (rel.ok()) (void)c.Wait(*rel, timeout);
      return l;
    };
    if (what == "store") {
      if (fill() != 0) return 1;
      double us = 0;
      auto r = store(&us);
      if (!r.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
        return 1;
      }
      std::printf("STORED %u %u %s %.0f\n", r->matched_blocks, r->done_blocks, flexkv::StatusCodeName(r->status.code()), us);
    } else if (what == "load") {
      for (auto* p : layers) CHECK_CUDA(cudaMemset(p, 0xA5, region));  // poison
      double us = 0, layer0 = 0;
      uint32_t hits = 0;
      auto r = load(&us, &layer0, &hits);
      if (!r.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
        return 1;
      }
      bool equal = true;
      std::vector<uint8_t> expect(chunk);
      for (uint32_t l = 0; l < g.num_layers && equal; ++l) {
        for (uint32_t p = 0; p < g.kv_planes && equal; ++p) {
          for (uint32_t b = 0; b < r->done_blocks && equal; ++b) {
            FillChunk(seed, b, l, p, expect.data(), chunk);
            const auto* src = static_cast<uint8_t*>(layers[l]) + (uint64_t{p} * kv_blocks + b) * chunk;
            CHECK_CUDA(cudaMemcpy(host.data(), src, chunk, cudaMemcpyDeviceToHost));
            equal = std::memcmp(expect.data(), host.data(), chunk) == 0;
          }
        }
      }
      std::printf("LOADED %u %u %d %s %.0f %.0f\n", hits, r->done_blocks, equal ? 1 : 0,
                  flexkv::StatusCodeName(r->status.code()), us, layer0);
    } else if (what == "bench") {
      if (fill() != 0) return 1;
      double store_us = 0, load_us = 0, layer0 = 0;
      uint32_t hits = 0;
      auto s = store(&store_us);
      auto l = s.ok() ? load(&load_us, &layer0, &hits) : s;
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
  for (auto* p : layers) cudaFree(p);
  return 0;
}

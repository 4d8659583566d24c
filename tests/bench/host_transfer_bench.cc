// flexkv-bench transfer --host: what a block's content checksum costs the host store path, and how fast the
// restart check and the scrubber read (see host_transfer_bench.h).
//
//   Engine KV:  a sealed memfd of `blocks` blocks of the geometry (--layers, Llama-3-8B heads), BLOCKFIRST or
//               LAYERFIRST, mapped through HostKv as the host backend does.
//   Pool:       `blocks` slots in a /dev/shm file (as the daemon's), block i -> slot perm[i] (random).
//   Variants, interleaved round by round, each timed over all blocks (median of --rounds):
//     memcpy          the runs memcpy'd without a checksum (the copy before checksums existed)
//     fused           HostKv::CopyToSlot: each run copied and summed in one pass (the store path now)
//     memcpy+verify   memcpy, then ChecksumTermSum over each slot (the scheduler's fallback second pass)
//     verify          ChecksumTermSum over each slot alone (what the restart check and the scrub read per core)
//     keyed           (--keyed) a keyed candidate of the fused copy (issue 29 item 4): the same NH terms with
//                     their per-unit keys read from a 4 KiB table drawn from a secret (plus the unit's index
//                     step, so no two units of a block share keys), and each block's sum finished with
//                     HMAC-SHA256 under the secret: what a block MAC under the cluster secret would cost the copy
//   GB/s = 1e9 bytes of blocks per second.
#include "host_transfer_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <immintrin.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_json.h"
#include "common/block_checksum.h"
#include "common/mapped_region.h"
#include "common/unique_fd.h"
#include "daemon/transfer/host/host_kv.h"
#include "flexkv/geometry.h"

namespace {

using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Rounded;
using Clock = std::chrono::steady_clock;

double MedianSeconds(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The keyed candidate's key table: 256 units' four 32-bit keys, then their multipliers' steps as the public sum.
struct KeyedTable {
  alignas(32) uint32_t keys[256 * 4];
};

// Copies a run and sums the NH terms of its units, each unit's keys = table[unit % 256] + unit * multipliers (AVX2,
// two units per vector, as the product's loop). `bytes` a multiple of 64.
__attribute__((target("avx2"))) uint64_t CopyKeyedAvx2(void* dst, const void* src, size_t bytes, uint32_t first_unit,
                                                       const KeyedTable& table) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const __m256i step = _mm256_setr_epi32(static_cast<int>(2 * 0x9E3779B1u), static_cast<int>(2 * 0xC2B2AE3Du),
                                         static_cast<int>(2 * 0x165667B1u), static_cast<int>(2 * 0xFD7046C5u),
                                         static_cast<int>(2 * 0x9E3779B1u), static_cast<int>(2 * 0xC2B2AE3Du),
                                         static_cast<int>(2 * 0x165667B1u), static_cast<int>(2 * 0xFD7046C5u));
  const __m256i first = _mm256_setr_epi32(static_cast<int>(first_unit * 0x9E3779B1u),
                                          static_cast<int>(first_unit * 0xC2B2AE3Du),
                                          static_cast<int>(first_unit * 0x165667B1u),
                                          static_cast<int>(first_unit * 0xFD7046C5u),
                                          static_cast<int>((first_unit + 1) * 0x9E3779B1u),
                                          static_cast<int>((first_unit + 1) * 0xC2B2AE3Du),
                                          static_cast<int>((first_unit + 1) * 0x165667B1u),
                                          static_cast<int>((first_unit + 1) * 0xFD7046C5u));
  __m256i idx0 = first, idx1 = _mm256_add_epi32(first, step);
  const __m256i step2 = _mm256_add_epi32(step, step);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  const size_t units = bytes / 16;
  for (size_t u = 0; u + 4 <= units; u += 4) {
    const uint32_t t = (first_unit + static_cast<uint32_t>(u)) & 255u;  // 4 units from a 4-aligned start never wrap
    const __m256i tk0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table.keys + t * 4));
    const __m256i tk1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table.keys + ((t + 2) & 255u) * 4));
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + u * 16));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + u * 16 + 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + u * 16), w0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + u * 16 + 32), w1);
    const __m256i a0 = _mm256_add_epi32(w0, _mm256_add_epi32(tk0, idx0));
    const __m256i a1 = _mm256_add_epi32(w1, _mm256_add_epi32(tk1, idx1));
    acc0 = _mm256_add_epi64(acc0, _mm256_mul_epu32(a0, _mm256_srli_epi64(a0, 32)));
    acc1 = _mm256_add_epi64(acc1, _mm256_mul_epu32(a1, _mm256_srli_epi64(a1, 32)));
    idx0 = _mm256_add_epi32(idx0, step2);
    idx1 = _mm256_add_epi32(idx1, step2);
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc0, acc1));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// The tag of a block: HMAC-SHA256(secret, term sum | block bytes | block index), cut to 8 bytes.
uint64_t KeyedFinish(const std::string& secret, uint64_t sum, uint64_t block_bytes, uint64_t block) {
  uint64_t in[3] = {sum, block_bytes, block};
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), reinterpret_cast<const unsigned char*>(in),
       sizeof in, out, &len);
  uint64_t tag = 0;
  std::memcpy(&tag, out, sizeof tag);
  return tag;
}

}  // namespace

int RunHostTransferBench(int argc, char** argv) {
  CLI::App app{"flexkv-bench transfer --host: host store copies with and without the content checksum"};
  bool host = false, json = false, keyed = false;
  uint32_t layers = 32, blocks = 256, rounds = 7;
  int cpu = -1;
  std::string layout = "blockfirst";
  app.add_flag("--host", host, "Host backend copies (this mode)");
  app.add_flag("--json", json, "One JSON line");
  app.add_flag("--keyed", keyed, "Also time the keyed candidate (a block MAC under a secret; blockfirst only)");
  app.add_option("--layers", layers, "Layers of the Llama-3-8B-shaped geometry (32: 2 MiB blocks)")->check(CLI::Range(1, 1024));
  app.add_option("--blocks", blocks, "Blocks copied per timed run")->check(CLI::Range(1, 1 << 20));
  app.add_option("--rounds", rounds, "Timed rounds (variants interleaved; the median is reported)")->check(CLI::Range(1, 1000));
  app.add_option("--cpu", cpu, "Pin this thread to one CPU (default: not pinned)");
  app.add_option("--layout", layout, "blockfirst or layerfirst")->check(CLI::IsMember({"blockfirst", "layerfirst"}));
  CLI11_PARSE(app, argc, argv);
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      std::fprintf(stderr, "flexkv-bench: cannot pin to CPU %d\n", cpu);
      return 1;
    }
  }
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = layers;
  const uint64_t block_bytes = g.host_block_bytes();
  const uint64_t kv_bytes = flexkv::KvBytesRequired(g, blocks);

  flexkv::UniqueFd memfd(memfd_create("flexkv-bench-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!memfd || ftruncate(memfd.get(), static_cast<off_t>(kv_bytes)) != 0 ||
      fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    std::fprintf(stderr, "flexkv-bench: cannot create the KV memfd\n");
    return 1;
  }
  auto fill = flexkv::MappedRegion::Shared("the bench KV memfd", memfd.get(), kv_bytes);
  if (!fill.ok()) return 1;
  std::mt19937_64 rng(42);
  for (uint64_t i = 0; i + 8 <= kv_bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(fill->bytes() + i, &v, 8);
  }
  auto kv = flexkv::HostKv::Map(std::move(memfd), g,
                                layout == "blockfirst" ? flexkv::KvLayout::kBlockFirst : flexkv::KvLayout::kLayerFirst,
                                blocks);
  if (!kv.ok()) {
    std::fprintf(stderr, "flexkv-bench: %s\n", kv.status().ToString().c_str());
    return 1;
  }
  const std::string pool_path = fmt::format("/dev/shm/flexkv-bench-host-{}", getpid());
  flexkv::UniqueFd pool_fd(open(pool_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  ::unlink(pool_path.c_str());
  const uint64_t pool_bytes = uint64_t{blocks} * block_bytes;
  if (!pool_fd || posix_fallocate(pool_fd.get(), 0, static_cast<off_t>(pool_bytes)) != 0) {
    std::fprintf(stderr, "flexkv-bench: cannot allocate the %llu-byte pool in /dev/shm\n",
                 static_cast<unsigned long long>(pool_bytes));
    return 1;
  }
  auto pool = flexkv::MappedRegion::Shared(pool_path, pool_fd.get(), pool_bytes);
  if (!pool.ok()) return 1;
  std::vector<uint32_t> perm(blocks);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  auto slot = [&](uint32_t b) { return pool->bytes() + uint64_t{perm[b]} * block_bytes; };

  // The plain copy of the runs, as HostKv copied before checksums: one memcpy per run of the layout.
  const uint64_t chunk = g.chunk_bytes_per_rank();
  const uint64_t L = g.num_layers, P = g.kv_planes;
  const uint8_t* base = fill->bytes();
  auto plain_copy = [&](uint32_t b, uint8_t* dst) {
    if (layout == "blockfirst") {
      std::memcpy(dst, base + uint64_t{b} * L * P * chunk, L * P * chunk);
      return;
    }
    for (uint64_t l = 0; l < L; ++l) {
      for (uint64_t p = 0; p < P; ++p) std::memcpy(dst + (l * P + p) * chunk, base + ((l * P + p) * blocks + b) * chunk, chunk);
    }
  };

  if (keyed && layout != "blockfirst") {
    std::fprintf(stderr, "flexkv-bench: --keyed times the blockfirst layout only\n");
    return 1;
  }
  const std::string secret = "flexkv-bench-cluster-secret-0123";
  KeyedTable table{};
  for (auto& k : table.keys) k = static_cast<uint32_t>(rng());
  // The keyed candidate copies a block as one run (blockfirst: one run per block).
  auto keyed_copy = [&](uint32_t b) {
    const uint64_t sum = CopyKeyedAvx2(slot(b), base + uint64_t{b} * L * P * chunk, block_bytes, 0, table);
    return KeyedFinish(secret, sum, block_bytes, b);
  };
  uint64_t sink = 0;
  std::vector<double> t_memcpy, t_fused, t_two_pass, t_verify, t_keyed;
  auto timed = [](auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  // A warm-up of each, then the rounds; the fused sums are checked against a second pass once.
  for (uint32_t b = 0; b < blocks; ++b) {
    const uint64_t fused = (*kv)->CopyToSlot(b, slot(b));
    if (fused != flexkv::ChecksumTermSum(slot(b), block_bytes, 0)) {
      std::fprintf(stderr, "flexkv-bench: the fused checksum of block %u differs from a second pass\n", b);
      return 1;
    }
  }
  for (uint32_t r = 0; r < rounds; ++r) {
    t_memcpy.push_back(timed([&] {
      for (uint32_t b = 0; b < blocks; ++b) plain_copy(b, slot(b));
    }));
    t_fused.push_back(timed([&] {
      for (uint32_t b = 0; b < blocks; ++b) sink += (*kv)->CopyToSlot(b, slot(b));
    }));
    t_two_pass.push_back(timed([&] {
      for (uint32_t b = 0; b < blocks; ++b) {
        plain_copy(b, slot(b));
        sink += flexkv::ChecksumTermSum(slot(b), block_bytes, 0);
      }
    }));
    t_verify.push_back(timed([&] {
      for (uint32_t b = 0; b < blocks; ++b) sink += flexkv::ChecksumTermSum(slot(b), block_bytes, 0);
    }));
    if (keyed) {
      t_keyed.push_back(timed([&] {
        for (uint32_t b = 0; b < blocks; ++b) sink += keyed_copy(b);
      }));
    }
  }
  const double bytes = static_cast<double>(blocks) * static_cast<double>(block_bytes);
  const double gb_memcpy = bytes / MedianSeconds(t_memcpy) / 1e9, gb_fused = bytes / MedianSeconds(t_fused) / 1e9;
  const double gb_two_pass = bytes / MedianSeconds(t_two_pass) / 1e9, gb_verify = bytes / MedianSeconds(t_verify) / 1e9;
  const double gb_keyed = keyed ? bytes / MedianSeconds(t_keyed) / 1e9 : 0;
  if (json) {
    std::fputs(DumpLine(Json{{"bench", "transfer-host"},
                  {"layout", layout},
                  {"block_bytes", block_bytes},
                  {"blocks", blocks},
                  {"rounds", rounds},
                  {"cpu", cpu},
                  {"memcpy_gbps", Rounded(gb_memcpy, 2)},
                  {"fused_gbps", Rounded(gb_fused, 2)},
                  {"memcpy_then_verify_gbps", Rounded(gb_two_pass, 2)},
                  {"verify_gbps", Rounded(gb_verify, 2)},
                  {"fused_vs_memcpy", Rounded(gb_fused / gb_memcpy, 3)},
                  {"keyed_gbps", Rounded(gb_keyed, 2)},
                  {"keyed_vs_fused", Rounded(keyed ? gb_keyed / gb_fused : 0, 3)},
                  {"sink", sink & 1}}).c_str(),
               stdout);
  } else {
    fmt::print("host store copy, {} blocks of {} bytes ({}), median of {} rounds:\n", blocks, block_bytes, layout, rounds);
    fmt::print("  memcpy (no checksum)      {:6.2f} GB/s\n", gb_memcpy);
    fmt::print("  fused copy + checksum     {:6.2f} GB/s  ({:.3f} of memcpy)\n", gb_fused, gb_fused / gb_memcpy);
    fmt::print("  memcpy, then second pass  {:6.2f} GB/s  ({:.3f} of memcpy)\n", gb_two_pass, gb_two_pass / gb_memcpy);
    fmt::print("  checksum pass alone       {:6.2f} GB/s  (restart check, scrub: per core)\n", gb_verify);
    if (keyed) {
      fmt::print("  keyed copy + block MAC    {:6.2f} GB/s  ({:.3f} of fused, {:.3f} of memcpy)\n", gb_keyed,
                 gb_keyed / gb_fused, gb_keyed / gb_memcpy);
    }
  }
  return 0;
}

// An engine's first contact with an installed flexkvd: attach, store four blocks of a prompt, match the prompt and
// load the cached blocks back, byte for byte. Builds against the installed libflexkv (CMakeLists.txt or Makefile).
//
//   flexkv_engine_example [--socket PATH] [--namespace NAME]
// Exit status 0 when the blocks came back as stored; otherwise 1 and a line on stderr that says which step failed.
#include <flexkv/client.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

// A tiny full-attention model: 2 layers, K and V, 1 KV head of 64 bf16 values, 16 tokens per block: 8 KiB blocks.
flexkv::Geometry TinyModel() {
  flexkv::Geometry geometry;
  geometry.tokens_per_block = 16;
  geometry.num_layers = 2;
  geometry.kv_planes = 2;
  geometry.kv_heads_per_rank = 1;
  geometry.head_dim = 64;
  geometry.dtype_bytes = 2;
  return geometry;
}

int Fail(const char* step, const flexkv::Status& status) {
  std::fprintf(stderr, "flexkv_engine_example: %s: %s\n", step, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  flexkv::ConnectOptions connect;  // empty socket_path: $FLEXKV_SOCKET, else the default socket
  std::string model_namespace = "engine-example";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--socket") == 0) {
      connect.socket_path = argv[i + 1];
    } else if (std::strcmp(argv[i], "--namespace") == 0) {
      model_namespace = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: %s [--socket PATH] [--namespace NAME]\n", argv[0]);
      return 2;
    }
  }

  auto client = flexkv::Client::Connect(connect);
  if (!client.ok()) return Fail("connect", client.status());
  auto session = (*client)->Attach({.client_name = "engine-example", .model_namespace = model_namespace,
                                    .geometry = TinyModel()});
  if (!session.ok()) return Fail("attach", session.status());

  // Eight KV blocks in memory shared with the daemon: blocks 0..3 hold the prompt's KV, 4..7 receive the load.
  constexpr uint32_t kBlocks = 4;
  auto kv = (*client)->CreateHostKv(flexkv::KvLayout::kBlockFirst, 2 * kBlocks);
  if (!kv.ok()) return Fail("create host KV", kv.status());
  const uint64_t block_bytes = kv->bytes / kv->num_blocks;
  for (uint64_t i = 0; i < kBlocks * block_bytes; ++i) kv->data[i] = static_cast<uint8_t>(i * 7 + 1);

  std::vector<int32_t> prompt(kBlocks * 16);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(1000 + i);
  const std::vector<flexkv::BlockKey> keys = flexkv::ComputeBlockKeys(model_namespace, prompt, 16);
  const auto timeout = std::chrono::seconds(10);

  const std::vector<uint32_t> src = {0, 1, 2, 3};
  auto store = (*client)->Store(flexkv::BlockKeyChain(keys), src);
  if (!store.ok()) return Fail("store", store.status());
  auto stored = (*client)->Wait(*store, timeout);
  if (!stored.ok()) return Fail("store", stored.status());
  if (!stored->status.ok()) return Fail("store", stored->status);

  auto match = (*client)->Match(keys, /*pin=*/true);
  if (!match.ok()) return Fail("match", match.status());
  auto hit = (*client)->Wait(*match, timeout);
  if (!hit.ok()) return Fail("match", hit.status());
  if (!hit->status.ok()) return Fail("match", hit->status);
  if (hit->matched_blocks != kBlocks) {
    std::fprintf(stderr, "flexkv_engine_example: match: %u of %u blocks cached; expected all of them\n",
                 hit->matched_blocks, kBlocks);
    return 1;
  }

  const std::vector<uint32_t> dst = {4, 5, 6, 7};
  auto load = (*client)->Load(hit->match_handle, dst);
  if (!load.ok()) return Fail("load", load.status());
  auto loaded = (*client)->Wait(*load, timeout);
  if (!loaded.ok()) return Fail("load", loaded.status());
  if (!loaded->status.ok()) return Fail("load", loaded->status);
  auto release = (*client)->Release(hit->match_handle);
  if (!release.ok()) return Fail("release", release.status());
  auto released = (*client)->Wait(*release, timeout);
  if (!released.ok()) return Fail("release", released.status());
  if (std::memcmp(kv->data, kv->data + kBlocks * block_bytes, kBlocks * block_bytes) != 0) {
    std::fprintf(stderr, "flexkv_engine_example: load: the loaded blocks differ from the stored ones\n");
    return 1;
  }
  std::printf("flexkv_engine_example: stored %u blocks (%u new), matched %u, loaded them back byte for byte\n",
              kBlocks, stored->done_blocks, hit->matched_blocks);
  return 0;
}

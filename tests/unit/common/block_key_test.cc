// Block keys: test vectors and properties. The expected hex values were computed with Python's xxhash
// (xxh3_64_intdigest / xxh3_128_intdigest), independently of common/block_key.cc; the same vectors are in
// docs/protocol.md "Block keys" and are re-checked by tests/unit/common/block_key_vectors_test.py.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <xxhash.h>

#include "flexkv/block_key.h"

using flexkv::BlockKey;
using flexkv::BlockKeyHash;
using flexkv::ComputeBlockKeys;

namespace {

std::vector<int32_t> Range(int32_t first, int32_t last) {  // inclusive
  std::vector<int32_t> v(static_cast<size_t>(last - first + 1));
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<int32_t> Concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<std::string> Hex(const std::vector<BlockKey>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(k.ToHex());
  return out;
}

using HexKeys = std::vector<std::string>;

const HexKeys kLlama0to63 = {
    "153b1826ef42db47b22612177ef37a7d",
    "ca49628bd375c948de337b2b09ccb12e",
    "acf7374fb98b8f8ec7ab48bab6d18cd0",
    "bfd1c2a0c9e67aaad0ad930d82d99092",
};

}  // namespace

TEST_CASE("block keys: ToHex prints high half first, zero-padded", "[unit][keys]") {
  CHECK(BlockKey{}.ToHex() == "00000000000000000000000000000000");
  CHECK(BlockKey{.lo = 0x1, .hi = 0xabcdef}.ToHex() == "0000000000abcdef0000000000000001");
  CHECK(BlockKey{.lo = 0x0123456789abcdefULL, .hi = 0xfedcba9876543210ULL}.ToHex() ==
        "fedcba98765432100123456789abcdef");
}

TEST_CASE("block keys: test vectors (docs/protocol.md)", "[unit][keys]") {
  SECTION("1: llama3-8b, 16 tokens/block, tokens 0..63") {
    CHECK(Hex(ComputeBlockKeys("llama3-8b", Range(0, 63), 16)) == kLlama0to63);
  }
  SECTION("2: a trailing partial block is ignored (tokens 0..69)") {
    CHECK(Hex(ComputeBlockKeys("llama3-8b", Range(0, 69), 16)) == kLlama0to63);
  }
  SECTION("3: another namespace, same tokens") {
    CHECK(Hex(ComputeBlockKeys("qwen2-7b", Range(0, 63), 16)) == HexKeys{
                                                                     "5e985642b355b2dc556cb6e0146ced50",
                                                                     "54302f53710037d9e321a15a215f0e67",
                                                                     "40348bd9797c25c91aa0689eb3e8d601",
                                                                     "3efa5c7636ef32e02f3e45906c9cbaee",
                                                                 });
  }
  SECTION("4: block 2's tokens changed (0..31, 1000..1015, 48..63)") {
    const auto tokens = Concat({Range(0, 31), Range(1000, 1015), Range(48, 63)});
    CHECK(Hex(ComputeBlockKeys("llama3-8b", tokens, 16)) == HexKeys{
                                                                "153b1826ef42db47b22612177ef37a7d",
                                                                "ca49628bd375c948de337b2b09ccb12e",
                                                                "018f3df183d6805c1ba4c64da37ec757",
                                                                "77b2915971867572b24f5224a9cf57c9",
                                                            });
  }
  SECTION("5: negative and extreme token ids, 4 tokens/block") {
    const std::vector<int32_t> tokens = {-1, -2, std::numeric_limits<int32_t>::max(),
                                         std::numeric_limits<int32_t>::min(), 0, 1, 2, 3};
    CHECK(Hex(ComputeBlockKeys("llama3-8b", tokens, 4)) == HexKeys{
                                                               "079e4d18f8788e4a4194f401c5a5c9d0",
                                                               "f378c19fc84460426cca2eddfab6acb4",
                                                           });
  }
  SECTION("6: one token per block, repeated token") {
    const std::vector<int32_t> tokens = {7, 7, 7};
    CHECK(Hex(ComputeBlockKeys("tiny", tokens, 1)) == HexKeys{
                                                          "5d7af4f593344df28c3ad9be7eb4acd7",
                                                          "e52a7994e9d57065842cd425581a1152",
                                                          "760eb60aa59c9dcdf27179800cd81f30",
                                                      });
  }
}

TEST_CASE("block keys: degenerate inputs give no keys", "[unit][keys]") {
  const auto tokens = Range(0, 63);
  CHECK(ComputeBlockKeys("llama3-8b", tokens, 0).empty());
  CHECK(ComputeBlockKeys("llama3-8b", {}, 16).empty());
  CHECK(ComputeBlockKeys("llama3-8b", Range(0, 14), 16).empty());  // fewer tokens than one block
  CHECK(ComputeBlockKeys("llama3-8b", tokens, 65).empty());
  CHECK(ComputeBlockKeys("llama3-8b", tokens, 64).size() == 1);
  CHECK(ComputeBlockKeys("", tokens, 16).size() == 4);  // the empty namespace is a namespace
}

TEST_CASE("block keys: chaining — a key names its block and everything before it", "[unit][keys]") {
  const auto tokens = Range(0, 127);
  const auto keys = ComputeBlockKeys("llama3-8b", tokens, 16);
  REQUIRE(keys.size() == 8);

  // Prefixes: the keys of a prefix are a prefix of the keys.
  for (size_t n = 0; n <= tokens.size(); n += 5) {
    const auto prefix = ComputeBlockKeys("llama3-8b", std::span(tokens).first(n), 16);
    REQUIRE(prefix.size() == n / 16);
    CHECK(std::equal(prefix.begin(), prefix.end(), keys.begin()));
  }

  // Changing one token of block b changes keys b.. and leaves keys ..b-1 alone.
  for (size_t b = 0; b < keys.size(); ++b) {
    auto changed = tokens;
    changed[b * 16 + 15] += 1;
    const auto k2 = ComputeBlockKeys("llama3-8b", changed, 16);
    REQUIRE(k2.size() == keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      INFO("block changed " << b << ", key " << i);
      if (i < b) {
        CHECK(k2[i] == keys[i]);
      } else {
        CHECK(k2[i] != keys[i]);
      }
    }
  }

  // Same block contents at different positions get different keys (the key is not just the block's hash).
  const std::vector<int32_t> same(64, 42);
  const auto rep = ComputeBlockKeys("llama3-8b", same, 16);
  std::unordered_set<BlockKey, BlockKeyHash> distinct(rep.begin(), rep.end());
  CHECK(distinct.size() == rep.size());

  // Block boundaries matter: same tokens, different block size, different first key.
  CHECK(ComputeBlockKeys("llama3-8b", tokens, 32)[0] != keys[0]);
}

TEST_CASE("block keys: namespace changes every key", "[unit][keys]") {
  const auto tokens = Range(0, 255);
  const auto a = ComputeBlockKeys("llama3-8b", tokens, 16);
  for (const char* ns : {"qwen2-7b", "llama3-8b ", "Llama3-8b", "llama3-8", ""}) {
    const auto b = ComputeBlockKeys(ns, tokens, 16);
    REQUIRE(b.size() == a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("namespace '" << ns << "', key " << i);
      CHECK(a[i] != b[i]);
    }
  }
  // A namespace is its bytes, not a C string: an embedded NUL counts.
  using namespace std::string_view_literals;
  const auto with_nul = ComputeBlockKeys("llama3-8b\0x"sv, tokens, 16);
  CHECK(with_nul[0] != a[0]);
}

TEST_CASE("block keys: deterministic and collision-free on a sample", "[unit][keys]") {
  std::vector<int32_t> tokens(16 * 4096);
  uint32_t x = 12345;
  for (auto& t : tokens) {
    x = x * 1664525u + 1013904223u;
    t = static_cast<int32_t>(x >> 8);
  }
  const auto a = ComputeBlockKeys("llama3-8b", tokens, 16);
  const auto b = ComputeBlockKeys("llama3-8b", tokens, 16);
  CHECK(a == b);
  std::unordered_set<BlockKey, BlockKeyHash> distinct(a.begin(), a.end());
  CHECK(distinct.size() == a.size());
}

TEST_CASE("block keys: an extra changes its block's key and every later one, and is the documented bytes",
          "[unit][keys]") {
  const auto tokens = Range(0, 127);  // 8 blocks of 16
  const auto plain = ComputeBlockKeys("ns", tokens, 16);
  std::vector<flexkv::BlockExtra> extras(8);  // all zero: none
  CHECK(ComputeBlockKeys("ns", tokens, 16, extras) == plain);
  CHECK(ComputeBlockKeys("ns", tokens, 16, std::span<const flexkv::BlockExtra>()) == plain);
  extras[3][0] = 0x5a;
  const auto with = ComputeBlockKeys("ns", tokens, 16, extras);
  REQUIRE(with.size() == plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    INFO("block " << i);
    CHECK((with[i] == plain[i]) == (i < 3));
  }
  // Block 3's key is XXH3_128(seed, key[2] ‖ its tokens ‖ its extra): the plain scheme with the 16 bytes appended.
  std::vector<unsigned char> buf(16 + 4 * 16 + 16);
  for (int b = 0; b < 8; ++b) {
    buf[b] = static_cast<unsigned char>(plain[2].lo >> (8 * b));
    buf[8 + b] = static_cast<unsigned char>(plain[2].hi >> (8 * b));
  }
  for (int t = 0; t < 16; ++t) {
    for (int b = 0; b < 4; ++b) buf[16 + 4 * t + b] = static_cast<unsigned char>(tokens[48 + t] >> (8 * b));
  }
  std::copy(extras[3].begin(), extras[3].end(), buf.begin() + 16 + 64);
  const XXH128_hash_t h = XXH3_128bits_withSeed(buf.data(), buf.size(), flexkv::NamespaceHash("ns"));
  CHECK(with[3] == BlockKey{h.low64, h.high64});
  // Fewer extras than blocks: the rest have none.
  std::vector<flexkv::BlockExtra> first_only(1);
  first_only[0][15] = 1;
  const auto salted = ComputeBlockKeys("ns", tokens, 16, first_only);
  for (size_t i = 0; i < plain.size(); ++i) CHECK(salted[i] != plain[i]);
}

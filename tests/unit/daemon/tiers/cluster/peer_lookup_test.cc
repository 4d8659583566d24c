// The peer lookup's wire format (daemon/tiers/cluster/peer_lookup.h): round trips, and every malformed message -
// truncated anywhere, lengths that lie, counts past the limits, regions or blocks a reply must not name - is refused
// with INVALID_ARGUMENT (or FAILED_PRECONDITION for another version), never read past its end.
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/tiers/cluster/peer_lookup.h"

using flexkv::BlockKey;
using flexkv::PeerLookupReply;
using flexkv::PeerLookupRequest;
using flexkv::StatusCode;

namespace {

PeerLookupRequest SomeRequest() {
  PeerLookupRequest q;
  q.model_namespace = "llama-70b/tp8";
  q.layout = "{tokens_per_block=16, num_layers=2, tp_size=8}";
  q.block_bytes = 128 << 10;
  q.epoch = 7;
  q.from = 2;
  for (uint64_t i = 1; i <= 5; ++i) q.keys.push_back(BlockKey{i * 0x1111, ~i});
  return q;
}

PeerLookupReply SomeReply() {
  PeerLookupReply a;
  a.matched = 5;
  a.regions = {std::string("region-one"), std::string(300, 'r')};
  a.blocks = {{0, 4096, 11}, {1, 0, 12}, {0, 8192, 13}};
  return a;
}

void PutU32(std::string* s, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) (*s)[at + static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

TEST_CASE("peer lookup: a request and a reply round-trip field for field", "[unit][cluster]") {
  const PeerLookupRequest q = SomeRequest();
  auto back = flexkv::DecodeLookupRequest(flexkv::EncodeLookupRequest(q));
  REQUIRE(back.ok());
  CHECK(back->model_namespace == q.model_namespace);
  CHECK(back->layout == q.layout);
  CHECK(back->block_bytes == q.block_bytes);
  CHECK(back->epoch == q.epoch);
  CHECK(back->from == q.from);
  CHECK(back->keys == q.keys);

  const PeerLookupReply a = SomeReply();
  auto reply = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), q.from, q.keys.size());
  REQUIRE(reply.ok());
  CHECK(reply->matched == 5);
  CHECK(reply->regions == a.regions);
  REQUIRE(reply->blocks.size() == 3);
  CHECK(reply->blocks[1].region == 1);
  CHECK(reply->blocks[2].offset == 8192);
  CHECK(reply->blocks[2].checksum == 13);
}

TEST_CASE("peer lookup: every truncation of a request or a reply is refused", "[unit][cluster]") {
  const std::string q = flexkv::EncodeLookupRequest(SomeRequest());
  for (size_t n = 0; n < q.size(); ++n) {
    auto r = flexkv::DecodeLookupRequest(std::string_view(q).substr(0, n));
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
  }
  const std::string a = flexkv::EncodeLookupReply(SomeReply());
  for (size_t n = 0; n < a.size(); ++n) {
    auto r = flexkv::DecodeLookupReply(std::string_view(a).substr(0, n), 2, 5);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
  }
  // Trailing bytes too.
  CHECK(flexkv::DecodeLookupRequest(q + "x").status().code() == StatusCode::kInvalidArgument);
  CHECK(flexkv::DecodeLookupReply(a + "x", 2, 5).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("peer lookup: lying counts and out-of-range values are refused, naming what was wrong", "[unit][cluster]") {
  SECTION("another version") {
    std::string q = flexkv::EncodeLookupRequest(SomeRequest());
    PutU32(&q, 0, 2);
    auto r = flexkv::DecodeLookupRequest(q);
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK(r.status().message().find("version 2") != std::string::npos);
  }
  SECTION("a key count far beyond the bytes there are allocates nothing and is refused") {
    PeerLookupRequest small = SomeRequest();
    std::string q = flexkv::EncodeLookupRequest(small);
    const size_t count_at = q.size() - small.keys.size() * 16 - 4;
    PutU32(&q, count_at, 60000);
    CHECK(flexkv::DecodeLookupRequest(q).status().code() == StatusCode::kInvalidArgument);
    PutU32(&q, count_at, 0);
    CHECK(flexkv::DecodeLookupRequest(q).status().code() == StatusCode::kInvalidArgument);
    PutU32(&q, count_at, flexkv::kMaxLookupKeys + 1);
    CHECK(flexkv::DecodeLookupRequest(q).status().message().find("expected 1..") != std::string::npos);
  }
  SECTION("from at or past the keys") {
    PeerLookupRequest bad = SomeRequest();
    bad.from = 5;
    CHECK(flexkv::DecodeLookupRequest(flexkv::EncodeLookupRequest(bad)).status().code() ==
          StatusCode::kInvalidArgument);
  }
  SECTION("a namespace longer than 256 bytes") {
    PeerLookupRequest bad = SomeRequest();
    bad.model_namespace.assign(300, 'n');
    CHECK(flexkv::DecodeLookupRequest(flexkv::EncodeLookupRequest(bad)).status().code() ==
          StatusCode::kInvalidArgument);
  }
  SECTION("a reply matching more keys than were asked, or naming more blocks than it matched") {
    PeerLookupReply a = SomeReply();
    a.matched = 6;
    CHECK(flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), 2, 5).status().code() ==
          StatusCode::kInvalidArgument);
    a = SomeReply();
    a.matched = 4;  // blocks for [2, 4): 2, but it names 3
    CHECK(flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), 2, 5).status().code() ==
          StatusCode::kInvalidArgument);
  }
  SECTION("a block naming a region the reply does not carry") {
    PeerLookupReply a = SomeReply();
    a.blocks[0].region = 2;
    auto r = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), 2, 5);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("region 2") != std::string::npos);
  }
  SECTION("a region count beyond the limit") {
    std::string a = flexkv::EncodeLookupReply(SomeReply());
    PutU32(&a, 8, flexkv::kMaxLookupRegions + 1);
    CHECK(flexkv::DecodeLookupReply(a, 2, 5).status().code() == StatusCode::kInvalidArgument);
  }
}

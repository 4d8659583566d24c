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

// A hybrid reply at hit end 5 for a request from 2: FULL blocks 2..4, a 2-block window (keys 3, 4) and a state
// (key 4).
PeerLookupReply SomeHybridReply() {
  PeerLookupReply a;
  a.hybrid = true;
  a.matched = 5;
  a.regions = {std::string("full-grant"), std::string("window-grant"), std::string("state-grant")};
  a.blocks = {{0, 0, 21}, {0, 4096, 22}, {0, 8192, 23}};
  a.entries = {{1, 3, {1, 0, 31}}, {1, 4, {1, 4096, 32}}, {2, 4, {2, 0, 41}}};
  return a;
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
    PutU32(&q, 0, 3);
    auto r = flexkv::DecodeLookupRequest(q);
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK(r.status().message().find("version 3") != std::string::npos);
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

TEST_CASE("peer lookup: a hybrid lookup is version 2 and round-trips its entries, version 1 is unchanged",
          "[unit][cluster][hybrid]") {
  PeerLookupRequest q = SomeRequest();
  const std::string full = flexkv::EncodeLookupRequest(q);
  q.hybrid = true;
  const std::string hybrid = flexkv::EncodeLookupRequest(q);
  // The version leads both: a node of the previous release (version 1 only) checks it before anything else and
  // refuses a hybrid request with FAILED_PRECONDITION, never parsing the rest; full-attention lookups stay version 1
  // so that nodes of both releases still pull those from each other.
  CHECK(full.substr(0, 4) == std::string("\x01\x00\x00\x00", 4));
  CHECK(hybrid.substr(0, 4) == std::string("\x02\x00\x00\x00", 4));
  CHECK(full.substr(4) == hybrid.substr(4));
  auto back = flexkv::DecodeLookupRequest(hybrid);
  REQUIRE(back.ok());
  CHECK(back->hybrid);
  CHECK(back->keys == q.keys);
  CHECK_FALSE(flexkv::DecodeLookupRequest(full)->hybrid);

  const PeerLookupReply a = SomeHybridReply();
  const std::string bytes = flexkv::EncodeLookupReply(a);
  auto reply = flexkv::DecodeLookupReply(bytes, 2, 5, /*hybrid=*/true);
  REQUIRE(reply.ok());
  CHECK(reply->hybrid);
  CHECK(reply->matched == 5);
  CHECK(reply->regions == a.regions);
  REQUIRE(reply->blocks.size() == 3);
  REQUIRE(reply->entries.size() == 3);
  CHECK(reply->entries[1].component == 1);
  CHECK(reply->entries[1].position == 4);
  CHECK(reply->entries[1].where.region == 1);
  CHECK(reply->entries[1].where.offset == 4096);
  CHECK(reply->entries[1].where.checksum == 32);
  CHECK(reply->entries[2].component == 2);
  CHECK(reply->entries[2].where.checksum == 41);
  CHECK(flexkv::EncodeLookupReply(*reply) == bytes);
  // A hybrid reply without entries (the peer has no hit past `from`) is valid too.
  PeerLookupReply none;
  none.hybrid = true;
  none.matched = 2;
  auto empty = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(none), 2, 5, true);
  REQUIRE(empty.ok());
  CHECK(empty->entries.empty());
}

TEST_CASE("peer lookup: hostile hybrid replies are refused - another version, truncated, lying entries",
          "[unit][cluster][hybrid]") {
  SECTION("a reply of the other version than the request's") {
    auto r = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(SomeReply()), 2, 5, /*hybrid=*/true);
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK(r.status().message().find("version 1; expected 2") != std::string::npos);
    r = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(SomeHybridReply()), 2, 5, /*hybrid=*/false);
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
  }
  SECTION("every truncation, and trailing bytes") {
    const std::string a = flexkv::EncodeLookupReply(SomeHybridReply());
    for (size_t n = 0; n < a.size(); ++n) {
      auto r = flexkv::DecodeLookupReply(std::string_view(a).substr(0, n), 2, 5, true);
      REQUIRE_FALSE(r.ok());
      CHECK(r.status().code() == StatusCode::kInvalidArgument);
    }
    CHECK(flexkv::DecodeLookupReply(a + "x", 2, 5, true).status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("an entry of component 0 or past the last component") {
    for (uint32_t component : {0u, static_cast<uint32_t>(flexkv::Geometry::kMaxComponents)}) {
      PeerLookupReply a = SomeHybridReply();
      a.entries[0].component = component;
      auto r = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), 2, 5, true);
      CHECK(r.status().code() == StatusCode::kInvalidArgument);
      CHECK(r.status().message().find("component " + std::to_string(component)) != std::string::npos);
    }
  }
  SECTION("an entry at or past the match's end") {
    PeerLookupReply a = SomeHybridReply();
    a.entries[2].position = 5;
    auto r = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), 2, 5, true);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("at key 5") != std::string::npos);
  }
  SECTION("an entry naming a region the reply does not carry") {
    PeerLookupReply a = SomeHybridReply();
    a.entries[1].where.region = 3;
    auto r = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), 2, 5, true);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("entry region 3") != std::string::npos);
  }
  SECTION("more entries than components x matched, or an entry count beyond the bytes there are") {
    PeerLookupReply a = SomeHybridReply();
    a.matched = 2;  // no blocks past from = 2 may come, and at most 7 x 2 entries
    a.blocks.clear();
    for (auto& e : a.entries) e.position = 1;
    a.entries.resize(15, a.entries[0]);
    auto r = flexkv::DecodeLookupReply(flexkv::EncodeLookupReply(a), 2, 5, true);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("expected at most 14") != std::string::npos);
    std::string lying = flexkv::EncodeLookupReply(SomeHybridReply());
    PutU32(&lying, lying.size() - 3 * 28 - 4, 30);
    CHECK(flexkv::DecodeLookupReply(lying, 2, 5, true).status().code() == StatusCode::kInvalidArgument);
  }
}

namespace {

// FULL + a 2-block window + a state: what the hit rule at e needs is the window [e - 2, e) and the state at e.
flexkv::Geometry WindowAndState() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  flexkv::ComponentSpec swa;
  swa.kind = flexkv::ComponentKind::kSlidingWindow;
  swa.num_layers = 1;
  swa.kv_planes = 2;
  swa.kv_heads_per_rank = 1;
  swa.head_dim = 8;
  swa.dtype_bytes = 2;
  swa.window_tokens = 2 * g.tokens_per_block;
  flexkv::ComponentSpec state;
  state.kind = flexkv::ComponentKind::kState;
  state.num_layers = 1;
  state.state_bytes_per_layer = 64;
  g.components = {swa, state};
  return g;
}

}  // namespace

TEST_CASE("peer lookup: a hybrid reply must offer exactly what the hit rule at its end needs",
          "[unit][cluster][hybrid]") {
  const flexkv::Geometry g = WindowAndState();
  REQUIRE(g.window_blocks(1) == 2);
  const PeerLookupReply good = SomeHybridReply();  // e = 5 from 2: FULL 2..4, window keys 3 and 4, state at 5
  CHECK(flexkv::CheckHybridReply(good, g, 2).ok());

  SECTION("no hit past the requester's: NOT_FOUND") {
    PeerLookupReply a = good;
    a.matched = 2;
    a.blocks.clear();
    a.entries.clear();
    CHECK(flexkv::CheckHybridReply(a, g, 2).code() == StatusCode::kNotFound);
    CHECK(flexkv::CheckHybridReply(good, g, 5).code() == StatusCode::kNotFound);
  }
  SECTION("FULL blocks short of the hit end") {
    PeerLookupReply a = good;
    a.blocks.pop_back();
    const flexkv::Status s = flexkv::CheckHybridReply(a, g, 2);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("offered 2 FULL blocks for its hit end 5 from block 2; expected 3") != std::string::npos);
  }
  SECTION("a window block missing, or one before the window") {
    PeerLookupReply a = good;
    a.entries.erase(a.entries.begin());
    CHECK(flexkv::CheckHybridReply(a, g, 2).code() == StatusCode::kInvalidArgument);
    a = good;
    a.entries[0].position = 2;  // outside the window [3, 5)
    const flexkv::Status s = flexkv::CheckHybridReply(a, g, 2);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("entry 0 is component 1 of key 2") != std::string::npos);
  }
  SECTION("the state of another end, or of another component") {
    PeerLookupReply a = good;
    a.entries[2].position = 3;
    CHECK(flexkv::CheckHybridReply(a, g, 2).code() == StatusCode::kInvalidArgument);
    a = good;
    a.entries[2].component = 3;  // a component this geometry does not have
    CHECK(flexkv::CheckHybridReply(a, g, 2).code() == StatusCode::kInvalidArgument);
  }
  SECTION("the state missing, or an entry more") {
    PeerLookupReply a = good;
    a.entries.pop_back();
    const flexkv::Status s = flexkv::CheckHybridReply(a, g, 2);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("needs component 2 of key 4 too") != std::string::npos);
    a = good;
    a.entries.push_back(a.entries.back());
    CHECK(flexkv::CheckHybridReply(a, g, 2).message().find("the hit rule needs 3") != std::string::npos);
  }
  SECTION("a full-attention geometry's requester: entries are never expected") {
    PeerLookupReply a = good;
    CHECK(flexkv::CheckHybridReply(a, flexkv::Llama3_8B(), 2).code() == StatusCode::kInvalidArgument);
    a.entries.clear();
    CHECK(flexkv::CheckHybridReply(a, flexkv::Llama3_8B(), 2).ok());
  }
}

// Fuzz target: the peer lookup's messages (daemon/tiers/cluster/peer_lookup.h), which a daemon reads from other
// nodes of its cluster. Input byte 0 picks the message: even = a request, odd = a reply (the request it answers had
// `from` = byte 1 and `keys` = byte 2 + 1, and was a hybrid domain's (version 2) when bit 1 of byte 0 is set).
// Whatever the bytes: no crash, no read past the input; a message that decodes re-encodes to exactly the input (the
// format has one encoding), and a reply never names more blocks than were asked for nor a region it does not carry;
// a hybrid reply's entries are each of a component 1.. and a key below its match, and checking them against a
// geometry's hit rule (CheckHybridReply) answers.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "daemon/tiers/cluster/peer_lookup.h"

namespace {

[[noreturn]] void Violated(const char* what) {
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const std::string_view body(reinterpret_cast<const char*>(data) + 3, size - 3);
  if (data[0] % 2 == 0) {
    auto request = flexkv::DecodeLookupRequest(body);
    if (!request.ok()) return 0;
    if (request->keys.empty() || request->from >= request->keys.size()) Violated("request bounds");
    if (flexkv::EncodeLookupRequest(*request) != body) Violated("request re-encoding differs");
    return 0;
  }
  const uint32_t from = data[1];
  const size_t keys = size_t{data[2]} + 1;
  const bool hybrid = (data[0] & 2) != 0;
  auto reply = flexkv::DecodeLookupReply(body, from, keys, hybrid);
  if (!reply.ok()) return 0;
  if (reply->hybrid != hybrid) Violated("reply version");
  if (!hybrid && !reply->entries.empty()) Violated("entries in a full-attention reply");
  for (const auto& e : reply->entries) {
    if (e.component == 0 || e.component >= flexkv::Geometry::kMaxComponents) Violated("entry component");
    if (e.position >= reply->matched) Violated("entry position");
    if (e.where.region >= reply->regions.size()) Violated("entry region index");
  }
  if (reply->matched > keys) Violated("reply matched more keys than asked");
  if (reply->blocks.size() > (reply->matched > from ? reply->matched - from : 0)) Violated("reply block count");
  for (const auto& b : reply->blocks) {
    if (b.region >= reply->regions.size()) Violated("reply region index");
  }
  if (hybrid) {
    // The puller's check of the entries against the hit rule: an answer, never a crash, whatever the reply says.
    static const flexkv::Geometry kModels[] = {flexkv::GptOss20B(), flexkv::Qwen3Next80B()};
    for (const flexkv::Geometry& g : kModels) {
      const flexkv::Status checked = flexkv::CheckHybridReply(*reply, g, from);
      if (checked.ok() && reply->blocks.size() != reply->matched - from) Violated("checked reply's FULL blocks");
    }
  }
  if (flexkv::EncodeLookupReply(*reply) != body) Violated("reply re-encoding differs");
  return 0;
}

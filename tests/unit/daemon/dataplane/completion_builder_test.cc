// CompletionBuilder: the one place completions are built; messages are cut to the descriptor's field.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>

#include "daemon/dataplane/completion_builder.h"

using flexkv::CompletionBuilder;
using flexkv::CompletionDescriptor;
using flexkv::Status;
using flexkv::SubmitDescriptor;

namespace {

SubmitDescriptor Request(flexkv::RingOp op) {
  SubmitDescriptor d{};
  d.user_data = 0xfeedULL;
  d.opcode = static_cast<uint16_t>(op);
  d.count = 4;
  return d;
}

}  // namespace

TEST_CASE("completion builder: an OK answer carries the request's user_data, opcode and counts", "[unit][dataplane]") {
  const SubmitDescriptor d = Request(flexkv::RingOp::kMatch);
  const CompletionDescriptor c = CompletionBuilder(d).MatchedBlocks(3).DoneBlocks(2).MatchHandle(9).descriptor();
  CHECK(c.user_data == d.user_data);
  CHECK(c.opcode == d.opcode);
  CHECK(c.status_code == 0);
  CHECK(c.flags == 0);
  CHECK(c.matched_blocks == 3);
  CHECK(c.done_blocks == 2);
  CHECK(c.match_handle == 9);
  CHECK(c.message[0] == '\0');
}

TEST_CASE("completion builder: an error carries the code and the message", "[unit][dataplane]") {
  const SubmitDescriptor d = Request(flexkv::RingOp::kLoad);
  const CompletionDescriptor c = CompletionBuilder::Error(d, Status::NotFound("match_handle 7 is not held"));
  CHECK(c.user_data == d.user_data);
  CHECK(c.status_code == static_cast<int32_t>(flexkv::StatusCode::kNotFound));
  CHECK(std::string(c.message) == "match_handle 7 is not held");
}

TEST_CASE("completion builder: a long message is cut to the field and stays NUL-terminated", "[unit][dataplane]") {
  const std::string long_message(500, 'x');
  const CompletionDescriptor c =
      CompletionBuilder::Error(Request(flexkv::RingOp::kStore), Status::Internal(long_message));
  REQUIRE(std::memchr(c.message, '\0', sizeof(c.message)) != nullptr);
  CHECK(std::string(c.message) == long_message.substr(0, sizeof(c.message) - 1));
}

TEST_CASE("completion builder: a later status replaces an earlier one, and OK clears it", "[unit][dataplane]") {
  CompletionBuilder b(Request(flexkv::RingOp::kStore));
  b.Status(Status::ResourceExhausted("pool full of pinned blocks: stored blocks up to 2 of 4"));
  b.Status(Status::Internal("copy failed"));
  CHECK(b.status_code() == static_cast<int32_t>(flexkv::StatusCode::kInternal));
  CHECK(std::string(b.descriptor().message) == "copy failed");
  b.Status(Status::Ok());
  CHECK(b.status_code() == 0);
  CHECK(b.descriptor().message[0] == '\0');
}

TEST_CASE("completion builder: layer progress is flagged and names the layer", "[unit][dataplane]") {
  const SubmitDescriptor d = Request(flexkv::RingOp::kLoad);
  const CompletionDescriptor c = CompletionBuilder::LayerDone(d, 5);
  CHECK(c.user_data == d.user_data);
  CHECK(c.opcode == d.opcode);
  CHECK(c.flags == flexkv::kCompletionFlagLayerDone);
  CHECK(c.matched_blocks == 5);
  CHECK(c.status_code == 0);
}

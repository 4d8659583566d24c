// CompletionBuilder: every completion descriptor the daemon posts is built here - OK answers with their counts,
// errors with their message, layer progress of layer-wise loads - so that a message is truncated to the
// descriptor's field in one place.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/ring_layout.h"
#include "flexkv/status.h"

namespace flexkv {

class CompletionBuilder {
 public:
  // The answer to `request`: its user_data and opcode, OK, no counts.
  explicit CompletionBuilder(const SubmitDescriptor& request);

  // Layer `layer` of a layer-wise Load landed (a progress entry; the request is still in flight).
  static CompletionDescriptor LayerDone(const SubmitDescriptor& request, uint32_t layer);
  // A Load naming a layer-event set has enqueued every layer's copies and event records (progress: the request is
  // still in flight; matched_blocks = the layers recorded).
  static CompletionDescriptor Launched(const SubmitDescriptor& request, uint32_t layers);
  // The error answer to `request`: the status's code and message.
  static CompletionDescriptor Error(const SubmitDescriptor& request, const Status& status);

  CompletionBuilder& MatchedBlocks(uint32_t blocks);
  CompletionBuilder& DoneBlocks(uint32_t blocks);
  CompletionBuilder& MatchHandle(uint64_t handle);
  CompletionBuilder& Bytes(uint64_t bytes);
  // An OK answer's message (a Prefetch's source node or why none was pulled), cut to fit, NUL-terminated.
  CompletionBuilder& Note(std::string_view note);
  // Sets the code and the message (cut to fit the descriptor, always NUL-terminated). An OK status clears both.
  CompletionBuilder& Status(const flexkv::Status& status);

  int32_t status_code() const { return c_.status_code; }
  const CompletionDescriptor& descriptor() const { return c_; }

 private:
  CompletionDescriptor c_{};
};

}  // namespace flexkv

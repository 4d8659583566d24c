// See completion_builder.h.
#include "daemon/dataplane/completion_builder.h"

#include <algorithm>
#include <cstring>

namespace flexkv {

CompletionBuilder::CompletionBuilder(const SubmitDescriptor& request) {
  c_.user_data = request.user_data;
  c_.opcode = request.opcode;
}

CompletionDescriptor CompletionBuilder::LayerDone(const SubmitDescriptor& request, uint32_t layer) {
  CompletionBuilder b(request);
  b.c_.flags = kCompletionFlagLayerDone;
  b.c_.matched_blocks = layer;
  return b.c_;
}

CompletionDescriptor CompletionBuilder::Launched(const SubmitDescriptor& request, uint32_t layers) {
  CompletionBuilder b(request);
  b.c_.flags = kCompletionFlagLayerDone | kCompletionFlagLaunched;
  b.c_.matched_blocks = layers;
  return b.c_;
}

CompletionDescriptor CompletionBuilder::Error(const SubmitDescriptor& request, const flexkv::Status& status) {
  return CompletionBuilder(request).Status(status).descriptor();
}

CompletionBuilder& CompletionBuilder::MatchedBlocks(uint32_t blocks) {
  c_.matched_blocks = blocks;
  return *this;
}

CompletionBuilder& CompletionBuilder::DoneBlocks(uint32_t blocks) {
  c_.done_blocks = blocks;
  return *this;
}

CompletionBuilder& CompletionBuilder::MatchHandle(uint64_t handle) {
  c_.match_handle = handle;
  return *this;
}

CompletionBuilder& CompletionBuilder::Bytes(uint64_t bytes) {
  c_.bytes = bytes;
  return *this;
}

CompletionBuilder& CompletionBuilder::Note(std::string_view note) {
  std::memset(c_.message, 0, sizeof(c_.message));
  std::memcpy(c_.message, note.data(), std::min(note.size(), sizeof(c_.message) - 1));
  return *this;
}

CompletionBuilder& CompletionBuilder::Status(const flexkv::Status& status) {
  c_.status_code = static_cast<int32_t>(status.code());
  std::memset(c_.message, 0, sizeof(c_.message));
  const std::string& message = status.message();
  std::memcpy(c_.message, message.data(), std::min(message.size(), sizeof(c_.message) - 1));
  return *this;
}

}  // namespace flexkv

// Versions that the two sides of the socket compare.
#pragma once

#include <cstdint>

namespace flexkv {

// The daemon's release version, reported by GetStatus.
inline constexpr const char* kVersion = "0.1.0";
// Bumped on every control-plane or session-channel change that an older peer would misread.
inline constexpr uint32_t kProtocolVersion = 1;

}  // namespace flexkv

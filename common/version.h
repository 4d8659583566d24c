// Versions that the two sides of the socket compare.
#pragma once

#include <cstdint>

#include "common/release_version.h"  // generated from CMake's project version

namespace flexkv {

// The release version of flexkvd and libflexkv (GetStatus, --version, flexkv_version()). Written once, in the
// top CMakeLists.txt's project(); the Python package takes its __version__ from libflexkv.
inline constexpr const char* kVersion = FLEXKV_RELEASE_VERSION;
// Bumped on every control-plane or session-channel change that an older peer would misread.
inline constexpr uint32_t kProtocolVersion = 1;

}  // namespace flexkv

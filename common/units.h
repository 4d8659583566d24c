// Byte sizes with units ("512MiB", "64GiB", "1.5GB", "4096") for flags and config files.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "flexkv/status.h"

namespace flexkv {

// Accepts a non-negative number with an optional unit: B, KiB, MiB, GiB, TiB (powers of 1024),
// KB, MB, GB, TB (powers of 1000); K/M/G/T alone mean the binary units. Case-insensitive, spaces allowed
// between number and unit. INVALID_ARGUMENT with the accepted form otherwise.
Result<uint64_t> ParseByteSize(std::string_view text);

// "2 MiB", "64 GiB", "1000 B" when a binary unit divides exactly below 1024 of it; else one decimal
// place in the largest unit ("1.5 GiB").
std::string FormatByteSize(uint64_t bytes);

}  // namespace flexkv

// Test support: a fresh temporary directory removed with its contents at scope exit, a temporary file with given
// text, and the smallest realistic geometry (192-byte blocks) for tests of the pool and the host KV layouts. Header-only.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include "flexkv/geometry.h"

namespace flexkv::testing {

// 3 layers x K/V x 4 tokens x 1 head x 4 dims x 2 bytes: chunk = 32 bytes, 192 bytes per block.
inline Geometry TinyGeometry() {
  Geometry g;
  g.tokens_per_block = 4;
  g.num_layers = 3;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 4;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  return g;
}

// /dev/shm where there is one (a tmpfs, as the daemon's pools), else /tmp.
inline std::string ShmOrTmp() { return std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp"; }

// A fresh directory under `base` named after `what`, removed with everything in it at scope exit.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& what = "flexkv-test", const std::string& base = "/tmp") {
    std::string tmpl = base + "/" + what + "-XXXXXX";
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// A file under /tmp holding `text` (a TOML config, say), removed at scope exit.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& text, const std::string& what = "flexkv-file") {
    std::string tmpl = "/tmp/" + what + "-XXXXXX";
    const int fd = mkstemp(tmpl.data());
    REQUIRE(fd >= 0);
    ::close(fd);
    path = tmpl;
    std::ofstream(path) << text;
  }
  ~TempFile() { ::unlink(path.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
};

}  // namespace flexkv::testing

// The copy-engine load path is refused for chunks where it is known slow (issue 19: 8-16 KiB chunks load at only
// 3.4-4.5 GB/s), with what was asked, what is allowed and the path to use instead; the kernel path takes any chunk.
#include <catch2/catch.hpp>

#include <string>

#include "daemon/transfer/cuda/copy_path_policy.h"

using flexkv::CheckCopyEngineLoad;
using flexkv::Geometry;
using flexkv::StatusCode;

TEST_CASE("copy path: the copy-engine load path is refused for chunks under 32 KiB, naming the fix", "[unit][transfer]") {
  Geometry tp2 = flexkv::Llama3_8B();
  tp2.tp_size = 2;
  tp2.kv_heads_per_rank = 4;  // 16 KiB per rank's chunk
  REQUIRE(tp2.chunk_bytes_per_rank() == 16 * 1024);
  const flexkv::Status refused = CheckCopyEngineLoad(true, tp2);
  CHECK(refused.code() == StatusCode::kFailedPrecondition);
  const std::string m(refused.message());
  CHECK(m.find("--load-path copy-engine") != std::string::npos);
  CHECK(m.find("16384-byte chunks") != std::string::npos);                       // what was asked
  CHECK(m.find("at least 32768 bytes") != std::string::npos);                    // what is allowed
  CHECK(m.find("3.4-4.5 GB/s") != std::string::npos);                            // why
  CHECK(m.find("restart flexkvd with --load-path kernel") != std::string::npos);  // what to use instead

  const flexkv::Status mla = CheckCopyEngineLoad(true, flexkv::DeepSeekMla());  // 18 KiB chunks
  CHECK(mla.code() == StatusCode::kFailedPrecondition);
  CHECK(std::string(mla.message()).find("18432-byte chunks") != std::string::npos);
}

TEST_CASE("copy path: the copy-engine load path takes 32 KiB chunks and up, the kernel path every chunk",
          "[unit][transfer]") {
  const Geometry llama = flexkv::Llama3_8B();  // 32 KiB chunks
  REQUIRE(llama.chunk_bytes_per_rank() == flexkv::kCopyEngineLoadMinChunkBytes);
  CHECK(CheckCopyEngineLoad(true, llama).ok());
  Geometry tp4 = llama;
  tp4.tp_size = 4;
  tp4.kv_heads_per_rank = 2;  // 8 KiB
  CHECK(CheckCopyEngineLoad(false, tp4).ok());
  CHECK(CheckCopyEngineLoad(true, tp4).code() == StatusCode::kFailedPrecondition);
}

// MappedRegion: maps, moves without a second unmap, unmaps once, says why a mapping failed.
#include "common/mapped_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <utility>

#include "common/unique_fd.h"

using flexkv::MappedRegion;
using flexkv::StatusCode;
using flexkv::UniqueFd;

namespace {

// mincore() fails with ENOMEM on an unmapped page: a way to ask whether a range is still mapped.
bool IsMapped(void* addr) {
  unsigned char vec = 0;
  return mincore(addr, 1, &vec) == 0;
}

}  // namespace

TEST_CASE("a shared mapping of a memfd sees the file's bytes and unmaps on destruction", "[unit]") {
  UniqueFd fd(memfd_create("mapped-region-test", MFD_CLOEXEC));
  REQUIRE(fd);
  const size_t bytes = 2 * static_cast<size_t>(sysconf(_SC_PAGESIZE));
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  void* addr = nullptr;
  {
    auto map = MappedRegion::Shared("the test memfd", fd.get(), bytes);
    REQUIRE(map.ok());
    REQUIRE(map->valid());
    CHECK(map->size() == bytes);
    std::memcpy(map->bytes(), "flexkv", 6);
    char back[6];
    REQUIRE(pread(fd.get(), back, 6, 0) == 6);
    CHECK(std::memcmp(back, "flexkv", 6) == 0);
    addr = map->data();
    CHECK(IsMapped(addr));
  }
  CHECK_FALSE(IsMapped(addr));
}

TEST_CASE("a moved MappedRegion owns the mapping alone: one unmap, by the last owner", "[unit]") {
  auto made = MappedRegion::Anonymous("scratch", 4096);
  REQUIRE(made.ok());
  MappedRegion a = std::move(*made);
  void* addr = a.data();
  MappedRegion b(std::move(a));
  CHECK_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  CHECK(a.size() == 0);
  CHECK(b.data() == addr);
  MappedRegion c;
  c = std::move(b);
  CHECK_FALSE(b.valid());  // NOLINT(bugprone-use-after-move)
  CHECK(IsMapped(addr));
  c.reset();
  CHECK_FALSE(c.valid());
  CHECK_FALSE(IsMapped(addr));
  c.reset();  // a second reset is a no-op
}

TEST_CASE("assigning over a MappedRegion unmaps what it held", "[unit]") {
  auto first = MappedRegion::Anonymous("first", 4096);
  auto second = MappedRegion::Anonymous("second", 4096);
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  void* old = first->data();
  *first = std::move(*second);
  CHECK_FALSE(IsMapped(old));
  CHECK(IsMapped(first->data()));
}

TEST_CASE("release() hands the mapping to the caller and Adopt() takes one back", "[unit]") {
  auto map = MappedRegion::Anonymous("released", 4096);
  REQUIRE(map.ok());
  auto [addr, bytes] = map->release();
  CHECK_FALSE(map->valid());
  CHECK(IsMapped(addr));
  {
    MappedRegion adopted = MappedRegion::Adopt(addr, bytes);
    CHECK(adopted.size() == 4096);
  }
  CHECK_FALSE(IsMapped(addr));
}

TEST_CASE("a refused mapping is a status naming the mapping and the errno text", "[unit]") {
  auto bad_fd = MappedRegion::Shared("the pool file /nonexistent", -1, 4096);
  REQUIRE_FALSE(bad_fd.ok());
  CHECK(bad_fd.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(bad_fd.status().message(), Catch::Contains("the pool file /nonexistent") &&
                                            Catch::Contains("4096 bytes") && Catch::Contains("Bad file descriptor"));
  auto empty = MappedRegion::Anonymous("nothing", 0);
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.status().code() == StatusCode::kInvalidArgument);
}

// SsdOwners (issue 29 item 5): the namespace owners record kept with the SSD tier's blocks - its text round-trips,
// every kind of damage is refused with what was wrong, a damaged copy is ignored (another directory's valid copy
// wins), the first owner stays, and owners of namespaces without blocks are forgotten.
#include "daemon/tiers/ssd/ssd_owners.h"

#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <map>
#include <optional>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/temp_dir.h"

using flexkv::SsdOwners;
using flexkv::StatusCode;

namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteAll(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

}  // namespace

TEST_CASE("ssd owners: the record round-trips, and damage of every kind is refused saying what", "[unit][ssd]") {
  const std::map<std::string, uid_t, std::less<>> owners = {{"model a", 1000}, {"llama-3/8b", 65534}};
  const std::string text = SsdOwners::Encode(owners, 7);
  auto decoded = SsdOwners::Decode(text);
  REQUIRE(decoded.ok());
  CHECK(decoded->owners == owners);
  CHECK(decoded->sequence == 7);

  const auto refused = [](const std::string& t) {
    auto d = SsdOwners::Decode(t);
    REQUIRE_FALSE(d.ok());
    return d.status();
  };
  std::string flipped = text;
  flipped[flipped.find("1000")] = '2';
  CHECK_THAT(refused(flipped).message(), Catch::Contains("checksum does not match"));
  CHECK_THAT(refused(text.substr(0, text.size() - 5)).message(), Catch::Contains("newline"));
  CHECK_THAT(refused(text.substr(0, text.find("xxh3"))).message(), Catch::Contains("xxh3"));
  CHECK_THAT(refused("").message(), Catch::Contains("newline"));
  CHECK_THAT(refused(std::string(20 << 20, 'x')).message(), Catch::Contains("at most"));
  // Well-formed checksums over bad bodies: the body's own checks.
  const auto signed_text = [](const std::string& body) {
    // The checksum line Encode writes, over an arbitrary body.
    std::string t = body;
    char line[32];
    std::snprintf(line, sizeof(line), "xxh3 %016llx\n",
                  static_cast<unsigned long long>(XXH3_64bits(t.data(), t.size())));
    return t + line;
  };
  CHECK(refused(signed_text("flexkv-owners 2\nsequence 1\n")).code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused(signed_text("not-owners 1\nsequence 1\n")).message(), Catch::Contains("not an owners record"));
  CHECK_THAT(refused(signed_text("flexkv-owners 1\nsequence x\n")).message(), Catch::Contains("sequence"));
  CHECK_THAT(refused(signed_text("flexkv-owners 1\nsequence 1\nowner abc ns\n")).message(), Catch::Contains("uid"));
  CHECK_THAT(refused(signed_text("flexkv-owners 1\nsequence 1\nowner 4294967295 ns\n")).message(),
             Catch::Contains("uid"));
  CHECK_THAT(refused(signed_text("flexkv-owners 1\nsequence 1\nowner 5 a\x01z\n")).message(), Catch::Contains("namespace"));
  CHECK_THAT(refused(signed_text("flexkv-owners 1\nsequence 1\nowner 5 a\nowner 6 a\n")).message(),
             Catch::Contains("twice"));
  CHECK_THAT(refused(signed_text("flexkv-owners 1\n")).message(), Catch::Contains("sequence"));
  CHECK(SsdOwners::Decode(signed_text("flexkv-owners 1\nsequence 3\n")).ok());
}

TEST_CASE("ssd owners: recorded in every directory, reloaded, the first owner stays, a damaged copy is ignored",
          "[unit][ssd]") {
  flexkv::testing::TempDir dir("flexkv-owners-unit");
  const std::vector<std::string> paths = {dir.path + "/a", dir.path + "/b"};
  for (const std::string& p : paths) std::filesystem::create_directories(p);
  {
    SsdOwners owners(paths);
    std::vector<std::string> warnings;
    owners.Load(&warnings);
    CHECK(warnings.empty());  // no file yet: no record, no warning
    CHECK_FALSE(owners.OwnerOf("m").has_value());
    auto first = owners.Record("m", 1000);
    REQUIRE(first.ok());
    CHECK(*first == 1000);
    auto second = owners.Record("m", 2000);  // another uid's pool of the same namespace later: the owner stays
    REQUIRE(second.ok());
    CHECK(*second == 1000);
    REQUIRE(owners.Record("n", 3000).ok());
  }
  CHECK(ReadAll(paths[0] + "/flexkv-owners") == ReadAll(paths[1] + "/flexkv-owners"));
  {
    SsdOwners owners(paths);
    owners.Load();
    CHECK(owners.OwnerOf("m") == std::optional<uid_t>(1000));
    CHECK(owners.OwnerOf("n") == std::optional<uid_t>(3000));
    // Namespaces without blocks are forgotten, on disk too.
    REQUIRE(owners.Retain([](std::string_view ns) { return ns == "m"; }).ok());
    CHECK_FALSE(owners.OwnerOf("n").has_value());
  }
  // One copy damaged: ignored with a warning naming it; the other one serves.
  std::string text = ReadAll(paths[0] + "/flexkv-owners");
  text[text.find("1000")] = '9';
  WriteAll(paths[0] + "/flexkv-owners", text);
  {
    SsdOwners owners(paths);
    std::vector<std::string> warnings;
    owners.Load(&warnings);
    REQUIRE(warnings.size() == 1);
    CHECK_THAT(warnings[0], Catch::Contains(paths[0] + "/flexkv-owners is ignored: its checksum does not match"));
    CHECK(owners.OwnerOf("m") == std::optional<uid_t>(1000));
    CHECK_FALSE(owners.OwnerOf("n").has_value());
  }
  // Both damaged (one garbage, one cut short): no owner, two warnings, no crash.
  WriteAll(paths[1] + "/flexkv-owners", text.substr(0, text.size() / 2));
  WriteAll(paths[0] + "/flexkv-owners", std::string("\0\xff garbage", 10));
  SsdOwners owners(paths);
  std::vector<std::string> warnings;
  owners.Load(&warnings);
  CHECK(warnings.size() == 2);
  CHECK(owners.Owners().empty());
}

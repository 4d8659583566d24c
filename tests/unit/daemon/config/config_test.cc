// flexkvd's configuration: a TOML file (--config) sets the same keys as the long flags, a flag on the command
// line wins over the file, and a misspelt key or a bad value is a usage error (exit 2), never ignored.
#include "daemon/config/config.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

using flexkv::ParseDaemonArgs;

namespace {

flexkv::ParsedArgs Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "flexkvd");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return ParseDaemonArgs(static_cast<int>(argv.size()), argv.data());
}

// A TOML file with `text`, removed at scope exit.
struct TomlFile {
  std::string path;
  explicit TomlFile(const std::string& text) {
    char tmpl[] = "/tmp/flexkvd-config-test-XXXXXX";
    const int fd = mkstemp(tmpl);
    REQUIRE(fd >= 0);
    close(fd);
    path = tmpl;
    std::ofstream(path) << text;
  }
  ~TomlFile() { unlink(path.c_str()); }
};

}  // namespace

TEST_CASE("flexkvd defaults without flags or a file", "[unit]") {
  auto p = Parse({});
  REQUIRE(p.config.has_value());
  CHECK(p.config->pool_bytes == (uint64_t{1} << 30));
  CHECK(p.config->private_socket_dir);
  CHECK_FALSE(p.config->socket_path.empty());
  CHECK(p.config->pool_path == "/dev/shm/flexkvd-" + std::to_string(geteuid()) + "/pool");
  CHECK_FALSE(p.config->metrics_listen.has_value());
}

TEST_CASE("a TOML config sets the long flags' keys", "[unit]") {
  TomlFile f(
      "socket = \"/tmp/flexkvd-config-test.sock\"\n"
      "pool-size = \"64MiB\"\n"
      "pool-path = \"/tmp/flexkvd-config-test-pool\"\n"
      "spin-us = 5\n"
      "copy-threads = 3\n"
      "load-path = \"copy-engine\"\n"
      "discard-pool = true\n"
      "log-level = \"debug\"\n"
      "metrics-listen = \"127.0.0.1:9400\"\n");
  auto p = Parse({"--config", f.path});
  REQUIRE(p.config.has_value());
  const flexkv::DaemonConfig& c = *p.config;
  CHECK(c.socket_path == "/tmp/flexkvd-config-test.sock");
  CHECK_FALSE(c.private_socket_dir);
  CHECK(c.pool_bytes == (uint64_t{64} << 20));
  CHECK(c.pool_path == "/tmp/flexkvd-config-test-pool");
  CHECK(c.spin_us == 5);
  CHECK(c.copy_threads == 3);
  CHECK(c.load_copy_engine);
  CHECK_FALSE(c.store_copy_engine);
  CHECK(c.discard_pool);
  CHECK(c.log_level == flexkv::log::Level::kDebug);
  REQUIRE(c.metrics_listen.has_value());
  CHECK(c.metrics_listen->loopback);
}

TEST_CASE("a flag on the command line wins over the config file", "[unit]") {
  TomlFile f("pool-size = \"64MiB\"\n");
  auto p = Parse({"--config", f.path, "--pool-size", "128MiB"});
  REQUIRE(p.config.has_value());
  CHECK(p.config->pool_bytes == (uint64_t{128} << 20));
}

TEST_CASE("a misspelt key, a bad value or a missing file is a usage error", "[unit]") {
  SECTION("unknown key") {
    TomlFile f("pool-sise = \"64MiB\"\n");
    auto p = Parse({"--config", f.path});
    CHECK_FALSE(p.config.has_value());
    CHECK(p.exit_code == 2);
  }
  SECTION("out of range") {
    TomlFile f("spin-us = -1\n");
    CHECK(Parse({"--config", f.path}).exit_code == 2);
  }
  SECTION("not one of the choices") {
    TomlFile f("store-path = \"dma\"\n");
    CHECK(Parse({"--config", f.path}).exit_code == 2);
  }
  SECTION("a pool below 1MiB") {
    TomlFile f("pool-size = \"512KiB\"\n");
    CHECK(Parse({"--config", f.path}).exit_code == 2);
  }
  SECTION("a size without a unit parser can read") {
    TomlFile f("pool-size = \"lots\"\n");
    CHECK(Parse({"--config", f.path}).exit_code == 2);
  }
  SECTION("a metrics address off loopback without --metrics-allow-remote") {
    TomlFile f("metrics-listen = \"0.0.0.0:9400\"\n");
    CHECK(Parse({"--config", f.path}).exit_code == 2);
    TomlFile allowed("metrics-listen = \"0.0.0.0:9400\"\nmetrics-allow-remote = true\n");
    CHECK(Parse({"--config", allowed.path}).config.has_value());
  }
  SECTION("a socket path longer than sun_path") {
    CHECK(Parse({"--socket", "/tmp/" + std::string(120, 's')}).exit_code == 2);
  }
  SECTION("no such config file") {
    CHECK(Parse({"--config", "/nonexistent/flexkvd.toml"}).exit_code == 2);
  }
}

TEST_CASE("a group is resolved by name or numeric gid, an unknown one names the flag", "[unit]") {
  auto numeric = flexkv::ResolveGroup("--socket-group", "1234");
  REQUIRE(numeric.ok());
  CHECK(*numeric == 1234);
  auto root = flexkv::ResolveGroup("--socket-group", "root");
  REQUIRE(root.ok());
  CHECK(*root == 0);
  auto unknown = flexkv::ResolveGroup("--admin-group", "no-such-group-flexkv");
  CHECK(unknown.status().code() == flexkv::StatusCode::kInvalidArgument);
  CHECK_THAT(unknown.status().message(), Catch::Contains("--admin-group"));
  CHECK(flexkv::ResolveGroup("--admin-group", "").status().code() == flexkv::StatusCode::kInvalidArgument);
}

TEST_CASE("the pin cap and the pin lease: defaults, keys, and values that make no sense", "[unit]") {
  auto defaults = Parse({});
  REQUIRE(defaults.config.has_value());
  CHECK(defaults.config->max_session_pin_share == 0.5);
  CHECK(defaults.config->pin_lease_s == 10);
  TomlFile f("max-session-pin-share = 0.25\npin-lease = 2.5\n");
  auto p = Parse({"--config", f.path});
  REQUIRE(p.config.has_value());
  CHECK(p.config->max_session_pin_share == 0.25);
  CHECK(p.config->pin_lease_s == 2.5);
  CHECK(Parse({"--pin-lease", "0"}).config->pin_lease_s == 0);  // never lapse
  CHECK(Parse({"--max-session-pin-share", "1"}).config->max_session_pin_share == 1);
  CHECK(Parse({"--max-session-pin-share", "0"}).exit_code == 2);
  CHECK(Parse({"--max-session-pin-share", "1.5"}).exit_code == 2);
  CHECK(Parse({"--pin-lease", "0.001"}).exit_code == 2);
  CHECK(Parse({"--pin-lease", "-1"}).exit_code == 2);
}

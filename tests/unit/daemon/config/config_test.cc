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

TEST_CASE("namespace tables in the config set each namespace's writers and readers, names resolved",
          "[unit][security]") {
  TomlFile f(
      "pool-size = \"64MiB\"\n"
      "[namespace.\"llama3-70b\"]\n"
      "writers = [\"daemon\", \"group:nogroup\", 4242, \"4243\", \"group:77\"]\n"
      "readers = [\"nobody\"]\n"
      "\n"
      "[namespace.qwen]\n"
      "writers = []\n");
  auto p = Parse({"--config", f.path});
  REQUIRE(p.config.has_value());
  CHECK(p.config->pool_bytes == (uint64_t{64} << 20));
  const auto& acls = p.config->namespace_acls;
  REQUIRE(acls.size() == 2);
  const flexkv::NamespaceAcl& llama = acls.at("llama3-70b");
  using Kind = flexkv::AccessPrincipal::Kind;
  REQUIRE(llama.writers.size() == 5);
  CHECK((llama.writers[0].kind == Kind::kUser && llama.writers[0].id == 1 && llama.writers[0].text == "daemon"));
  CHECK((llama.writers[1].kind == Kind::kGroup && llama.writers[1].id == 65534 &&
         llama.writers[1].text == "group:nogroup"));
  CHECK((llama.writers[2].kind == Kind::kUser && llama.writers[2].id == 4242 && llama.writers[2].text == "4242"));
  CHECK((llama.writers[3].kind == Kind::kUser && llama.writers[3].id == 4243));
  CHECK((llama.writers[4].kind == Kind::kGroup && llama.writers[4].id == 77));
  REQUIRE(llama.readers.has_value());
  REQUIRE(llama.readers->size() == 1);
  CHECK((*llama.readers)[0].id == 65534);
  CHECK(llama.source == "--config " + f.path + " line 2");
  const flexkv::NamespaceAcl& qwen = acls.at("qwen");
  CHECK(qwen.writers.empty());
  CHECK_FALSE(qwen.readers.has_value());
  CHECK(qwen.source == "--config " + f.path + " line 6");
  CHECK(Parse({}).config->namespace_acls.empty());
}

TEST_CASE("a bad namespace table in the config refuses to start, naming the file, line, entry and what was expected",
          "[unit][security]") {
  auto message = [](const std::string& text) {
    TomlFile f(text);
    CHECK(Parse({"--config", f.path}).exit_code == 2);
    auto acls = flexkv::ReadNamespaceAcls(f.path);
    REQUIRE_FALSE(acls.ok());
    CHECK(acls.status().code() == flexkv::StatusCode::kInvalidArgument);
    std::string m = acls.status().message();
    const std::string prefix = "--config " + f.path + " ";
    REQUIRE(m.rfind(prefix, 0) == 0);
    return m.substr(prefix.size());
  };
  CHECK(message("[namespace.\"m\"]\nwriters = [\"daemon\", \"no-such-user-flexkv\"]\n") ==
        "line 2: [namespace.\"m\"] writers[1] 'no-such-user-flexkv' is not a known user; expected a user name, a "
        "uid, or \"group:\" with a group name or gid");
  CHECK(message("[namespace.\"m\"]\nwriters = []\nreaders = [\"group:no-such-group-flexkv\"]\n") ==
        "line 3: [namespace.\"m\"] readers[0] 'group:no-such-group-flexkv' is not a known group; expected a user "
        "name, a uid, or \"group:\" with a group name or gid");
  CHECK(message("[namespace.\"m\"]\nwriters = \"daemon\"\n") ==
        "line 2: [namespace.\"m\"] writers is a string; expected an array of entries, each a user name, a uid, or "
        "\"group:\" with a group name or gid");
  CHECK(message("[namespace.\"m\"]\nwriters = [true]\n") ==
        "line 2: [namespace.\"m\"] writers[0] is a boolean; expected a user name, a uid, or \"group:\" with a group "
        "name or gid");
  CHECK(message("[namespace.\"m\"]\nwriters = [-1]\n") ==
        "line 2: [namespace.\"m\"] writers[0] is -1; expected a uid in 0..4294967294");
  CHECK(message("[namespace.\"m\"]\nwriters = [\"group:\"]\n") ==
        "line 2: [namespace.\"m\"] writers[0] 'group:' names nobody; expected a user name, a uid, or \"group:\" with "
        "a group name or gid");
  CHECK(message("[namespace.\"m\"]\nreaders = []\n") ==
        "line 1: [namespace.\"m\"] has no writers; expected writers = [...] (users, uids, \"group:<name>\"; [] for "
        "admins only) with readers");
  CHECK(message("[namespace.\"m\"]\n") ==
        "line 1: [namespace.\"m\"] has no writers; expected writers = [...] (users, uids, \"group:<name>\"; [] for "
        "admins only), or a pool_size");
  CHECK(message("[namespace.\"m\"]\nwriters = []\nwriter = [\"daemon\"]\n") ==
        "line 3: [namespace.\"m\"] writer is not a known key; expected writers, readers or pool_size");
  CHECK(message("[namespace.\"m\"]\npool_size = \"lots\"\n").starts_with("line 2: [namespace.\"m\"] pool_size: "));
  CHECK(message("[namespace.\"m\"]\npool_size = 1024\n") ==
        "line 2: [namespace.\"m\"] pool_size is 1024 bytes, below 1MiB; expected e.g. \"512MiB\" or \"8GiB\"");
  CHECK(message("[namespace.\"m\"]\npool_size = -5\n") ==
        "line 2: [namespace.\"m\"] pool_size is -5; expected a size like \"8GiB\" or bytes");
  CHECK(message("[namespace.\"m\"]\npool_size = [1]\n") ==
        "line 2: [namespace.\"m\"] pool_size is an array; expected a size like \"8GiB\" or a number of bytes");
  CHECK(message("namespace = 3\n") ==
        "line 1: namespace is an integer; expected tables [namespace.\"<name>\"] with writers and readers");
  CHECK(message("[namespace]\nm = 3\n") ==
        "line 2: [namespace.\"m\"] is an integer; expected a table with writers and readers");
  CHECK(message("[namespace.\"a\\u0001b\"]\nwriters = []\n") ==
        "line 1: a [namespace.\"<name>\"] table's name: namespace has control character U+0001 at byte offset 1; "
        "expected printable UTF-8 text (no NUL, no U+0000..U+001F or U+007F..U+009F)");
  CHECK_THAT(message("[namespace.\"m\"]\nwriters = [\n"), Catch::StartsWith("line "));
}

TEST_CASE("a namespace's pool_size: with or without writers, as a size string or bytes, within the budget",
          "[unit]") {
  TomlFile f(
      "pool-size = \"1GiB\"\n"
      "[namespace.\"llama\"]\npool_size = \"256MiB\"\n"
      "[namespace.\"gpt-oss\"]\nwriters = []\npool_size = 134217728\n"
      "[namespace.\"qwen\"]\nwriters = []\n");
  auto p = Parse({"--config", f.path, "--max-domains", "3"});
  REQUIRE(p.config);
  CHECK(p.config->max_domains == 3);
  CHECK(p.config->namespace_pool_bytes.size() == 2);
  CHECK(p.config->namespace_pool_bytes.at("llama") == (256u << 20));
  CHECK(p.config->namespace_pool_bytes.at("gpt-oss") == (128u << 20));
  // Without writers the namespace keeps the default access rule: no ACL.
  CHECK_FALSE(p.config->namespace_acls.contains("llama"));
  CHECK(p.config->namespace_acls.contains("gpt-oss"));
  CHECK(p.config->namespace_acls.contains("qwen"));
  CHECK(Parse({}).config->max_domains == 1);
  CHECK(Parse({"--max-domains", "0"}).exit_code == 2);

  // Limits may overlap (the domains share the budget by demand, each up to its pool_size), but none may exceed it,
  // also when the value is huge enough to wrap a sum.
  TomlFile overlap("pool-size = \"512MiB\"\n[namespace.\"a\"]\npool_size = \"400MiB\"\n"
                   "[namespace.\"b\"]\npool_size = \"400MiB\"\n");
  CHECK(Parse({"--config", overlap.path}).config.has_value());
  TomlFile over("pool-size = \"512MiB\"\n[namespace.\"a\"]\npool_size = \"513MiB\"\n");
  CHECK(Parse({"--config", over.path}).exit_code == 2);
  TomlFile huge("pool-size = \"512MiB\"\n[namespace.\"a\"]\npool_size = 9223372036854775807\n"
                "[namespace.\"b\"]\npool_size = 9223372036854775807\n");
  CHECK(Parse({"--config", huge.path}).exit_code == 2);
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

TEST_CASE("the SSD tier's flags: paths, size, policy, and what is refused", "[unit]") {
  SECTION("off by default") {
    auto p = Parse({});
    REQUIRE(p.config.has_value());
    CHECK(p.config->ssd_paths.empty());
    CHECK(p.config->ssd_bytes == 0);
    CHECK_FALSE(p.config->ssd_write_all);
  }
  SECTION("one path per drive, a size with units, the options") {
    auto p = Parse({"--ssd-path", "/mnt/nvme0/kv", "--ssd-path", "/mnt/nvme1/kv", "--ssd-size", "4TiB",
                    "--ssd-queue-depth", "64", "--ssd-write-policy", "all", "--ssd-writeback-window", "0.5",
                    "--ssd-on-mismatch", "discard", "--ssd-allow-buffered", "--ssd-sync-writes"});
    REQUIRE(p.config.has_value());
    CHECK(p.config->ssd_paths == std::vector<std::string>{"/mnt/nvme0/kv", "/mnt/nvme1/kv"});
    CHECK(p.config->ssd_bytes == (uint64_t{4} << 40));
    CHECK(p.config->ssd_queue_depth == 64);
    CHECK(p.config->ssd_write_all);
    CHECK(p.config->ssd_writeback_window == 0.5);
    CHECK(p.config->ssd_discard_mismatch);
    CHECK(p.config->ssd_allow_buffered);
    CHECK(p.config->ssd_sync_writes);
  }
  SECTION("from the TOML file") {
    TomlFile f("ssd-path = [\"/mnt/nvme0/kv\"]\nssd-size = \"500GiB\"\n");
    auto p = Parse({"--config", f.path});
    REQUIRE(p.config.has_value());
    CHECK(p.config->ssd_paths == std::vector<std::string>{"/mnt/nvme0/kv"});
    CHECK(p.config->ssd_bytes == (uint64_t{500} << 30));
  }
  SECTION("a path without a size, a size without a path, a path twice, bad values") {
    CHECK(Parse({"--ssd-path", "/mnt/nvme0/kv"}).exit_code == 2);
    CHECK(Parse({"--ssd-size", "1TiB"}).exit_code == 2);
    CHECK(Parse({"--ssd-path", "/a", "--ssd-path", "/a", "--ssd-size", "1TiB"}).exit_code == 2);
    CHECK(Parse({"--ssd-path", "/a", "--ssd-size", "lots"}).exit_code == 2);
    CHECK(Parse({"--ssd-path", "/a", "--ssd-size", "1TiB", "--ssd-on-mismatch", "ignore"}).exit_code == 2);
    CHECK(Parse({"--ssd-path", "/a", "--ssd-size", "1TiB", "--ssd-writeback-window", "0"}).exit_code == 2);
    CHECK(Parse({"--ssd-path", "/a", "--ssd-size", "1TiB", "--ssd-writeback-window", "1.5"}).exit_code == 2);
    CHECK(Parse({"--ssd-path", "/a", "--ssd-size", "1TiB", "--ssd-queue-depth", "0"}).exit_code == 2);
    CHECK(Parse({"--ssd-path", "/a", "--ssd-size", "1TiB", "--ssd-write-policy", "through"}).exit_code == 2);
  }
}

TEST_CASE("the cluster tier's lanes: default 4, 1..16 taken, anything else refused", "[unit]") {
  const std::vector<std::string> cluster = {"--etcd-endpoints", "10.0.0.1:2379", "--cluster-secret-file",
                                            "/etc/flexkv/secret", "--cluster-listen", "10.0.0.7:7471"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = cluster;
    args.insert(args.end(), extra.begin(), extra.end());
    return Parse(args);
  };
  auto p = with({});
  REQUIRE(p.config.has_value());
  CHECK(p.config->cluster_lanes == 4);
  for (const char* n : {"1", "16"}) {
    auto q = with({"--cluster-lanes", n});
    REQUIRE(q.config.has_value());
    CHECK(q.config->cluster_lanes == static_cast<uint32_t>(std::stoul(n)));
  }
  CHECK(with({"--cluster-lanes", "0"}).exit_code == 2);
  CHECK(with({"--cluster-lanes", "17"}).exit_code == 2);
}

// Issue 18: flexkvctl top against a real daemon under a small load (its fields and numbers, a clean exit on
// SIGINT, the terminal restored), and its shell completion (valid bash, completes what --help lists).
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::FlexkvctlPath;
using flexkv::testing::RunCommand;

namespace {

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// The last match of `pattern` in `text`, its groups; empty when none.
std::smatch Last(const std::string& text, const std::regex& pattern) {
  std::smatch last;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), pattern); it != std::sregex_iterator(); ++it) last = *it;
  return last;
}

// What bash completes for the words `line` (the last one being completed) with flexkvctl's script sourced.
std::vector<std::string> Complete(const std::string& line) {
  const std::string script = "source <('" + FlexkvctlPath() + "' completion bash) && COMP_WORDS=(" + line +
                             ") && COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )) && _flexkvctl && printf '%s\\n' "
                             "\"${COMPREPLY[@]}\"";
  auto r = RunCommand({"/bin/bash", "-c", script});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::vector<std::string> words;
  std::istringstream in(r.output);
  for (std::string w; std::getline(in, w);) {
    if (!w.empty()) words.push_back(w);
  }
  return words;
}

}  // namespace

TEST_CASE("flexkvctl top: two frames with hit ratio, GB/s, pool fill, sessions and queues of a daemon under load",
          "[integration][flexkvctl]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  ChildProcess engine = flexkv::testing::SpawnTestClient(d.socket(), "top-load", {"--kv-blocks", "32", "--layers", "2"},
                                                          {"store:5:32", "load:5:32", "load:5:16", "hold"});
  REQUIRE(engine.WaitForLine("LOADED 16 16 1 OK", 30s).has_value());
  // The load while top watches: another engine loading the same blocks over and over.
  std::vector<std::string> loads(400, "load:5:32");
  ChildProcess loader = flexkv::testing::SpawnTestClient(d.socket(), "top-loader", {"--kv-blocks", "32", "--layers", "2"},
                                                          loads);
  REQUIRE(loader.WaitForLine("LOADED 32 32 1 OK", 30s).has_value());

  auto r = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "top", "--iterations", "2", "--interval", "0.2"});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const std::string& out = r.output;
  CHECK(Count(out, "flexkvd ") == 2);                   // one header per frame
  CHECK(out.find('\x1b') == std::string::npos);         // not a terminal: no escape sequences
  CHECK(Count(out, "(q to quit)") == 0);
  for (const char* field : {"\nhit ratio ", "\nGB/s ", "\nrequests/s ", "\npool ", "\nsessions ", ") serving, up"}) {
    INFO(field);
    CHECK(Count(out, field) == 2);
  }

  // Since start: at least the first engine's two loads (48 blocks) and the loader's first, all hits; counters only
  // grow from one frame to the next.
  const std::regex since_start(R"(([0-9.]+)% since start \((\d+)/(\d+) blocks\))");
  std::vector<uint64_t> hits;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), since_start); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    const uint64_t h = std::stoull(m[2]), asked = std::stoull(m[3]);
    CHECK(h >= 48 + 32);
    CHECK(h <= asked);
    CHECK(std::stod(m[1]) == Approx(100.0 * static_cast<double>(h) / static_cast<double>(asked)).margin(0.1));
    hits.push_back(h);
  }
  REQUIRE(hits.size() == 2);
  CHECK(hits[1] >= hits[0]);

  // GB/s per direction and blocks per second come from the same two snapshots: the load rate in bytes is the
  // block rate times the block size, and no rate is negative. Up to the printed precision, and to one load of 32
  // blocks per snapshot (the daemon counts blocks and bytes in two steps) over an interval of at least 0.2 s.
  const uint64_t block_bytes = 16ULL * 2 * 2 * 8 * 128 * 2;  // Llama3_8B's shape with --layers 2
  const std::regex gbs(R"(GB/s +load ([0-9.]+) \(pool to engines\), store ([0-9.]+))");
  const std::regex blocks(R"(requests/s +match ([0-9.]+), load ([0-9.]+) blocks, store ([0-9.]+) blocks)");
  std::vector<double> load_gbs, load_blocks;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), gbs); it != std::sregex_iterator(); ++it) {
    load_gbs.push_back(std::stod((*it)[1]));
    CHECK(std::stod((*it)[2]) >= 0);
  }
  for (auto it = std::sregex_iterator(out.begin(), out.end(), blocks); it != std::sregex_iterator(); ++it) {
    load_blocks.push_back(std::stod((*it)[2]));
    CHECK(std::stod((*it)[1]) >= 0);
  }
  REQUIRE(load_gbs.size() == 2);
  REQUIRE(load_blocks.size() == 2);
  for (size_t f = 0; f < 2; ++f) {
    CHECK(load_gbs[f] >= 0);
    CHECK(load_gbs[f] * 1e9 == Approx(load_blocks[f] * block_bytes).margin(0.0006e9 + 0.05 * block_bytes + 2 * 32 * block_bytes / 0.2));
  }

  const std::smatch pool = Last(out, std::regex(R"(pool +(\d+)/(\d+) blocks \(([0-9.]+)%\) of (\d+) bytes)"));
  REQUIRE_FALSE(pool.empty());
  CHECK(std::stoull(pool[1]) == 32);
  CHECK(std::stoull(pool[2]) >= 32);
  CHECK(std::stoull(pool[4]) == block_bytes);

  CHECK(Count(out, "sessions    2 attached; queue ") == 2);
  CHECK(Count(out, " top-load ") == 2);  // the session table
  CHECK(Count(out, " top-loader ") == 2);
}

TEST_CASE("flexkvctl top: SIGINT ends it with exit 0, and on a terminal it restores the cursor and quits on q",
          "[integration][flexkvctl]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  {
    ChildProcess top = ChildProcess::Spawn({FlexkvctlPath(), "--socket", d.socket(), "top", "--interval", "0.1"});
    REQUIRE(top.WaitForLine("flexkvd ", 10s).has_value());
    top.Signal(SIGINT);
    const auto status = top.Wait(10s);
    REQUIRE(status.has_value());
    REQUIRE(WIFEXITED(*status));
    CHECK(WEXITSTATUS(*status) == 0);
  }
  // A pseudo-terminal (util-linux script): the redraw escapes, the cursor hidden and shown again, and 'q' quits a top
  // that would otherwise run for ever.
  const std::string command = "'" + FlexkvctlPath() + "' --socket '" + d.socket() + "' top --interval 0.2";
  auto r = RunCommand({"/bin/sh", "-c", "{ sleep 1.5; printf q; sleep 3; } | script -qec \"" + command + "\" /dev/null"},
                      30s);
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(Count(r.output, "\x1b[?25l") == 1);
  CHECK(Count(r.output, "\x1b[?25h") == 1);
  CHECK(r.output.rfind("\x1b[?25h") > r.output.rfind("hit ratio"));
  CHECK(Count(r.output, "\x1b[H") >= 2);
}

TEST_CASE("flexkvctl top: a daemon that is not there is exit 3, naming the socket", "[integration][flexkvctl]") {
  auto r = RunCommand({FlexkvctlPath(), "--socket", "/nonexistent/flexkvd.sock", "top", "--once"});
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.output, Catch::Contains("/nonexistent/flexkvd.sock"));
}

TEST_CASE("flexkvctl completion: the bash script is valid and completes what --help lists", "[integration][flexkvctl]") {
  auto script = RunCommand({FlexkvctlPath(), "completion", "bash"});
  REQUIRE(script.exit_code == 0);
  auto syntax = RunCommand({"/bin/bash", "-n", "-c", script.output});
  INFO(syntax.output);
  CHECK(syntax.exit_code == 0);

  // Every subcommand flexkvctl --help lists is completed from nothing.
  auto help = RunCommand({FlexkvctlPath(), "--help"});
  REQUIRE(help.exit_code == 0);
  const size_t subs_at = help.output.find("Subcommands:");
  REQUIRE(subs_at != std::string::npos);
  std::vector<std::string> listed;
  std::istringstream in(help.output.substr(subs_at));
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_match(line, m, std::regex(R"(\s+([a-z-]+)\s+.*)"))) listed.push_back(m[1]);
  }
  REQUIRE(listed.size() >= 10);
  const std::vector<std::string> all = Complete("flexkvctl ''");
  for (const std::string& sub : listed) {
    INFO(sub);
    CHECK(std::find(all.begin(), all.end(), sub) != all.end());
  }
  CHECK(std::find(all.begin(), all.end(), "top") != all.end());

  CHECK(Complete("flexkvctl st") == std::vector<std::string>{"status"});
  CHECK(Complete("flexkvctl top --i") == std::vector<std::string>{"--interval", "--iterations"});
  CHECK(Complete("flexkvctl completion ''") == std::vector<std::string>{"bash", "zsh", "--help", "-h"});
  CHECK(Complete("flexkvctl --socket /tmp/x dr") == std::vector<std::string>{"drain", "drop-domain"});
  CHECK(Complete("flexkvctl scrub --timeout ''").empty());  // a number: nothing to offer
  CHECK(Complete("flexkvctl drain --").size() >= 4);         // --wait --timeout --json --socket --help

  auto zsh = RunCommand({FlexkvctlPath(), "completion", "zsh"});
  CHECK(zsh.exit_code == 0);
  CHECK_THAT(zsh.output, Catch::Contains("bashcompinit") && Catch::Contains("complete -F _flexkvctl flexkvctl"));
  CHECK(RunCommand({FlexkvctlPath(), "completion", "fish"}).exit_code == 2);
}

// The log line format (common/log.h): syslog priorities for journald, one event per line, the plain timestamped form.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

#include "common/log.h"

using flexkv::log::FormatLine;
using flexkv::log::Level;
using flexkv::log::LineFormat;

TEST_CASE("log: under journald each line starts with its syslog priority, as sd-daemon(3) reads it", "[unit][log]") {
  const LineFormat journal{.journal = true};
  CHECK(FormatLine(Level::kDebug, "ring", "opened", journal) == "<7>DEBUG ring: opened\n");
  CHECK(FormatLine(Level::kInfo, "pool", "created", journal) == "<6>INFO pool: created\n");
  CHECK(FormatLine(Level::kWarning, "cache", "dropped", journal) == "<4>WARN cache: dropped\n");
  CHECK(FormatLine(Level::kError, "daemon", "FATAL x", journal) == "<3>ERROR daemon: FATAL x\n");
}

TEST_CASE("log: outside the journal a line starts with its UTC time to the millisecond", "[unit][log]") {
  // 2026-12-04T02:40:42.007Z
  const LineFormat plain{.journal = false, .unix_ms = 1796352042007};
  CHECK(FormatLine(Level::kInfo, "pool", "created", plain) == "2026-12-04T02:40:42.007Z INFO pool: created\n");
}

TEST_CASE("log: one event is one line, whatever the message holds", "[unit][log]") {
  const LineFormat journal{.journal = true};
  const std::string line =
      FormatLine(Level::kWarning, "session", "name 'a\nb'\r\x1b[2J\ttab \x7f end\n", journal);
  CHECK(line == "<4>WARN session: name 'a\\nb'\\r\\x1b[2J\ttab \\x7f end\\n\n");
  CHECK(line.find('\n') == line.size() - 1);
  // A component cannot forge a priority or a second line either.
  CHECK(FormatLine(Level::kInfo, "x\n<3>ERROR y", "z", journal) == "<6>INFO x\\n<3>ERROR y: z\n");
  // UTF-8 passes unchanged.
  CHECK(FormatLine(Level::kInfo, "pool", "namespace 'modèle'", journal) == "<6>INFO pool: namespace 'modèle'\n");
}

TEST_CASE("log: stderr is the journal only when JOURNAL_STREAM names its device and inode", "[unit][log]") {
  struct stat st {};
  REQUIRE(fstat(STDERR_FILENO, &st) == 0);
  const std::string mine = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  CHECK(flexkv::log::StderrIsJournal(mine.c_str()));
  CHECK_FALSE(flexkv::log::StderrIsJournal(nullptr));
  CHECK_FALSE(flexkv::log::StderrIsJournal(""));
  CHECK_FALSE(flexkv::log::StderrIsJournal("garbage"));
  CHECK_FALSE(flexkv::log::StderrIsJournal((mine + "x").c_str()));
  // Another stream (the journal of a parent whose stderr this process no longer shares).
  const std::string other = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino + 1);
  CHECK_FALSE(flexkv::log::StderrIsJournal(other.c_str()));
}

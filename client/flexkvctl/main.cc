// flexkvctl: look at a running flexkvd (status, sessions, metrics), drain it for maintenance, scrub its pool,
// drop its cache domain.
// Exit codes: 0 ok, 1 the daemon said no, 2 usage, 3 cannot connect.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "flexkv/client.h"

namespace {

using flexkv::Client;
using flexkv::Status;

constexpr int kExitOk = 0;
constexpr int kExitRefused = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNoConnection = 3;

// Key order is kept (ordered_json) so the output reads like the text form; strings that are not valid UTF-8
// (a client names itself) are printed with U+FFFD in place of the bad bytes rather than failing the command.
using Json = nlohmann::ordered_json;

std::string Dump(const Json& j, int indent) { return j.dump(indent, ' ', false, Json::error_handler_t::replace); }

Json StatusJson(const flexkv::DaemonStatus& s) {
  Json counters = Json::object();
  for (const auto& [name, value] : s.counters) counters[name] = value;
  Json backends = Json::array();
  for (const auto& b : s.backends) backends.push_back(Json{{"name", b.name}, {"devices", b.devices}});
  Json components = Json::array();
  for (const auto& c : s.pool.components) {
    components.push_back(Json{{"kind", flexkv::ComponentKindName(c.kind)},
                              {"slot_bytes", c.slot_bytes},
                              {"capacity", c.capacity},
                              {"used", c.used},
                              {"pinned", c.pinned},
                              {"evicted", c.evicted},
                              {"unanchored", c.unanchored}});
  }
  return Json{{"state", s.state},
              {"version", s.version},
              {"pid", s.pid},
              {"uptime_s", s.uptime_s},
              {"pool",
               {{"block_bytes", s.pool.block_bytes},
                {"capacity_blocks", s.pool.capacity_blocks},
                {"used_blocks", s.pool.used_blocks},
                {"pinned_blocks", s.pool.pinned_blocks},
                {"backing", s.pool.backing},
                {"budget_bytes", s.pool.budget_bytes},
                {"unverified_blocks", s.pool.unverified_blocks},
                {"components", components}}},
              {"index", {{"blocks", s.index_blocks}}},
              {"sessions", s.sessions},
              {"counters", counters},
              {"backends", backends},
              {"model_namespace", s.model_namespace}};
}

Json SessionJson(const flexkv::SessionEntry& s) {
  return Json{{"session_id", s.session_id},     {"client_name", s.client_name},
              {"pid", s.pid},                   {"uid", s.uid},
              {"gid", s.gid},                   {"dp_rank", s.dp_rank},
              {"tp_rank", s.tp_rank},           {"model_namespace", s.model_namespace},
              {"state", s.state},               {"attached_unix_ms", s.attached_unix_ms},
              {"pinned_blocks", s.pinned_blocks}, {"inflight_requests", s.inflight_requests}};
}

void PrintStatus(const flexkv::DaemonStatus& s) {
  fmt::print("flexkvd {} (pid {}), up {} s: {}\n", s.version, s.pid, s.uptime_s, s.state);
  if (s.pool.block_bytes == 0) {
    fmt::print("pool      budget {} bytes; block size not fixed yet (no session has attached)\n", s.pool.budget_bytes);
  } else {
    fmt::print("pool      {} slots of {} bytes; {} used, {} pinned; backing {}\n", s.pool.capacity_blocks,
               s.pool.block_bytes, s.pool.used_blocks, s.pool.pinned_blocks,
               s.pool.backing.empty() ? "-" : s.pool.backing);
  }
  // A hybrid domain's sub-pools, one line each (a full-attention domain has one, the pool line above).
  if (s.pool.components.size() > 1) {
    for (size_t i = 0; i < s.pool.components.size(); ++i) {
      const auto& c = s.pool.components[i];
      fmt::print("  {} {:<14} {} slots of {} bytes; {} used, {} pinned, {} evicted, {} unanchored\n", i,
                 flexkv::ComponentKindName(c.kind), c.capacity, c.slot_bytes, c.used, c.pinned, c.evicted,
                 c.unanchored);
    }
  }
  if (s.pool.unverified_blocks > 0) {
    fmt::print("verifying {} restored blocks left to check (not served until they pass)\n", s.pool.unverified_blocks);
  }
  fmt::print("domain    {}\n", s.model_namespace.empty() ? "-" : s.model_namespace);
  fmt::print("index     {} blocks\n", s.index_blocks);
  fmt::print("sessions  {}\n", s.sessions);
  std::string counters;
  for (const auto& [name, value] : s.counters) counters += fmt::format("{}{}={}", counters.empty() ? "" : " ", name, value);
  fmt::print("counters  {}\n", counters.empty() ? "-" : counters);
  std::string backends;
  for (const auto& b : s.backends) {
    backends += (backends.empty() ? "" : ", ") + b.name;
    for (const auto& d : b.devices) backends += " " + d;
  }
  fmt::print("backends  {}\n", backends);
}

int Refused(const Status& s) {
  std::fprintf(stderr, "flexkvctl: %s\n", s.ToString().c_str());
  return kExitRefused;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexkvctl: inspect and drain a flexkvd"};
  app.require_subcommand(1);
  std::string socket;
  bool json = false;
  double connect_timeout_s = 1.0;
  app.add_option("--socket", socket, "Control socket (default: $FLEXKV_SOCKET, else the default flexkvd socket)");
  app.add_flag("--json", json, "Machine-readable output");
  app.add_option("--connect-timeout", connect_timeout_s, "Seconds to wait for a daemon that is starting (default 1)")
      ->check(CLI::Range(0.0, 600.0));
  auto* status_cmd = app.add_subcommand("status", "Daemon state, pool, index, counters");
  auto* sessions_cmd = app.add_subcommand("sessions", "Attached engine sessions");
  auto* metrics_cmd = app.add_subcommand("metrics", "Prometheus metrics, as the metrics endpoint serves them");
  auto* drain_cmd = app.add_subcommand("drain", "Stop admitting new loads/stores; finish in-flight work");
  bool drain_wait = false;
  double drain_timeout_s = 60;
  drain_cmd->add_flag("--wait", drain_wait, "Return only once the daemon reports drained");
  drain_cmd->add_option("--timeout", drain_timeout_s, "Seconds --wait waits (default 60)")->check(CLI::Range(0.0, 86400.0));
  auto* resume_cmd = app.add_subcommand("resume", "Admit work again after a drain");
  auto* health_cmd = app.add_subcommand("health", "gRPC health check: exit 0 when serving");
  auto* drop_cmd = app.add_subcommand(
      "drop-domain", "Drop the cache domain and its pool (blocks are lost) so the next Attach fixes a new one");
  auto* scrub_cmd = app.add_subcommand(
      "scrub", "Check every cached block against its checksum while serving; drop and count the ones that fail");
  double scrub_rate_mib = 0;
  double scrub_timeout_s = 86400;
  scrub_cmd->add_option("--rate", scrub_rate_mib, "Read at most this many MiB per second (default 0: no limit)")
      ->check(CLI::Range(0.0, 1e9));
  scrub_cmd->add_option("--timeout", scrub_timeout_s, "Seconds to wait for the scrub (default 86400)")
      ->check(CLI::Range(1.0, 31.0 * 86400));
  for (auto* sub : {status_cmd, sessions_cmd, metrics_cmd, drain_cmd, resume_cmd, health_cmd, scrub_cmd,
                    drop_cmd}) {
    sub->add_flag("--json", json, "Machine-readable output");
    sub->add_option("--socket", socket, "Control socket");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }

  flexkv::ConnectOptions options;
  options.socket_path = socket;
  options.connect_timeout = std::chrono::milliseconds(static_cast<int64_t>(connect_timeout_s * 1000));
  auto client = Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr,
                 "flexkvctl: cannot connect: %s\n"
                 "  check that flexkvd is running (systemctl status flexkvd), that --socket or FLEXKV_SOCKET names\n"
                 "  its socket, and that your user may open it (group of the socket, mode 0660)\n",
                 client.status().message().c_str());
    return kExitNoConnection;
  }
  Client& c = **client;

  if (status_cmd->parsed()) {
    auto s = c.GetStatus();
    if (!s.ok()) return Refused(s.status());
    if (json) {
      fmt::print("{}\n", Dump(StatusJson(*s), 2));
    } else {
      PrintStatus(*s);
    }
    return kExitOk;
  }
  if (sessions_cmd->parsed()) {
    auto list = c.ListSessions();
    if (!list.ok()) return Refused(list.status());
    const auto now_ms = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                  std::chrono::system_clock::now().time_since_epoch())
                                                  .count());
    if (json) {
      Json out = Json::array();
      for (const auto& s : *list) out.push_back(SessionJson(s));
      fmt::print("{}\n", Dump(out, 2));
    } else {
      fmt::print("{:>16}  {:<20} {:>8} {:>6} {:>4} {:>4}  {:<10} {:>7} {:>8} {:>8}\n", "ID", "NAME", "PID", "UID", "DP",
                 "TP", "STATE", "PINNED", "INFLIGHT", "AGE_S");
      for (const auto& s : *list) {
        fmt::print("{:>16}  {:<20} {:>8} {:>6} {:>4} {:>4}  {:<10} {:>7} {:>8} {:>8}\n", s.session_id,
                   s.client_name.empty() ? "-" : s.client_name, s.pid, s.uid, s.dp_rank, s.tp_rank, s.state,
                   s.pinned_blocks, s.inflight_requests, now_ms > s.attached_unix_ms ? (now_ms - s.attached_unix_ms) / 1000 : 0);
      }
      if (list->empty()) fmt::print("(no sessions)\n");
    }
    return kExitOk;
  }
  if (metrics_cmd->parsed()) {
    auto text = c.GetMetrics();
    if (!text.ok()) return Refused(text.status());
    fmt::print("{}", *text);
    return kExitOk;
  }
  if (drain_cmd->parsed()) {
    auto state = c.Drain();
    if (!state.ok()) return Refused(state.status());
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(drain_timeout_s * 1000));
    std::string current = *state;
    while (drain_wait && current != "drained") {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::fprintf(stderr, "flexkvctl: still %s after %.0f s; in-flight work has not finished\n", current.c_str(),
                     drain_timeout_s);
        return kExitRefused;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      auto s = c.GetStatus();
      if (!s.ok()) return Refused(s.status());
      current = s->state;
    }
    fmt::print("{}\n", json ? Dump(Json{{"state", current}}, -1) : current);
    return kExitOk;
  }
  if (resume_cmd->parsed()) {
    auto state = c.Resume();
    if (!state.ok()) return Refused(state.status());
    fmt::print("{}\n", json ? Dump(Json{{"state", *state}}, -1) : *state);
    return kExitOk;
  }
  if (drop_cmd->parsed()) {
    auto dropped = c.DropDomain();
    if (!dropped.ok()) return Refused(dropped.status());
    fmt::print("{}\n", json ? Dump(Json{{"dropped_blocks", *dropped}}, -1) : fmt::format("dropped {} blocks", *dropped));
    return kExitOk;
  }
  if (scrub_cmd->parsed()) {
    const auto rate = static_cast<uint64_t>(scrub_rate_mib * 1024 * 1024);
    auto r = c.Scrub(rate, std::chrono::milliseconds(static_cast<int64_t>(scrub_timeout_s * 1000)));
    if (!r.ok()) return Refused(r.status());
    if (json) {
      fmt::print("{}\n", Dump(Json{{"checked_blocks", r->checked_blocks},
                                   {"failed_blocks", r->failed_blocks},
                                   {"dropped_blocks", r->dropped_blocks},
                                   {"bytes", r->bytes},
                                   {"seconds", r->seconds}},
                              -1));
    } else {
      fmt::print("checked {} blocks ({} bytes) in {:.2f} s: {} failed their checksum, {} dropped with their "
                 "descendants\n",
                 r->checked_blocks, r->bytes, r->seconds, r->failed_blocks, r->dropped_blocks);
    }
    return kExitOk;
  }
  if (health_cmd->parsed()) {
    Status h = c.CheckHealth();
    if (json) {
      fmt::print("{}\n", Dump(Json{{"serving", h.ok()}, {"message", h.message()}}, -1));
    } else {
      fmt::print("{}\n", h.ok() ? "SERVING" : h.message());
    }
    return h.ok() ? kExitOk : kExitRefused;
  }
  return kExitUsage;
}

// flexkvctl: look at a running flexkvd (status, sessions, metrics, a live top), drain it for maintenance, scrub its
// pool, drop its cache domain; print its own shell completion.
// Exit codes: 0 ok, 1 the daemon said no, 2 usage, 3 cannot connect.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>

#include "completion.h"
#include "flexkv/client.h"
#include "flexkv/kv_events.h"
#include "top.h"

namespace {

using flexkv::Client;
using flexkv::KvBlockEvent;
using flexkv::KvEventSubscription;
using flexkv::KvSubscribeOptions;
using flexkv::Status;

constexpr int kExitOk = 0;
constexpr int kExitRefused = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNoConnection = 3;

// Key order is kept (ordered_json) so the output reads like the text form; strings that are not valid UTF-8
// (a client names itself) are printed with U+FFFD in place of the bad bytes rather than failing the command.
using Json = nlohmann::ordered_json;

std::string Dump(const Json& j, int indent) { return j.dump(indent, ' ', false, Json::error_handler_t::replace); }

Json PoolJson(const flexkv::DaemonStatus::Pool& p) {
  Json components = Json::array();
  for (const auto& c : p.components) {
    components.push_back(Json{{"kind", flexkv::ComponentKindName(c.kind)},
                              {"slot_bytes", c.slot_bytes},
                              {"capacity", c.capacity},
                              {"used", c.used},
                              {"pinned", c.pinned},
                              {"evicted", c.evicted},
                              {"unanchored", c.unanchored}});
  }
  return Json{{"block_bytes", p.block_bytes},
              {"capacity_blocks", p.capacity_blocks},
              {"used_blocks", p.used_blocks},
              {"pinned_blocks", p.pinned_blocks},
              {"backing", p.backing},
              {"budget_bytes", p.budget_bytes},
              {"unverified_blocks", p.unverified_blocks},
              {"preparation", p.preparation},
              {"active_bytes", p.active_bytes},
              {"target_bytes", p.target_bytes},
              {"prepare_ms", p.prepare_ms},
              {"first_serve_ms", p.first_serve_ms},
              {"components", components}};
}

// "16 tokens/block: 24 full layers + 24 sliding_window(128 tokens) layers" - what an operator tells models apart by.
std::string ShortGeometry(const flexkv::Geometry& g) {
  std::string text = fmt::format("{} tokens/block: {} full layers", g.tokens_per_block, g.num_layers);
  for (size_t c = 1; c < g.component_count(); ++c) {
    const flexkv::ComponentSpec& spec = g.components[c - 1];
    text += fmt::format(" + {} {}", spec.num_layers, flexkv::ComponentKindName(spec.kind));
    if (spec.kind == flexkv::ComponentKind::kSlidingWindow) text += fmt::format("({} tokens)", spec.window_tokens);
    text += " layers";
  }
  return text;
}

Json CountersJson(const std::map<std::string, uint64_t>& counters) {
  Json out = Json::object();
  for (const auto& [name, value] : counters) out[name] = value;
  return out;
}

Json StatusJson(const flexkv::DaemonStatus& s) {
  Json backends = Json::array();
  for (const auto& b : s.backends) backends.push_back(Json{{"name", b.name}, {"devices", b.devices}});
  Json domains = Json::array();
  for (const auto& d : s.domains) {
    domains.push_back(Json{{"model_namespace", d.model_namespace},
                           {"geometry", d.geometry.ToString()},
                           {"pool", PoolJson(d.pool)},
                           {"index", {{"blocks", d.index_blocks}}},
                           {"sessions", d.sessions},
                           {"idle_s", d.idle_s},
                           {"limit_bytes", d.limit_bytes},
                           {"counters", CountersJson(d.counters)}});
  }
  Json tiers = Json::array();
  for (const auto& t : s.tiers) {
    Json files = Json::array();
    for (const auto& f : t.files) {
      files.push_back(Json{{"path", f.path}, {"filesystem", f.filesystem}, {"direct_io", f.direct_io}, {"slots", f.slots}});
    }
    tiers.push_back(Json{{"name", t.name},
                         {"state", t.state},
                         {"capacity_blocks", t.capacity_blocks},
                         {"used_blocks", t.used_blocks},
                         {"capacity_bytes", t.capacity_bytes},
                         {"block_bytes", t.block_bytes},
                         {"read_bytes_per_s", t.read_bytes_per_s},
                         {"write_bytes_per_s", t.write_bytes_per_s},
                         {"rebuild_s", t.rebuild_s},
                         {"counters", CountersJson(t.counters)},
                         {"files", files},
                         {"notes", t.notes}});
  }
  Json cluster = nullptr;
  if (s.cluster) {
    Json members = Json::array();
    for (const auto& m : s.cluster->members) {
      members.push_back(Json{{"node_id", m.node_id}, {"epoch", m.epoch}, {"endpoint", m.endpoint}, {"self", m.self}});
    }
    cluster = Json{{"state", s.cluster->state},
                   {"node_id", s.cluster->node_id},
                   {"epoch", s.cluster->epoch},
                   {"endpoint", s.cluster->endpoint},
                   {"members", members},
                   {"counters", CountersJson(s.cluster->counters)},
                   {"transports", s.cluster->transports},
                   {"rdma_devices", s.cluster->rdma_devices},
                   {"last_error", s.cluster->last_error}};
  }
  return Json{{"tiers", tiers},
              {"cluster", cluster},
              {"state", s.state},
              {"version", s.version},
              {"pid", s.pid},
              {"uptime_s", s.uptime_s},
              {"pool", PoolJson(s.pool)},
              {"index", {{"blocks", s.index_blocks}}},
              {"sessions", s.sessions},
              {"counters", CountersJson(s.counters)},
              {"backends", backends},
              {"model_namespace", s.model_namespace},
              {"domains", domains},
              {"kv_events", {{"instance_id", fmt::format("{:016x}", s.kv_events.instance_id)},
                             {"last_seq", s.kv_events.last_seq},
                             {"subscribers", s.kv_events.subscribers},
                             {"cut_off", s.kv_events.cut_off},
                             {"buffer_events", s.kv_events.buffer_events},
                             {"zmq_endpoint", s.kv_events.zmq_endpoint},
                             {"zmq_batches", s.kv_events.zmq_batches},
                             {"zmq_events", s.kv_events.zmq_events},
                             {"zmq_resyncs", s.kv_events.zmq_resyncs}}}};
}

Json SessionJson(const flexkv::SessionEntry& s) {
  return Json{{"session_id", s.session_id},     {"client_name", s.client_name},
              {"pid", s.pid},                   {"uid", s.uid},
              {"gid", s.gid},                   {"dp_rank", s.dp_rank},
              {"tp_rank", s.tp_rank},           {"model_namespace", s.model_namespace},
              {"state", s.state},               {"attached_unix_ms", s.attached_unix_ms},
              {"pinned_blocks", s.pinned_blocks}, {"inflight_requests", s.inflight_requests}};
}

std::string CountersText(const std::map<std::string, uint64_t>& counters) {
  std::string text;
  for (const auto& [name, value] : counters) text += fmt::format("{}{}={}", text.empty() ? "" : " ", name, value);
  return text.empty() ? "-" : text;
}

// Bytes as GiB with one decimal ("12.5 GiB").
std::string GiB(uint64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / (1ULL << 30)); }

// A pool's line (starting with `label`) and, for a hybrid domain, one line per component's sub-pool.
void PrintPool(const flexkv::DaemonStatus::Pool& p, const char* label) {
  if (p.block_bytes == 0) {
    fmt::print("{:<10}budget {} bytes; block size not fixed yet (no session has attached)\n", label, p.budget_bytes);
  } else {
    fmt::print("{:<10}{} slots of {} bytes; {} used, {} pinned; backing {}\n", label, p.capacity_blocks, p.block_bytes,
               p.used_blocks, p.pinned_blocks, p.backing.empty() ? "-" : p.backing);
  }
  if (p.preparation == "preparing") {
    fmt::print("{:<10}preparing in the background: {} of {} allocated and registered ({} ms so far; {})\n", "",
               GiB(p.active_bytes), GiB(p.target_bytes), p.prepare_ms,
               p.first_serve_ms != 0 ? fmt::format("serving since {} ms", p.first_serve_ms)
                                     : std::string("stores retry until its first grants are ready"));
  } else if (!p.preparation.empty()) {
    fmt::print("{:<10}pool {}\n", "", p.preparation);
  }
  if (p.components.size() > 1) {
    for (size_t i = 0; i < p.components.size(); ++i) {
      const auto& c = p.components[i];
      fmt::print("  {} {:<14} {} slots of {} bytes; {} used, {} pinned, {} evicted, {} unanchored\n", i,
                 flexkv::ComponentKindName(c.kind), c.capacity, c.slot_bytes, c.used, c.pinned, c.evicted,
                 c.unanchored);
    }
  }
  if (p.unverified_blocks > 0) {
    fmt::print("verifying {} restored blocks left to check (not served until they pass)\n", p.unverified_blocks);
  }
}

void PrintStatus(const flexkv::DaemonStatus& s) {
  fmt::print("flexkvd {} (pid {}), up {} s: {}\n", s.version, s.pid, s.uptime_s, s.state);
  if (s.domains.size() <= 1) {
    // One domain (or none yet): the daemon's pool is that domain's.
    PrintPool(s.pool, "pool");
    fmt::print("domain    {}\n", s.model_namespace.empty() ? "-" : s.model_namespace);
  } else {
    fmt::print("budget    {} bytes over {} domains\n", s.pool.budget_bytes, s.domains.size());
    for (const auto& d : s.domains) {
      const uint64_t hit = d.counters.contains("hit_blocks") ? d.counters.at("hit_blocks") : 0;
      const uint64_t asked = d.counters.contains("match_blocks") ? d.counters.at("match_blocks") : 0;
      const uint64_t evicted = d.counters.contains("evicted_blocks") ? d.counters.at("evicted_blocks") : 0;
      fmt::print("domain    {} ({}): share {} bytes{}; {} session(s){}; {} blocks indexed; hit {}/{} blocks; {} "
                 "evicted\n",
                 d.model_namespace, ShortGeometry(d.geometry), d.pool.budget_bytes,
                 d.limit_bytes != 0 ? fmt::format(" (limit {})", d.limit_bytes) : std::string(), d.sessions,
                 d.sessions == 0 ? fmt::format(", idle {} s", d.idle_s) : std::string(), d.index_blocks, hit, asked,
                 evicted);
      PrintPool(d.pool, "  pool");
    }
  }
  fmt::print("index     {} blocks\n", s.index_blocks);
  fmt::print("sessions  {}\n", s.sessions);
  fmt::print("counters  {}\n", CountersText(s.counters));
  std::string backends;
  for (const auto& b : s.backends) {
    backends += (backends.empty() ? "" : ", ") + b.name;
    for (const auto& d : b.devices) backends += " " + d;
  }
  fmt::print("backends  {}\n", backends);
  for (const auto& t : s.tiers) {
    const auto c = [&t](const char* name) { return t.counters.contains(name) ? t.counters.at(name) : 0; };
    fmt::print("{:<10}{}: {}/{} blocks of {} bytes ({} bytes on disk); {} promoted ({} refused, {} failed), {} written "
               "({} refused, {} failed); read {:.1f} MB/s, write {:.1f} MB/s; {} reads, {} writes in flight\n",
               t.name, t.state, t.used_blocks, t.capacity_blocks, t.block_bytes, t.capacity_bytes, c("promoted_blocks"),
               c("promotion_refused_blocks"), c("promotion_failed_blocks"), c("written_back_blocks"),
               c("writeback_refused_blocks"), c("writeback_failed_blocks"), t.read_bytes_per_s / 1e6,
               t.write_bytes_per_s / 1e6, c("reads_in_flight"), c("writes_in_flight"));
    fmt::print("  evictions from DRAM: {} kept on {}, {} lost (not written yet); stores that waited for the "
               "write-back: {} ({} ran out of time), promotions: {} ({}); {} overwritten on {}; checksum/read "
               "failures {} ({} read errors); opened in {:.2f} s with {} blocks ({} corrupt headers, {} truncated)\n",
               c("evicted_written_blocks"), t.name, c("evicted_unwritten_blocks"), c("store_waits"),
               c("store_wait_expired"), c("promotion_waits"), c("promotion_wait_expired"), c("evicted_blocks"), t.name,
               c("data_loss_blocks"), c("read_errors"), t.rebuild_s, c("rebuilt_blocks"), c("rebuild_corrupt_headers"),
               c("rebuild_truncated"));
    for (const auto& f : t.files) {
      fmt::print("  {} on {}: {} slots, {}\n", f.path, f.filesystem, f.slots, f.direct_io ? "direct I/O" : "BUFFERED I/O");
    }
    for (const auto& n : t.notes) fmt::print("  note: {}\n", n);
  }
  if (s.kv_events.subscribers > 0 || s.kv_events.cut_off > 0 || !s.kv_events.zmq_endpoint.empty()) {
    fmt::print("kv events {} subscribers, last seq {}, {} cut off (buffer {} events){}\n", s.kv_events.subscribers,
               s.kv_events.last_seq, s.kv_events.cut_off, s.kv_events.buffer_events,
               s.kv_events.zmq_endpoint.empty()
                   ? std::string()
                   : fmt::format("; zmq {}: {} batches, {} events, {} resyncs", s.kv_events.zmq_endpoint,
                                 s.kv_events.zmq_batches, s.kv_events.zmq_events, s.kv_events.zmq_resyncs));
  }
  if (s.cluster) {
    const auto& c = *s.cluster;
    const auto n = [&c](const char* name) { return c.counters.contains(name) ? c.counters.at(name) : 0; };
    fmt::print("cluster   {}: node {} epoch {} at {}; {} members; {} published ({} queued, {} failures, {} rejoins)\n",
               c.state, c.node_id, c.epoch, c.endpoint, c.members.size(), n("published_keys"), n("publish_queue"),
               n("publish_failures"), n("rejoins"));
    for (const auto& m : c.members) {
      fmt::print("  member {} epoch {} at {}{}\n", m.node_id, m.epoch, m.endpoint, m.self ? " (this node)" : "");
    }
    fmt::print("  prefetches {}: pulls ok {}, pulls failed {}, pulled {} blocks ({} bytes), verify failures {}, {} in "
               "flight; hybrid entries pulled {} ({} bytes)\n",
               n("prefetches"), n("pulls_ok"), n("pulls_failed"), n("pulled_blocks"), n("pulled_bytes"),
               n("verify_failures"), n("pulls_in_flight"), n("pulled_entries"), n("pulled_entry_bytes"));
    fmt::print("  served: {} lookups, {} blocks offered; peer reads {} ok, {} failed, {} deadlines; connections {} "
               "accepted, {} rejected, auth failures {}\n",
               n("lookups_served"), n("blocks_offered"), n("peer_reads_ok"), n("peer_reads_failed"),
               n("peer_read_deadlines"), n("connections_accepted"), n("connections_rejected"), n("auth_failures"));
    fmt::print("  refused: {} peer requests; dropped {} replies that answered no request of ours; ignored {} "
               "unsigned store values\n",
               n("requests_refused"), n("replies_dropped"), n("directory_unauthenticated"));
    fmt::print("  transports: {}\n", c.transports.empty() ? std::string("(no connection yet)") : fmt::format("{}", fmt::join(c.transports, "; ")));
    fmt::print("  rdma devices: {}\n", c.rdma_devices.empty() ? std::string("none") : fmt::format("{}", fmt::join(c.rdma_devices, "; ")));
    if (!c.last_error.empty()) fmt::print("  last error: {}\n", c.last_error);
  }
}

int Refused(const Status& s) {
  std::fprintf(stderr, "flexkvctl: %s\n", s.ToString().c_str());
  return kExitRefused;
}

// `flexkvctl events`: one line per event (JSON lines with --json), a line per snapshot end and per daemon restart.
int RunEvents(const flexkv::ConnectOptions& connect, const KvSubscribeOptions& options, uint64_t count, bool json) {
  auto sub = KvEventSubscription::Open(connect, options);
  if (!sub.ok()) return Refused(sub.status());
  uint64_t printed = 0;
  uint64_t instance = 0;
  for (;;) {
    auto batch = (*sub)->Next();
    if (!batch.ok()) return Refused(batch.status());
    if (batch->instance_id != instance) {
      instance = batch->instance_id;
      if (json) {
        fmt::print("{}\n", Dump(Json{{"instance_id", fmt::format("{:016x}", instance)},
                                    {"started_unix_ms", batch->started_unix_ms}}, -1));
      } else {
        fmt::print("# daemon instance {:016x}\n", instance);
      }
    }
    for (const KvBlockEvent& e : batch->events) {
      const char* kind = e.kind == KvBlockEvent::Kind::kStored ? "stored" : e.kind == KvBlockEvent::Kind::kRemoved ? "removed" : "cleared";
      const char* tier = e.tier == KvBlockEvent::Tier::kSsd ? "ssd" : "dram";
      if (json) {
        Json j{{"seq", e.seq}, {"snapshot", batch->snapshot}, {"kind", kind}, {"tier", tier},
               {"key", e.key.ToHex()}, {"namespace", e.model_namespace}, {"cause", e.cause}};
        if (e.kind == KvBlockEvent::Kind::kStored) j["parent"] = e.parent.ToHex();
        fmt::print("{}\n", Dump(j, -1));
      } else {
        fmt::print("{:>10} {:<7} {:<4} {} parent {} ns {} ({})\n", batch->snapshot ? std::string("snapshot") : std::to_string(e.seq),
                   kind, tier, e.key.ToHex(), e.kind == KvBlockEvent::Kind::kStored ? e.parent.ToHex() : std::string("-"),
                   e.model_namespace, e.cause);
      }
      if (count != 0 && ++printed >= count) return kExitOk;
    }
    if (batch->snapshot_end) {
      if (json) {
        fmt::print("{}\n", Dump(Json{{"snapshot_end", true}, {"snapshot_seq", batch->snapshot_seq}}, -1));
      } else {
        fmt::print("# snapshot complete at seq {}\n", batch->snapshot_seq);
      }
    }
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexkvctl: inspect and drain a flexkvd", "flexkvctl"};
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
      "drop-domain",
      "Drop one cache domain and its pool (its blocks are lost; other domains are untouched) so its budget is free");
  std::string drop_namespace;
  double drop_idle_s = 0;
  drop_cmd->add_option("namespace", drop_namespace, "The domain's model namespace (may be left out when there is one)");
  drop_cmd->add_option("--idle", drop_idle_s,
                       "Refuse unless the domain has had no session for at least this many seconds (default 0)")
      ->check(CLI::Range(0.0, 365.0 * 86400));
  auto* scrub_cmd = app.add_subcommand(
      "scrub", "Check every cached block against its checksum while serving; drop and count the ones that fail");
  double scrub_rate_mib = 0;
  double scrub_timeout_s = 86400;
  scrub_cmd->add_option("--rate", scrub_rate_mib, "Read at most this many MiB per second (default 0: no limit)")
      ->check(CLI::Range(0.0, 1e9));
  scrub_cmd->add_option("--timeout", scrub_timeout_s, "Seconds to wait for the scrub (default 86400)")
      ->check(CLI::Range(1.0, 31.0 * 86400));
  std::string scrub_namespace;
  scrub_cmd->add_option("--namespace", scrub_namespace, "Only this domain's pool (default: every domain's)");
  auto* top_cmd = app.add_subcommand(
      "top", "Live view: hit ratio, GB/s per direction, pool and tier fill, sessions, queues (q or Ctrl-C quits)");
  flexkvctl::TopOptions top_options;
  bool top_once = false;
  top_cmd->add_option("--interval", top_options.interval_s, "Seconds between refreshes (default 1)")
      ->check(CLI::Range(0.1, 3600.0));
  top_cmd->add_option("--iterations", top_options.iterations, "Print this many frames, then exit (default: until q)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 40));
  top_cmd->add_flag("--once", top_once, "One frame (rates over one interval), then exit: --iterations 1");
  top_cmd->add_option("--socket", socket, "Control socket");
  auto* events_cmd = app.add_subcommand(
      "events", "KV events, one per line: a snapshot of every block per tier, then each block stored or removed");
  bool events_no_snapshot = false;
  uint64_t events_count = 0;
  events_cmd->add_flag("--no-snapshot", events_no_snapshot, "Only what happens from now on");
  events_cmd->add_option("--count", events_count, "Exit after this many events (default: until the stream ends)");
  auto* completion_cmd = app.add_subcommand("completion", "Print a shell completion script (bash or zsh)");
  std::string completion_shell;
  const flexkvctl::PositionalChoices completion_choices = {{"completion", {"bash", "zsh"}}};
  completion_cmd->add_option("shell", completion_shell, "bash or zsh")
      ->required()
      ->check(CLI::IsMember(completion_choices.at("completion")));
  for (auto* sub : {status_cmd, sessions_cmd, metrics_cmd, drain_cmd, resume_cmd, health_cmd, scrub_cmd,
                    drop_cmd, events_cmd}) {
    sub->add_flag("--json", json, "Machine-readable output");
    sub->add_option("--socket", socket, "Control socket");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  if (completion_cmd->parsed()) {
    fmt::print("{}", completion_shell == "zsh" ? flexkvctl::ZshCompletion(app, completion_choices)
                                               : flexkvctl::BashCompletion(app, completion_choices));
    return kExitOk;
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

  if (events_cmd->parsed()) {
    KvSubscribeOptions sub_options;
    sub_options.skip_snapshot = events_no_snapshot;
    return RunEvents(options, sub_options, events_count, json);
  }
  if (top_cmd->parsed()) {
    if (top_once) top_options.iterations = 1;
    return flexkvctl::RunTop(c, top_options);
  }

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
    auto dropped = c.DropDomain(drop_namespace, static_cast<uint64_t>(std::ceil(drop_idle_s)));
    if (!dropped.ok()) return Refused(dropped.status());
    fmt::print("{}\n", json ? Dump(Json{{"dropped_blocks", *dropped}}, -1) : fmt::format("dropped {} blocks", *dropped));
    return kExitOk;
  }
  if (scrub_cmd->parsed()) {
    const auto rate = static_cast<uint64_t>(scrub_rate_mib * 1024 * 1024);
    auto r = c.Scrub(rate, std::chrono::milliseconds(static_cast<int64_t>(scrub_timeout_s * 1000)), scrub_namespace);
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

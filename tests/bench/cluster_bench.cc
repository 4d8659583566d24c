// flexkv-bench cluster [--block-kib 256] [--prompts 48] [--blocks-per-prompt 32] [--inflight 4] [--lanes N]
//                      [--nodes 4] [--node-blocks 4096] [--trace PATH] [--json]
// The cluster tier (issue 16, docs/cluster.md) between real daemons, as tests/integration/cluster_tier_test.cc
// sets them up: a "hub" network namespace with a bridge and a real etcd (data on tmpfs), two node namespaces A and
// B joined to the bridge by veth pairs, flexkvd A and B (UCX tcp across the veths). Root only (namespaces).
//   pull        this process attaches to A's and B's unix sockets (they work across namespaces), stores --prompts
//               prompts of --blocks-per-prompt blocks on A, waits until A published them, then prefetches each
//               prompt on B, --inflight at once (B's --cluster-max-session-pulls is raised to it; --lanes is both
//               daemons' --cluster-lanes, unset: their default): per-prefetch
//               latency (p50/p99) and pulled bytes/s (all pulled bytes / first submit to last completion). Every
//               block is then loaded on B and compared byte for byte (not timed): a wrong byte is a FAIL, a
//               prefetch that did not pull its whole prompt INCOMPLETE (both exit 1, with the daemons' log tails).
//               The daemons' warnings (count, first line) are reported: refused or lost gets show there.
//   baseline    ucx_perftest between the same two namespaces over the same veths (UCX_TLS=tcp,
//               UCX_NET_DEVICES=<veth>), message = one block, iterations = the blocks pulled (the same bytes),
//               3 rounds each (a fresh server per round), the median with its range:
//               ucp_am_bw (the daemon's tcp path is an active-message request/reply: the honest baseline), and
//               ucp_get for reference (over tcp UCX emulates it with messages too).
//   directory   a child of this executable in B's namespace (hidden subcommand cluster-dir-worker) joins the hub's
//               etcd twice (a publisher and a reader, as two daemons), publishes entries in batches of 128 (one
//               Txn each, what a daemon's publisher sends) and times Lookup of 64 keys (one Txn, what a Prefetch
//               sends): entries/s published, lookup p50/p99.
//   trace       a simulation (no daemon): the trace's requests sent round-robin to --nodes nodes, each an LRU of
//               --node-blocks blocks (prefix hits), without peer reuse (a node hits only its own cache) and with it
//               (after the local prefix, the longest run of following blocks that one other node holds counts as
//               cluster hits: pulled, then cached locally).
// Everything created (namespaces, veths, bridge, etcd data, daemon directories) is removed at the end.
#include "cluster_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bench_json.h"
#include "bench_process.h"
#include "daemon/cluster/etcd/etcd_directory.h"
#include "flexkv/client.h"
#include "tests/support/spawn.h"
#include "trace_replay.h"

namespace {

using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Percentiles;
using flexkv::bench::Rounded;
using flexkv::bench::Summarize;
using flexkv::bench::Whole;
using std::chrono::milliseconds;

const char* const kIp = "/usr/sbin/ip";
const char* const kEtcd = "/usr/bin/etcd";
const char* const kEtcdctl = "/usr/bin/etcdctl";
const char* const kPerftest = "/usr/bin/ucx_perftest";
constexpr const char* kNamespace = "flexkv-bench-cluster";
constexpr uint32_t kClusterTokensPerBlock = 16;
constexpr int kPerftestRounds = 3;  // ucx_perftest varies by 2-4x between runs on a shared 2-core VM: the median

using flexkv::NowNs;

struct ClusterBenchOptions {
  uint32_t block_kib = 256;
  uint32_t prompts = 48;
  uint32_t blocks_per_prompt = 32;
  uint32_t inflight = 4;
  uint32_t lanes = 0;  // 0: the daemons' default --cluster-lanes
  uint32_t nodes = 4;
  uint32_t node_blocks = 4096;
  uint32_t dir_entries = 128 * 40;
  uint32_t dir_lookups = 300;
  std::string trace = "../shared/traces/synthetic_trace.jsonl";
  bool json = false;
};

// ---------------------------------------------------------------------------------------------------------------
// Processes

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// Runs argv (argv[0] a path) to completion with stdout+stderr captured; killed after `timeout`.
CommandResult RunTool(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                  milliseconds timeout = milliseconds(30000)) {
  CommandResult r;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return r;
  auto pid = flexkv::testing::SpawnChild(argv, {{1, p[1], "", 0}, {2, p[1], "", 0}}, env);
  close(p[1]);
  if (!pid.ok()) {
    close(p[0]);
    r.output = pid.status().ToString();
    return r;
  }
  const int64_t deadline = NowNs() + timeout.count() * 1000000;
  char buf[4096];
  bool killed = false;
  for (;;) {
    pollfd pfd{p[0], POLLIN, 0};
    const int64_t left_ms = (deadline - NowNs()) / 1000000;
    if (left_ms <= 0 && !killed) {
      kill(*pid, SIGKILL);
      killed = true;
    }
    if (poll(&pfd, 1, static_cast<int>(std::max<int64_t>(left_ms, 100))) <= 0) continue;
    const ssize_t n = read(p[0], buf, sizeof(buf));
    if (n <= 0) break;
    r.output.append(buf, static_cast<size_t>(n));
  }
  close(p[0]);
  int status = 0;
  waitpid(*pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return r;
}

// SIGINT/SIGTERM: the live Background children (etcd, the daemons, a ucx_perftest server) get SIGTERM, and the
// handler says how to remove the namespaces (tearing them down is not async-signal-safe).
constexpr int kMaxChildren = 16;
volatile sig_atomic_t g_children[kMaxChildren] = {};
char g_cleanup_hint[1024] = "";

extern "C" void OnSignal(int sig) {
  for (int i = 0; i < kMaxChildren; ++i) {
    if (g_children[i] > 0) kill(static_cast<pid_t>(g_children[i]), SIGTERM);
  }
  (void)!write(2, g_cleanup_hint, strlen(g_cleanup_hint));
  _exit(128 + sig);
}

// Appends " <what>;" to the interrupt hint (before its final newline).
void AddToHint(const std::string& what) {
  std::string h = g_cleanup_hint;
  if (!h.empty() && h.back() == '\n') h.pop_back();
  h += " " + what + ";\n";
  std::snprintf(g_cleanup_hint, sizeof(g_cleanup_hint), "%s", h.c_str());
}

void TrackChild(pid_t pid, bool add) {
  for (int i = 0; i < kMaxChildren; ++i) {
    if (add ? g_children[i] == 0 : g_children[i] == pid) {
      g_children[i] = add ? pid : 0;
      return;
    }
  }
}

// A long-lived child with stdout and stderr in `log`; SIGTERM (then SIGKILL after 10 s) on destruction.
class Background {
 public:
  static std::unique_ptr<Background> Start(const std::vector<std::string>& argv, const std::string& log,
                                           const std::vector<std::string>& env = {}) {
    auto pid = flexkv::testing::SpawnChild(
        argv, {{1, -1, log, O_WRONLY | O_CREAT | O_TRUNC}, {2, 1, "", 0}}, env);
    if (!pid.ok()) {
      std::fprintf(stderr, "flexkv-bench: cannot start %s: %s\n", argv[0].c_str(), pid.status().ToString().c_str());
      return nullptr;
    }
    auto b = std::unique_ptr<Background>(new Background());
    b->pid_ = *pid;
    b->log_ = log;
    TrackChild(*pid, true);
    return b;
  }
  ~Background() { Stop(); }
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    const int64_t deadline = NowNs() + 10LL * 1000000000;
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (NowNs() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    TrackChild(pid_, false);
    pid_ = -1;
  }
  bool Alive() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  // Lines of the log holding `needle`, and the first of them.
  std::pair<uint64_t, std::string> Grep(const std::string& needle) const {
    std::ifstream in(log_);
    std::string line, first;
    uint64_t count = 0;
    while (std::getline(in, line)) {
      if (line.find(needle) == std::string::npos) continue;
      if (count++ == 0) first = line;
    }
    return {count, first};
  }
  std::string Tail(size_t bytes = 3000) const {
    std::ifstream in(log_);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.size() > bytes) text.erase(0, text.size() - bytes);
    return text;
  }

 private:
  Background() = default;
  pid_t pid_ = -1;
  std::string log_;
};

// ---------------------------------------------------------------------------------------------------------------
// The network: a hub namespace (bridge br0 .1, etcd) and one namespace per node (.2, .3), joined by veth pairs.

class Net {
 public:
  struct Node {
    std::string ns, in_if, out_if, ip;
  };

  static std::unique_ptr<Net> Create(int nodes, std::string* why) {
    auto n = std::unique_ptr<Net>(new Net());
    const std::string tag = std::to_string(getpid() % 100000);
    n->subnet_ = "10.234." + std::to_string(getpid() % 200 + 20) + ".";
    n->hub_ = "fkvbh" + tag;
    std::vector<std::vector<std::string>> cmds = {{kIp, "netns", "add", n->hub_}};
    n->namespaces_.push_back(n->hub_);
    cmds.push_back({kIp, "-n", n->hub_, "link", "set", "lo", "up"});
    cmds.push_back({kIp, "-n", n->hub_, "link", "add", "br0", "type", "bridge"});
    cmds.push_back({kIp, "-n", n->hub_, "addr", "add", n->subnet_ + "1/24", "dev", "br0"});
    cmds.push_back({kIp, "-n", n->hub_, "link", "set", "br0", "up"});
    for (int i = 0; i < nodes; ++i) {
      const std::string ns = "fkvb" + std::to_string(i) + "n" + tag;
      Node node{ns, "fkvb" + std::to_string(i) + "i" + tag, "fkvb" + std::to_string(i) + "o" + tag,
                n->subnet_ + std::to_string(i + 2)};
      n->nodes_.push_back(node);
      n->namespaces_.push_back(ns);
      cmds.push_back({kIp, "netns", "add", ns});
      cmds.push_back({kIp, "-n", n->hub_, "link", "add", node.out_if, "type", "veth", "peer", "name", node.in_if,
                      "netns", ns});
      cmds.push_back({kIp, "-n", n->hub_, "link", "set", node.out_if, "master", "br0"});
      cmds.push_back({kIp, "-n", n->hub_, "link", "set", node.out_if, "up"});
      cmds.push_back({kIp, "-n", ns, "addr", "add", node.ip + "/24", "dev", node.in_if});
      cmds.push_back({kIp, "-n", ns, "link", "set", node.in_if, "up"});
      cmds.push_back({kIp, "-n", ns, "link", "set", "lo", "up"});
    }
    std::string hint = "\nflexkv-bench: interrupted; remove what it made with:";
    for (const auto& ns : n->namespaces_) hint += " ip netns del " + ns + ";";
    hint += "\n";
    std::snprintf(g_cleanup_hint, sizeof(g_cleanup_hint), "%s", hint.c_str());
    for (const auto& cmd : cmds) {
      if (auto r = RunTool(cmd); r.exit_code != 0) {
        std::string line;
        for (const auto& a : cmd) line += a + " ";
        *why = line + ": " + r.output;
        return nullptr;
      }
    }
    return n;
  }
  ~Net() {
    for (const std::string& ns : namespaces_) {
      auto pids = RunTool({kIp, "netns", "pids", ns});
      size_t pos = 0;
      while (pos < pids.output.size()) {
        size_t end = pids.output.find('\n', pos);
        if (end == std::string::npos) end = pids.output.size();
        const std::string p = pids.output.substr(pos, end - pos);
        if (!p.empty() && p.find_first_not_of("0123456789") == std::string::npos) kill(std::stoi(p), SIGKILL);
        pos = end + 1;
      }
    }
    for (const std::string& ns : namespaces_) (void)RunTool({kIp, "netns", "del", ns});
  }
  const Node& node(int i) const { return nodes_[static_cast<size_t>(i)]; }
  const std::string& hub() const { return hub_; }
  std::string etcd_endpoint() const { return subnet_ + "1:2379"; }
  std::vector<std::string> In(const std::string& ns, std::vector<std::string> argv) const {
    std::vector<std::string> out = {kIp, "netns", "exec", ns};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

 private:
  Net() = default;
  std::string subnet_, hub_;
  std::vector<Node> nodes_;
  std::vector<std::string> namespaces_;
};

// A private directory (mode 0755) removed on destruction.
struct TempDir {
  std::string path;
  // `hint`: named in the interrupt hint (the ones that live for the whole run).
  explicit TempDir(const std::string& tmpl, bool hint = true) {
    std::string t = tmpl;
    if (mkdtemp(t.data()) != nullptr) {
      path = t;
      chmod(path.c_str(), 0755);
      if (hint) AddToHint("rm -rf " + path);
    }
  }
  ~TempDir() {
    if (path.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Data: prompt p's tokens and block contents are a pure function of its seed.

uint64_t Seed(uint32_t prompt) { return 7000 + prompt; }

std::vector<flexkv::BlockKey> PromptKeys(uint64_t seed, uint32_t blocks) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(uint64_t{blocks} * kClusterTokensPerBlock);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 128000);
  return flexkv::ComputeBlockKeys(kNamespace, t, kClusterTokensPerBlock);
}

void FillBlock(uint64_t seed, uint32_t i, uint8_t* dst, uint64_t bytes) {
  std::mt19937_64 rng(seed * 1000003 + i);
  for (uint64_t off = 0; off < bytes; off += 8) {
    const uint64_t v = rng();
    std::memcpy(dst + off, &v, std::min<uint64_t>(8, bytes - off));
  }
}

// 16 tokens, K/V, head_dim 128, bf16: 8 KiB per head and layer. 8 heads and block_kib/64 layers when that divides
// (256 KiB: 4 layers of 8 heads), else 1 layer of block_kib/8 heads.
std::optional<flexkv::Geometry> BenchGeometry(uint32_t block_kib) {
  if (block_kib == 0 || block_kib % 8 != 0) return std::nullopt;
  flexkv::Geometry g;
  g.tokens_per_block = kClusterTokensPerBlock;
  g.kv_planes = 2;
  g.head_dim = 128;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  if (block_kib % 64 == 0) {
    g.kv_heads_per_rank = 8;
    g.num_layers = block_kib / 64;
  } else {
    g.kv_heads_per_rank = block_kib / 8;
    g.num_layers = 1;
  }
  return g;
}

std::unique_ptr<flexkv::Client> Attach(const std::string& socket, const flexkv::Geometry& g, const char* name,
                                       std::string* why) {
  auto c = flexkv::Client::Connect({socket, milliseconds(20000), milliseconds(30000)});
  if (!c.ok()) {
    *why = c.status().ToString();
    return nullptr;
  }
  flexkv::AttachOptions o;
  o.client_name = name;
  o.model_namespace = kNamespace;
  o.geometry = g;
  auto s = (*c)->Attach(o);
  if (!s.ok()) {
    *why = s.status().ToString();
    return nullptr;
  }
  return std::move(*c);
}

uint64_t Counter(const flexkv::DaemonStatus::Cluster& c, const char* name) {
  auto it = c.counters.find(name);
  return it == c.counters.end() ? 0 : it->second;
}

// Waits until `pred(cluster status)` holds on the daemon behind `c`.
template <typename Pred>
bool WaitCluster(flexkv::Client& c, milliseconds timeout, Pred pred) {
  const int64_t deadline = NowNs() + timeout.count() * 1000000;
  while (NowNs() < deadline) {
    auto s = c.GetStatus();
    if (s.ok() && s->cluster && pred(*s->cluster)) return true;
    std::this_thread::sleep_for(milliseconds(100));
  }
  return false;
}

// ---------------------------------------------------------------------------------------------------------------
// ucx_perftest between two namespaces

struct PerftestResult {
  std::string test;
  bool ok = false;
  double bytes_per_s = 0;  // overall bandwidth (ucx_perftest's MB/s are MiB/s: × 2^20); the median of the rounds
  double min_bytes_per_s = 0, max_bytes_per_s = 0;
  int rounds = 0;
  std::string error;
};

PerftestResult Perftest(const Net& net, const std::string& test, uint64_t msg_bytes, uint64_t iterations, int port) {
  PerftestResult r;
  r.test = test;
  TempDir dir("/tmp/flexkv-bench-perftest-XXXXXX", /*hint=*/false);
  const Net::Node& a = net.node(0);
  const Net::Node& b = net.node(1);
  auto server = Background::Start(net.In(a.ns, {kPerftest, "-p", std::to_string(port)}), dir.path + "/server.log",
                                  {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + a.in_if});
  if (!server) {
    r.error = "cannot start the server";
    return r;
  }
  const uint64_t warmup = std::max<uint64_t>(16, iterations / 20);
  CommandResult c;
  for (int attempt = 0; attempt < 20; ++attempt) {
    std::this_thread::sleep_for(milliseconds(200));
    c = RunTool(net.In(b.ns, {kPerftest, a.ip, "-p", std::to_string(port), "-t", test, "-s", std::to_string(msg_bytes),
                          "-n", std::to_string(iterations), "-w", std::to_string(warmup), "-f"}),
            {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + b.in_if}, milliseconds(120000));
    if (c.exit_code == 0 || c.output.find("Connection refused") == std::string::npos) break;
  }
  server->Stop();
  if (c.exit_code != 0) {
    r.error = fmt::format("exit {}: {}", c.exit_code, c.output.substr(c.output.size() > 600 ? c.output.size() - 600 : 0));
    return r;
  }
  // The result line: "<iterations> <p50> <avg> <overall> <bw avg> <bw overall> <rate avg> <rate overall>".
  size_t pos = 0;
  while (pos < c.output.size()) {
    size_t end = c.output.find('\n', pos);
    if (end == std::string::npos) end = c.output.size();
    std::vector<double> f;
    const std::string line = c.output.substr(pos, end - pos);
    const char* p = line.c_str();
    char* q = nullptr;
    for (;;) {
      while (*p == ' ' || *p == '\t') ++p;
      if (*p == '\0') break;
      const double v = std::strtod(p, &q);
      if (q == p) {
        f.clear();
        break;
      }
      f.push_back(v);
      p = q;
    }
    if (f.size() >= 8 && f[0] == static_cast<double>(iterations)) {
      r.ok = true;
      r.bytes_per_s = f[5] * 1024.0 * 1024.0;
    }
    pos = end + 1;
  }
  if (!r.ok) r.error = "no result line in: " + c.output.substr(0, 600);
  return r;
}

// `rounds` runs of Perftest (a fresh server each, ports port, port + 1, ...): the median, with the min and max.
PerftestResult PerftestMedian(const Net& net, const std::string& test, uint64_t msg_bytes, uint64_t iterations, int port,
                              int rounds) {
  std::vector<double> bw;
  PerftestResult last;
  for (int i = 0; i < rounds; ++i) {
    last = Perftest(net, test, msg_bytes, iterations, port + i);
    if (!last.ok) return last;
    bw.push_back(last.bytes_per_s);
  }
  std::sort(bw.begin(), bw.end());
  last.bytes_per_s = bw[bw.size() / 2];
  last.min_bytes_per_s = bw.front();
  last.max_bytes_per_s = bw.back();
  last.rounds = rounds;
  return last;
}

// ---------------------------------------------------------------------------------------------------------------
// Trace simulation

class Lru {
 public:
  explicit Lru(uint64_t capacity) : capacity_(capacity) {}
  bool Has(uint64_t id) const { return where_.count(id) != 0; }
  // Prefix hits of `ids` (read before any insert), then every id used/inserted in order (the node stores what it
  // computed or pulled).
  uint64_t Access(const std::vector<uint64_t>& ids) {
    uint64_t prefix = 0;
    while (prefix < ids.size() && Has(ids[prefix])) ++prefix;
    for (uint64_t id : ids) {
      auto it = where_.find(id);
      if (it != where_.end()) {
        order_.splice(order_.end(), order_, it->second);
        continue;
      }
      if (capacity_ == 0) continue;
      if (where_.size() >= capacity_) {
        where_.erase(order_.front());
        order_.pop_front();
      }
      order_.push_back(id);
      where_.emplace(id, std::prev(order_.end()));
    }
    return prefix;
  }

 private:
  uint64_t capacity_;
  std::list<uint64_t> order_;
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where_;
};

struct TraceSim {
  uint64_t requests = 0, blocks = 0, local_only_hits = 0, peer_local_hits = 0, peer_cluster_hits = 0;
  uint64_t one_big_hits = 0, infinite_hits = 0;
};

TraceSim SimulateTrace(const std::vector<flexkv::bench::TraceRequest>& trace, uint32_t nodes, uint64_t node_blocks) {
  TraceSim s;
  std::vector<Lru> alone(nodes, Lru(node_blocks)), peers(nodes, Lru(node_blocks));
  Lru big(node_blocks * nodes);
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto& ids = trace[i].hash_ids;
    const size_t n = i % nodes;
    ++s.requests;
    s.blocks += ids.size();
    s.local_only_hits += alone[n].Access(ids);
    s.one_big_hits += big.Access(ids);
    // With peer reuse: the local prefix, then the longest run after it that one other node holds.
    size_t local = 0;
    while (local < ids.size() && peers[n].Has(ids[local])) ++local;
    size_t best = 0;
    for (size_t m = 0; m < nodes; ++m) {
      if (m == n) continue;
      size_t run = 0;
      while (local + run < ids.size() && peers[m].Has(ids[local + run])) ++run;
      best = std::max(best, run);
    }
    s.peer_local_hits += local;
    s.peer_cluster_hits += best;
    peers[n].Access(ids);
  }
  s.infinite_hits = flexkv::bench::InfiniteCacheBound(trace).hits;
  return s;
}

double Ratio(uint64_t a, uint64_t b) { return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b); }

// ---------------------------------------------------------------------------------------------------------------
// The pull measurement

struct PullResult {
  Percentiles latency;
  double seconds = 0;
  uint64_t pulled_blocks = 0, pulled_bytes = 0;
  uint64_t short_prefetches = 0;  // not everything pulled, or an error
  std::string first_problem;
  uint64_t verified_blocks = 0, wrong_blocks = 0, missing_blocks = 0;
  double bench_cpu_s = 0;  // this process's CPU (user + system, all threads) during the timed pull
};

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// cluster-dir-worker: in a node's namespace, against the hub's etcd. Prints
//   DIR <entries> <publish_ns> <lookup_failures> <n> <lookup ns>...      or      ERROR <text>

int RunClusterDirWorker(int argc, char** argv) {
  CLI::App app{"flexkv-bench cluster-dir-worker (internal)"};
  std::string etcd, ip;
  uint32_t entries = 128 * 40, lookups = 300;
  app.add_option("--etcd", etcd)->required();
  app.add_option("--ip", ip)->required();
  app.add_option("--entries", entries);
  app.add_option("--lookups", lookups);
  CLI11_PARSE(app, argc, argv);
  flexkv::log::SetLevel(flexkv::log::Level::kWarning);
  auto fail = [](const std::string& what, const flexkv::Status& s) {
    flexkv::bench::Emit(fmt::format("ERROR {}: {}\n", what, s.ToString()));
    return 1;
  };
  flexkv::cluster::EtcdOptions eo;
  eo.endpoints = {etcd};
  eo.prefix = "/flexkv-bench-dir/";
  eo.secret = "flexkv-bench-cluster-secret";  // values are signed (issue 29): the cost is part of what is measured
  auto pub = flexkv::cluster::ConnectEtcd(eo);
  if (!pub.ok()) return fail("ConnectEtcd", pub.status());
  auto look = flexkv::cluster::ConnectEtcd(eo);
  if (!look.ok()) return fail("ConnectEtcd", look.status());
  if (auto s = (*pub)->Join({"bench-dir-pub", 0, ip + ":1", ""}, milliseconds(10000)); !s.ok()) return fail("Join", s);
  if (auto s = (*look)->Join({"bench-dir-look", 0, ip + ":2", ""}, milliseconds(10000)); !s.ok()) return fail("Join", s);
  std::mt19937_64 rng(20261203);
  std::vector<int32_t> tokens(entries);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 128000);
  const auto keys = flexkv::ComputeBlockKeys(kNamespace, tokens, 1);
  std::vector<flexkv::cluster::DirectoryEntry> batch;
  const int64_t t0 = NowNs();
  for (size_t i = 0; i < keys.size(); i += 128) {
    batch.clear();
    for (size_t j = i; j < std::min(keys.size(), i + 128); ++j) batch.push_back({keys[j], kNamespace, 16});
    if (auto s = (*pub)->Publish(batch); !s.ok()) return fail("Publish", s);
  }
  const int64_t publish_ns = NowNs() - t0;
  std::vector<int64_t> samples;
  uint64_t misses = 0;
  for (uint32_t l = 0; l < lookups; ++l) {
    const size_t start = (uint64_t{l} * 64) % std::max<size_t>(1, keys.size() - std::min<size_t>(keys.size(), 64) + 1);
    const size_t n = std::min<size_t>(64, keys.size() - start);
    const int64_t a = NowNs();
    auto r = (*look)->Lookup(kNamespace, std::span(keys).subspan(start, n));
    const int64_t b = NowNs();
    if (!r.ok()) return fail("Lookup", r.status());
    for (const auto& owners : *r) {
      if (owners.empty() || owners[0].node_id != "bench-dir-pub") ++misses;
    }
    samples.push_back(b - a);
  }
  (void)(*pub)->Leave();
  (void)(*look)->Leave();
  flexkv::bench::Emit(fmt::format("DIR {} {} {} ", entries, publish_ns, misses) +
                      flexkv::bench::SampleLine("", samples).substr(1));
  return 0;
}

namespace {

int Fail(const char* what) {
  std::fprintf(stderr, "flexkv-bench cluster: %s\n", what);
  return 1;
}

}  // namespace

int RunClusterBench(int argc, char** argv) {
  ClusterBenchOptions o;
  CLI::App app{"flexkv-bench cluster: the cluster tier between two flexkvd in network namespaces (root)"};
  app.add_option("--block-kib", o.block_kib, "Block size in KiB (multiple of 8; default 256)")->check(CLI::Range(8u, 65536u));
  app.add_option("--prompts", o.prompts, "Prompts stored on A and prefetched on B (default 48)")->check(CLI::Range(1u, 100000u));
  app.add_option("--blocks-per-prompt", o.blocks_per_prompt, "Blocks per prompt (default 32)")->check(CLI::Range(1u, 4096u));
  app.add_option("--inflight", o.inflight, "Prefetches in flight on B (default 4)")->check(CLI::Range(1u, 256u));
  app.add_option("--lanes", o.lanes, "Both daemons' --cluster-lanes (default: theirs)")->check(CLI::Range(1u, 16u));
  app.add_option("--nodes", o.nodes, "Trace simulation: nodes behind the round-robin router (default 4)")
      ->check(CLI::Range(1u, 1024u));
  app.add_option("--node-blocks", o.node_blocks, "Trace simulation: LRU capacity of each node in blocks (default 4096)");
  app.add_option("--trace", o.trace, "Trace for the simulation (default ../shared/traces/synthetic_trace.jsonl; "
                                     "'' skips it)");
  app.add_option("--dir-entries", o.dir_entries, "Directory: entries published (default 5120)")->check(CLI::Range(64u, 10000000u));
  app.add_option("--dir-lookups", o.dir_lookups, "Directory: lookups of 64 keys timed (default 300)")->check(CLI::Range(1u, 10000000u));
  app.add_flag("--json", o.json, "One JSON object");
  CLI11_PARSE(app, argc, argv);

  if (geteuid() != 0) {
    std::fprintf(stderr, "flexkv-bench cluster: needs root (it creates network namespaces and veth pairs); "
                         "run it with sudo\n");
    return 2;
  }
  for (const char* tool : {kIp, kEtcd, kEtcdctl, kPerftest}) {
    if (access(tool, X_OK) != 0) {
      std::fprintf(stderr, "flexkv-bench cluster: %s not found (scripts/deps.sh installs it)\n", tool);
      return 2;
    }
  }
  auto geometry = BenchGeometry(o.block_kib);
  if (!geometry) return Fail("--block-kib must be a multiple of 8");
  const flexkv::Geometry g = *geometry;
  const uint64_t block_bytes = g.host_block_bytes();
  const uint32_t n = o.blocks_per_prompt;
  const uint64_t total_blocks = uint64_t{o.prompts} * n;
  const std::string self = flexkv::bench::SelfExe();
  const std::string bindir = std::filesystem::path(self).parent_path();

  // Trace first: no network needed, and a bad path fails fast.
  std::optional<std::vector<flexkv::bench::TraceRequest>> trace;
  if (!o.trace.empty()) {
    trace = flexkv::bench::LoadTrace(o.trace);
    if (!trace) return 2;
  }

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::string why;
  auto net = Net::Create(2, &why);
  if (!net) {
    std::fprintf(stderr, "flexkv-bench cluster: cannot build the network namespaces: %s\n", why.c_str());
    return 3;
  }
  TempDir etcd_dir("/dev/shm/flexkv-bench-etcd-XXXXXX");
  const std::string url = "http://" + net->etcd_endpoint();
  auto etcd = Background::Start(net->In(net->hub(), {kEtcd, "--name", "hub", "--data-dir", etcd_dir.path + "/data",
                                                    "--listen-client-urls", url, "--advertise-client-urls", url,
                                                    "--listen-peer-urls", "http://127.0.0.1:0"}),
                                etcd_dir.path + "/etcd.log");
  if (!etcd) return 3;
  {
    bool ready = false;
    const int64_t deadline = NowNs() + 30LL * 1000000000;
    while (!ready && NowNs() < deadline) {
      ready = RunTool(net->In(net->hub(), {"/usr/bin/env", "ETCDCTL_API=3", kEtcdctl, "--endpoints=" + net->etcd_endpoint(),
                                       "--dial-timeout=2s", "get", "/"}),
                  {}, milliseconds(10000))
                  .exit_code == 0;
      if (!ready) std::this_thread::sleep_for(milliseconds(100));
    }
    if (!ready) {
      std::fprintf(stderr, "flexkv-bench cluster: etcd did not answer in 30 s:\n%s\n", etcd->Tail().c_str());
      return 3;
    }
  }

  // The daemons: pools hold every prompt plus slack.
  const uint64_t pool_mib = (total_blocks * block_bytes >> 20) + 64 + (block_bytes >> 20) * 16;
  const uint32_t max_pulls = std::max<uint32_t>(8, o.inflight);
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::unique_ptr<Background>> daemons;
  std::vector<std::string> sockets;
  for (int i = 0; i < 2; ++i) {
    dirs.push_back(std::make_unique<TempDir>("/tmp/flexkv-bench-cluster-XXXXXX"));
    const std::string& d = dirs.back()->path;
    const std::string secret = d + "/cluster.secret";
    std::ofstream(secret) << "flexkv-bench cluster secret 0123456789\n";
    chmod(secret.c_str(), 0600);
    const Net::Node& node = net->node(i);
    sockets.push_back(d + "/flexkvd.sock");
    std::vector<std::string> daemon_argv = {
        bindir + "/flexkvd", "--socket", sockets.back(), "--pool-path", d + "/pool", "--pool-size",
        fmt::format("{}MiB", pool_mib), "--log-level", "warning", "--etcd-endpoints", net->etcd_endpoint(),
        "--cluster-secret-file", secret, "--cluster-listen", node.ip + ":7471", "--node-id",
        i == 0 ? "node-a" : "node-b", "--cluster-transports", "tcp", "--transfer-dev", node.in_if,
        "--cluster-lease-ttl", "10", "--cluster-pull-deadline", "5", "--cluster-max-pulls", std::to_string(max_pulls),
        "--cluster-max-session-pulls", std::to_string(o.inflight)};
    if (o.lanes != 0) {
      daemon_argv.push_back("--cluster-lanes");
      daemon_argv.push_back(std::to_string(o.lanes));
    }
    daemons.push_back(Background::Start(net->In(node.ns, std::move(daemon_argv)), d + "/flexkvd.log"));
    if (!daemons.back()) return 3;
  }
  auto dump_logs = [&] {
    for (size_t i = 0; i < daemons.size(); ++i) {
      std::fprintf(stderr, "flexkv-bench cluster: end of flexkvd %c's log:\n%s\n", i == 0 ? 'A' : 'B',
                   daemons[i]->Tail().c_str());
    }
  };
  auto a = Attach(sockets[0], g, "bench-engine-a", &why);
  auto b = a ? Attach(sockets[1], g, "bench-engine-b", &why) : nullptr;
  if (!a || !b) {
    std::fprintf(stderr, "flexkv-bench cluster: attach: %s\n", why.c_str());
    dump_logs();
    return 3;
  }
  auto two_members = [](const flexkv::DaemonStatus::Cluster& c) {
    return c.state == "joined" && c.members.size() == 2;
  };
  if (!WaitCluster(*a, milliseconds(30000), two_members) || !WaitCluster(*b, milliseconds(30000), two_members)) {
    dump_logs();
    return Fail("the two daemons did not see each other as members within 30 s");
  }

  // Store every prompt on A.
  std::vector<std::vector<flexkv::BlockKey>> keys(o.prompts);
  std::vector<uint32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = i;
  {
    auto kv = a->CreateHostKv(flexkv::KvLayout::kBlockFirst, n);
    if (!kv.ok()) return Fail(("CreateHostKv on A: " + kv.status().ToString()).c_str());
    for (uint32_t p = 0; p < o.prompts; ++p) {
      keys[p] = PromptKeys(Seed(p), n);
      for (uint32_t i = 0; i < n; ++i) FillBlock(Seed(p), i, kv->data + uint64_t{i} * block_bytes, block_bytes);
      auto t = a->Store(flexkv::BlockKeyChain(keys[p]), ids);
      auto r = t.ok() ? a->Wait(*t, milliseconds(30000)) : flexkv::Result<flexkv::OpResult>(t.status());
      if (!r.ok() || !r->status.ok() || r->done_blocks != n) {
        std::fprintf(stderr, "flexkv-bench cluster: store of prompt %u on A: %s\n", p,
                     !r.ok() ? r.status().ToString().c_str()
                             : fmt::format("{} ({} of {} blocks)", r->status.ToString(), r->done_blocks, n).c_str());
        dump_logs();
        return 1;
      }
    }
  }
  // Every prompt's last key is published (and one key in chunk_blocks): wait until A's publisher is done.
  if (!WaitCluster(*a, milliseconds(60000), [&](const flexkv::DaemonStatus::Cluster& c) {
        return Counter(c, "published_keys") >= o.prompts && Counter(c, "publish_queue") == 0;
      })) {
    dump_logs();
    return Fail("A did not publish its prompts within 60 s");
  }

  // Pull: --inflight threads, each prefetching the next prompt until none is left.
  PullResult pull;
  {
    std::atomic<uint32_t> next{0};
    std::mutex mu;
    std::vector<int64_t> samples;
    std::vector<std::thread> threads;
    const double cpu0 = CpuSeconds();
    const int64_t t0 = NowNs();
    for (uint32_t t = 0; t < std::min(o.inflight, o.prompts); ++t) {
      threads.emplace_back([&] {
        for (uint32_t p = next.fetch_add(1); p < o.prompts; p = next.fetch_add(1)) {
          const int64_t s0 = NowNs();
          auto tk = b->Prefetch(keys[p]);
          auto r = tk.ok() ? b->Wait(*tk, milliseconds(60000)) : flexkv::Result<flexkv::OpResult>(tk.status());
          const int64_t s1 = NowNs();
          std::lock_guard<std::mutex> l(mu);
          samples.push_back(s1 - s0);
          if (r.ok() && r->status.ok()) {
            pull.pulled_blocks += r->done_blocks;
            pull.pulled_bytes += r->bytes;
          }
          if (!r.ok() || !r->status.ok() || r->done_blocks != n || r->matched_blocks != 0) {
            ++pull.short_prefetches;
            if (pull.first_problem.empty()) {
              pull.first_problem =
                  !r.ok() ? r.status().ToString()
                          : fmt::format("prompt {}: {} local, {} pulled of {} ({}; source '{}')", p, r->matched_blocks,
                                        r->done_blocks, n, r->status.ToString(), r->source);
            }
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    pull.seconds = static_cast<double>(NowNs() - t0) / 1e9;
    pull.bench_cpu_s = CpuSeconds() - cpu0;
    pull.latency = Summarize(std::move(samples));
  }
  // Verify on B, untimed: every block of every prompt loaded and compared with what A stored.
  {
    auto kv = b->CreateHostKv(flexkv::KvLayout::kBlockFirst, n);
    if (!kv.ok()) return Fail(("CreateHostKv on B: " + kv.status().ToString()).c_str());
    std::vector<uint8_t> expect(block_bytes);
    for (uint32_t p = 0; p < o.prompts; ++p) {
      auto mt = b->Match(keys[p], /*pin=*/true);
      auto m = mt.ok() ? b->Wait(*mt, milliseconds(30000)) : flexkv::Result<flexkv::OpResult>(mt.status());
      if (!m.ok() || !m->status.ok()) {
        pull.missing_blocks += n;
        continue;
      }
      const uint32_t hits = m->matched_blocks;
      pull.missing_blocks += n - hits;
      if (hits == 0) continue;
      std::memset(kv->data, 0xA5, uint64_t{hits} * block_bytes);
      auto lt = b->Load(m->match_handle, std::span(ids.data(), hits));
      auto l = lt.ok() ? b->Wait(*lt, milliseconds(30000)) : flexkv::Result<flexkv::OpResult>(lt.status());
      (void)b->Release(m->match_handle);
      if (!l.ok() || !l->status.ok() || l->done_blocks != hits) {
        pull.missing_blocks += hits;
        continue;
      }
      for (uint32_t i = 0; i < hits; ++i) {
        FillBlock(Seed(p), i, expect.data(), block_bytes);
        ++pull.verified_blocks;
        if (std::memcmp(expect.data(), kv->data + uint64_t{i} * block_bytes, block_bytes) != 0) ++pull.wrong_blocks;
      }
    }
  }
  // The daemons' warnings during the run (a refused or failed get shows up there first).
  std::vector<std::pair<uint64_t, std::string>> warnings;
  for (const auto& d : daemons) warnings.push_back(d->Grep(" WARN "));
  std::map<std::string, uint64_t> counters_b;
  if (auto s = b->GetStatus(); s.ok() && s->cluster) counters_b = s->cluster->counters;
  std::string transports;
  if (auto s = b->GetStatus(); s.ok() && s->cluster) {
    for (const auto& t : s->cluster->transports) transports += (transports.empty() ? "" : "; ") + t;
  }

  // Baseline: ucx_perftest over the same veths, same message size and bytes.
  const int port = 14000 + getpid() % 1000;
  PerftestResult am = PerftestMedian(*net, "ucp_am_bw", block_bytes, total_blocks, port, kPerftestRounds);
  PerftestResult get = PerftestMedian(*net, "ucp_get", block_bytes, total_blocks, port + kPerftestRounds, kPerftestRounds);

  // Directory, from B's namespace.
  struct {
    bool ok = false;
    uint64_t entries = 0, misses = 0;
    double publish_per_s = 0;
    Percentiles lookup;
    std::string error;
  } dir;
  {
    auto w = flexkv::bench::Spawn(net->In(net->node(1).ns, {self, "cluster-dir-worker", "--etcd", net->etcd_endpoint(),
                                                            "--ip", net->node(1).ip, "--entries",
                                                            std::to_string(o.dir_entries), "--lookups",
                                                            std::to_string(o.dir_lookups)}),
                                  {});
    if (!w) {
      dir.error = "cannot start the worker";
    } else {
      while (auto line = w->ReadLine(milliseconds(120000))) {
        unsigned long long entries = 0, publish_ns = 0, misses = 0, count = 0;
        int used = 0;
        if (std::sscanf(line->c_str(), "DIR %llu %llu %llu %llu %n", &entries, &publish_ns, &misses, &count, &used) >= 4) {
          auto samples = flexkv::bench::ParseSamples(line->c_str() + used, count);
          dir.ok = samples.size() == count && publish_ns > 0;
          dir.entries = entries;
          dir.misses = misses;
          dir.publish_per_s = static_cast<double>(entries) / (static_cast<double>(publish_ns) / 1e9);
          dir.lookup = Summarize(std::move(samples));
        } else if (line->rfind("ERROR", 0) == 0) {
          dir.error = *line;
        }
      }
      const int st = w->Wait();
      if (!dir.ok && dir.error.empty()) dir.error = fmt::format("worker exit status {}", st);
    }
  }

  std::optional<TraceSim> sim;
  if (trace) sim = SimulateTrace(*trace, o.nodes, o.node_blocks);

  // Tear down before printing (the daemons' SIGTERM, etcd, namespaces).
  a.reset();
  b.reset();
  for (auto& d : daemons) d->Stop();
  etcd->Stop();
  net.reset();

  // FAIL: a block loaded on B differs from what A stored. INCOMPLETE: prefetches that did not pull everything
  // (their blocks are missing on B; the GB/s count only what was pulled).
  const bool bytes_ok = pull.wrong_blocks == 0;
  const bool complete = pull.missing_blocks == 0 && pull.short_prefetches == 0 && pull.verified_blocks == total_blocks;
  const double pull_bps = pull.seconds > 0 ? static_cast<double>(pull.pulled_bytes) / pull.seconds : 0;
  const double ratio_am = am.ok && am.bytes_per_s > 0 ? pull_bps / am.bytes_per_s : 0;
  const double ratio_get = get.ok && get.bytes_per_s > 0 ? pull_bps / get.bytes_per_s : 0;
  const std::string verdict = !bytes_ok ? "FAIL" : complete ? "PASS" : "INCOMPLETE";

  if (o.json) {
    auto perf = [](const PerftestResult& r) {
      return r.ok ? Json{{"test", r.test},
                         {"gb_per_s", Rounded(r.bytes_per_s / 1e9, 3)},
                         {"min_gb_per_s", Rounded(r.min_bytes_per_s / 1e9, 3)},
                         {"max_gb_per_s", Rounded(r.max_bytes_per_s / 1e9, 3)},
                         {"rounds", r.rounds}}
                  : Json{{"test", r.test}, {"error", r.error}};
    };
    Json report{{"bench", "cluster"},
                {"topology", "hub netns (bridge + etcd on tmpfs) + 2 node netns, veth pairs, UCX tcp"},
                {"block_bytes", block_bytes},
                {"prompts", o.prompts},
                {"blocks_per_prompt", n},
                {"inflight", o.inflight},
                {"lanes", o.lanes},
                {"pull",
                 {{"gb_per_s", Rounded(pull_bps / 1e9, 3)},
                  {"seconds", Rounded(pull.seconds, 3)},
                  {"pulled_blocks", pull.pulled_blocks},
                  {"pulled_bytes", pull.pulled_bytes},
                  {"p50_ms", Rounded(pull.latency.p50_us / 1e3, 3)},
                  {"p99_ms", Rounded(pull.latency.p99_us / 1e3, 3)},
                  {"short_prefetches", pull.short_prefetches},
                  {"bench_cpu_s", Rounded(pull.bench_cpu_s, 3)},
                  {"verified_blocks", pull.verified_blocks},
                  {"wrong_blocks", pull.wrong_blocks},
                  {"missing_blocks", pull.missing_blocks},
                  {"verify", verdict},
                  {"transports", transports},
                  {"daemon_warnings", {{"a", warnings[0].first}, {"b", warnings[1].first}}},
                  {"first_warning_a", warnings[0].second},
                  {"first_warning_b", warnings[1].second}}},
                {"ucx_perftest", {{"am", perf(am)}, {"get", perf(get)}}},
                {"ratio_vs_am_bw", Rounded(ratio_am, 3)},
                {"ratio_vs_get", Rounded(ratio_get, 3)}};
    report["directory"] = dir.ok ? Json{{"entries_published", dir.entries},
                                        {"publish_entries_per_s", Whole(dir.publish_per_s)},
                                        {"lookup_keys", 64},
                                        {"lookup_p50_us", Rounded(dir.lookup.p50_us, 1)},
                                        {"lookup_p99_us", Rounded(dir.lookup.p99_us, 1)},
                                        {"lookup_misses", dir.misses}}
                                 : Json{{"error", dir.error}};
    if (sim) {
      report["trace"] = {{"simulation", true},
                         {"nodes", o.nodes},
                         {"node_blocks", o.node_blocks},
                         {"requests", sim->requests},
                         {"blocks", sim->blocks},
                         {"hit_ratio_local_only", Rounded(Ratio(sim->local_only_hits, sim->blocks), 4)},
                         {"hit_ratio_with_peers", Rounded(Ratio(sim->peer_local_hits + sim->peer_cluster_hits, sim->blocks), 4)},
                         {"of_which_pulled", Rounded(Ratio(sim->peer_cluster_hits, sim->blocks), 4)},
                         {"hit_ratio_one_node_of_all_capacity", Rounded(Ratio(sim->one_big_hits, sim->blocks), 4)},
                         {"infinite_cache_bound", Rounded(Ratio(sim->infinite_hits, sim->blocks), 4)}};
    }
    fmt::print("{}", DumpLine(report));
  } else {
    fmt::print("Cluster tier: flexkvd A and B in network namespaces joined by veths to a hub (bridge + etcd on tmpfs); "
               "UCX tcp\n");
    fmt::print("pull A -> B: {} prompts x {} blocks of {} KiB ({:.1f} MiB), {} prefetches in flight on B "
               "(transport: {})\n",
               o.prompts, n, block_bytes >> 10, static_cast<double>(total_blocks * block_bytes) / (1 << 20), o.inflight,
               transports.empty() ? "?" : transports);
    fmt::print("{:<36} {:>10} {:>12} {:>12}\n", "path", "GB/s", "p50 ms", "p99 ms");
    fmt::print("{:<36} {:>10.3f} {:>12.2f} {:>12.2f}\n", "flexkv Prefetch (pull, verified)", pull_bps / 1e9,
               pull.latency.p50_us / 1e3, pull.latency.p99_us / 1e3);
    for (const PerftestResult* r : {&am, &get}) {
      if (r->ok) {
        fmt::print("{:<36} {:>10.3f}  (median of {}: {:.3f}-{:.3f})\n", fmt::format("ucx_perftest -t {}", r->test),
                   r->bytes_per_s / 1e9, r->rounds, r->min_bytes_per_s / 1e9, r->max_bytes_per_s / 1e9);
      } else {
        fmt::print("{:<36} {:>10}  ({})\n", fmt::format("ucx_perftest -t {}", r->test), "failed", r->error);
      }
    }
    fmt::print("this process's CPU during the pull: {:.3f} s of {:.3f} s (its {} waiting threads)\n", pull.bench_cpu_s,
               pull.seconds, std::min(o.inflight, o.prompts));
    fmt::print("ratio pull / ucp_am_bw: {:.2f} (target >= 0.8); pull / ucp_get: {:.2f}\n", ratio_am, ratio_get);
    fmt::print("verify: {} of {} blocks loaded on B byte-exact, {} wrong, {} missing, {} short prefetches: {}{}\n",
               pull.verified_blocks - pull.wrong_blocks, total_blocks, pull.wrong_blocks, pull.missing_blocks,
               pull.short_prefetches, verdict, pull.first_problem.empty() ? "" : " (" + pull.first_problem + ")");
    for (size_t i = 0; i < warnings.size(); ++i) {
      if (warnings[i].first > 0) {
        fmt::print("flexkvd {} logged {} warnings; the first: {}\n", i == 0 ? 'A' : 'B', warnings[i].first,
                   warnings[i].second);
      }
    }
    if (dir.ok) {
      fmt::print("directory (etcd in the hub, client in B's namespace): publish {} entries in batches of 128: {:.0f} "
                 "entries/s; lookup of 64 keys x {}: p50 {:.0f} us, p99 {:.0f} us{}\n",
                 dir.entries, dir.publish_per_s, dir.lookup.n, dir.lookup.p50_us, dir.lookup.p99_us,
                 dir.misses ? fmt::format(" ({} keys NOT found)", dir.misses) : "");
    } else {
      fmt::print("directory: failed: {}\n", dir.error);
    }
    if (sim) {
      fmt::print("trace (SIMULATION, no daemon): {} requests, {} blocks, from {}; round-robin over {} nodes, each an LRU "
                 "of {} blocks, prefix hits\n",
                 sim->requests, sim->blocks, o.trace, o.nodes, o.node_blocks);
      fmt::print("  model with peers: after a node's local prefix, the longest run of following blocks one other node "
                 "holds is a cluster hit (pulled, then cached locally; the peer's LRU order unchanged)\n");
      fmt::print("{:<44} {:>10}\n", "  cache", "hit ratio");
      fmt::print("{:<44} {:>9.2f}%\n", "  each node alone (no peer reuse)", 100 * Ratio(sim->local_only_hits, sim->blocks));
      fmt::print("{:<44} {:>9.2f}%  (of which pulled {:.2f}%)\n", "  with peer reuse",
                 100 * Ratio(sim->peer_local_hits + sim->peer_cluster_hits, sim->blocks),
                 100 * Ratio(sim->peer_cluster_hits, sim->blocks));
      fmt::print("{:<44} {:>9.2f}%\n", fmt::format("  one node of {} blocks (reference)", uint64_t{o.node_blocks} * o.nodes),
                 100 * Ratio(sim->one_big_hits, sim->blocks));
      fmt::print("{:<44} {:>9.2f}%\n", "  infinite cache (bound)", 100 * Ratio(sim->infinite_hits, sim->blocks));
    }
    if (!bytes_ok) fmt::print("FAIL: blocks loaded on B differ from what A stored\n");
    if (bytes_ok && !complete) fmt::print("INCOMPLETE: not every prefetch pulled its whole prompt (see verify)\n");
  }
  if (!bytes_ok || !complete) {
    dump_logs();
    return 1;
  }
  return 0;
}

// The cluster directory (daemon/cluster/) against a real etcd (Debian's /usr/bin/etcd, package etcd-server),
// started by each test on 127.0.0.1 with free ports and a data dir on tmpfs, killed at the end. Skips with a
// warning where /usr/bin/etcd is missing. Leases are 2 s (etcd grants at least ~1.5 s with default timings);
// every wait for the store to act is a poll of the condition with a generous deadline, never a timed assertion.
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "daemon/cluster/etcd/etcd_directory.h"
#include "etcd/etcd_rpc.grpc.pb.h"
#include "tests/support/process.h"

namespace flexkv::cluster {
namespace {

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;

constexpr const char* kEtcd = "/usr/bin/etcd";

// A free port on 127.0.0.1 below the kernel's ephemeral range (32768 and up): etcd is stopped and started again on
// the same ports, and a port of the ephemeral range may be handed out meanwhile - to another test's etcd (CI once saw
// this test's Joins refused for 30 s after a restart: most likely another test's etcd answered on its port) or as
// the source port of any connection. Random in [20000, 32000), checked free when picked.
int FreePort() {
  static std::mt19937 pick{std::random_device{}()};
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = 20000 + static_cast<int>(pick() % 12000);
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (free) return port;
  }
  FAIL("no free port in 20000..31999 after 1000 tries");
  return 0;
}

// Polls `f` every 50 ms until it is true or `limit` has passed; returns its last value.
template <typename F>
bool WaitFor(F f, std::chrono::seconds limit = 30s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return f();
}

// One etcd member on 127.0.0.1, data on tmpfs (etcd 3.4 has no --unsafe-no-fsync). Stop/Start keep the ports and
// the data, as a restart of the store would.
class EtcdServer {
 public:
  static bool Available() { return ::access(kEtcd, X_OK) == 0; }

  explicit EtcdServer(std::vector<std::string> extra_args = {})
      : client_port_(FreePort()), peer_port_(FreePort()), extra_args_(std::move(extra_args)) {
    std::string tmpl = (std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp") +
                       std::string("/flexkv-etcd-test-XXXXXX");
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    dir_ = tmpl;
    Start();
  }
  ~EtcdServer() {
    Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

  void Start() {
    const std::string client = "http://" + endpoint();
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    std::vector<std::string> argv = {kEtcd, "--name", "n1", "--data-dir", dir_ + "/data", "--listen-client-urls",
                                     client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                                     "--initial-advertise-peer-urls", peer, "--initial-cluster", "n1=" + peer,
                                     "--initial-cluster-state", "new", "--log-level", "error", "--logger", "zap"};
    argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
    proc_.emplace(ChildProcess::Spawn(argv));
    // Ready once a Range answers.
    auto channel = grpc::CreateChannel(endpoint(), grpc::InsecureChannelCredentials());
    auto kv = etcdserverpb::KV::NewStub(channel);
    uint64_t cluster_id = 0;
    bool ready = WaitFor([&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 500ms);
      ctx.set_wait_for_ready(true);
      etcdserverpb::RangeRequest req;
      req.set_key("/probe");
      etcdserverpb::RangeResponse resp;
      if (!kv->Range(&ctx, req, &resp).ok()) return false;
      cluster_id = resp.header().cluster_id();
      return true;
    });
    if (!ready) FAIL("etcd did not answer within 30 s; its stderr:\n" << proc_->Stderr());
    // A restart must answer as the same store: not another process that took the port while it was down.
    if (cluster_id_ != 0 && cluster_id != cluster_id_) {
      FAIL("after the restart, " << endpoint() << " is answered by another etcd (cluster id " << cluster_id
                                 << ", ours " << cluster_id_ << "): the port was taken while ours was stopped; "
                                 << "our etcd's stderr:\n" << proc_->Stderr());
    }
    cluster_id_ = cluster_id;
  }
  void Stop() {
    if (!proc_) return;
    proc_->Signal(SIGKILL);
    (void)proc_->Wait(10s);
    proc_.reset();
  }

 private:
  uint64_t cluster_id_ = 0;  // the store that answered the first Start
  int client_port_, peer_port_;
  std::vector<std::string> extra_args_;
  std::string dir_;
  std::optional<ChildProcess> proc_;
};

// Writes and counts keys behind the Directory's back.
class RawEtcd {
 public:
  explicit RawEtcd(const std::string& endpoint)
      : kv_(etcdserverpb::KV::NewStub(grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials()))) {}
  void Put(const std::string& key, const std::string& value) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    etcdserverpb::PutRequest req;
    req.set_key(key);
    req.set_value(value);
    etcdserverpb::PutResponse resp;
    auto s = kv_->Put(&ctx, req, &resp);
    REQUIRE(s.ok());
  }
  // Keys under `prefix`.
  int64_t Count(const std::string& prefix) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    etcdserverpb::RangeRequest req;
    req.set_key(prefix);
    std::string end = prefix;
    end.back() = static_cast<char>(end.back() + 1);
    req.set_range_end(end);
    req.set_count_only(true);
    etcdserverpb::RangeResponse resp;
    auto s = kv_->Range(&ctx, req, &resp);
    REQUIRE(s.ok());
    return resp.count();
  }

 private:
  std::unique_ptr<etcdserverpb::KV::Stub> kv_;
};

constexpr char kSecret[] = "0123456789abcdef-the-cluster-secret";

std::unique_ptr<EtcdDirectory> Connect(const EtcdServer& etcd, std::chrono::milliseconds deadline = 2000ms,
                                       const std::string& secret = kSecret) {
  EtcdOptions options;
  options.endpoints = {etcd.endpoint()};
  options.deadline = deadline;
  options.secret = secret;
  auto dir = ConnectEtcd(options);
  REQUIRE(dir.ok());
  return std::unique_ptr<EtcdDirectory>(dynamic_cast<EtcdDirectory*>(dir.value().release()));
}

NodeInfo Node(const std::string& id, const std::string& endpoint) {
  NodeInfo n;
  n.node_id = id;
  n.transfer_endpoint = endpoint;
  n.pool_info = std::string("rkey\0\x01\xff", 7) + id;  // binary, with a NUL
  return n;
}

BlockKey Key(uint64_t i) { return BlockKey{0x9e3779b97f4a7c15ULL * (i + 1), i + 1}; }

std::vector<DirectoryEntry> Entries(const std::string& ns, uint64_t first, uint64_t count) {
  std::vector<DirectoryEntry> out;
  for (uint64_t i = first; i < first + count; ++i) out.push_back({Key(i), ns, 256});
  return out;
}

std::vector<BlockKey> Keys(uint64_t first, uint64_t count) {
  std::vector<BlockKey> out;
  for (uint64_t i = first; i < first + count; ++i) out.push_back(Key(i));
  return out;
}

std::optional<NodeInfo> FindMember(Directory& dir, const std::string& id) {
  auto members = dir.Members();
  REQUIRE(members.ok());
  for (auto& m : *members) {
    if (m.node_id == id) return m;
  }
  return std::nullopt;
}

// Owners of one key as B sees them (empty on a failed lookup, which the caller's REQUIREs catch elsewhere).
std::vector<Owner> OwnersOf(Directory& dir, const std::string& ns, const BlockKey& key) {
  auto r = dir.Lookup(ns, std::span<const BlockKey>(&key, 1));
  REQUIRE(r.ok());
  REQUIRE(r->size() == 1);
  return (*r)[0];
}

#define SKIP_WITHOUT_ETCD()                                                                             \
  do {                                                                                                  \
    if (!EtcdServer::Available()) {                                                                     \
      WARN("skipped: " << kEtcd << " not found (Debian package etcd-server; scripts/deps.sh installs it)"); \
      return;                                                                                           \
    }                                                                                                   \
  } while (0)

TEST_CASE("cluster directory: two nodes join, publish, look each other up and withdraw",
          "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  auto a = Connect(etcd);
  auto b = Connect(etcd);
  CHECK_FALSE(a->joined());
  REQUIRE(a->Join(Node("node-a", "10.0.0.1:7000"), 10s).ok());
  REQUIRE(b->Join(Node("node-b", "10.0.0.2:7000"), 10s).ok());
  CHECK(a->joined());
  CHECK(a->epoch() == 1);
  CHECK(b->epoch() == 1);

  auto members = b->Members();
  REQUIRE(members.ok());
  REQUIRE(members->size() == 2);
  auto ma = FindMember(*b, "node-a");
  REQUIRE(ma.has_value());
  CHECK(ma->epoch == 1);
  CHECK(ma->transfer_endpoint == "10.0.0.1:7000");
  CHECK(ma->pool_info == Node("node-a", "").pool_info);

  // 150 entries: two Txns of at most 128. Namespaces with '/' and odd bytes are escaped in the keys.
  const std::string ns = "llama/70b \x01";
  REQUIRE(a->Publish(Entries(ns, 0, 150)).ok());
  // 100 keys: two round trips of at most 64.
  auto keys = Keys(0, 100);
  auto seen = b->Lookup(ns, keys);
  REQUIRE(seen.ok());
  REQUIRE(seen->size() == 100);
  for (const auto& owners : *seen) {
    REQUIRE(owners.size() == 1);
    CHECK(owners[0] == Owner{"node-a", 1});
  }
  auto unpublished = b->Lookup(ns, Keys(1000, 3));
  REQUIRE(unpublished.ok());
  for (const auto& owners : *unpublished) CHECK(owners.empty());
  // Another namespace sees nothing; A never sees itself.
  CHECK(OwnersOf(*b, "llama/70b", Key(0)).empty());
  CHECK(OwnersOf(*a, ns, Key(0)).empty());

  // Both publish key 0: B sees A, A sees B.
  REQUIRE(b->Publish(Entries(ns, 0, 1)).ok());
  CHECK(OwnersOf(*a, ns, Key(0)) == std::vector<Owner>{{"node-b", 1}});
  CHECK(OwnersOf(*b, ns, Key(0)) == std::vector<Owner>{{"node-a", 1}});

  // A withdraws 0..9: gone for B; 10.. stay.
  REQUIRE(a->Withdraw(Entries(ns, 0, 10)).ok());
  CHECK(OwnersOf(*b, ns, Key(0)).empty());
  CHECK(OwnersOf(*b, ns, Key(9)).empty());
  CHECK(OwnersOf(*b, ns, Key(10)) == std::vector<Owner>{{"node-a", 1}});

  // Leave revokes the lease: A's member record and every entry go at once.
  RawEtcd raw(etcd.endpoint());
  CHECK(raw.Count("/flexkv/dir/") == 141);  // 140 of A, 1 of B
  REQUIRE(a->Leave().ok());
  CHECK_FALSE(a->joined());
  CHECK_FALSE(FindMember(*b, "node-a").has_value());
  CHECK(OwnersOf(*b, ns, Key(10)).empty());
  CHECK(raw.Count("/flexkv/dir/") == 1);
  CHECK(raw.Count("/flexkv/epochs/") == 2);  // the epochs stay, without lease
  CHECK(a->Publish(Entries(ns, 0, 1)).code() == StatusCode::kFailedPrecondition);
  CHECK(a->Leave().ok());  // again: nothing to do
  CHECK(a->skipped_values() == 0);
  CHECK(b->skipped_values() == 0);
}

TEST_CASE("cluster directory: a node whose lease ends is out, and its rejoin has a new epoch that old entries lack",
          "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  const std::string ns = "m";
  auto a = Connect(etcd);
  auto b = Connect(etcd);
  REQUIRE(a->Join(Node("A", "10.0.0.1:7000"), 3s).ok());
  REQUIRE(b->Join(Node("B", "10.0.0.2:7000"), 30s).ok());
  REQUIRE(a->Publish(Entries(ns, 0, 4)).ok());
  REQUIRE(OwnersOf(*b, ns, Key(0)) == std::vector<Owner>{{"A", 1}});

  // The keepalives go on for longer than the ttl: A stays in.
  std::this_thread::sleep_for(4s);
  CHECK(a->joined());
  CHECK(OwnersOf(*b, ns, Key(0)) == std::vector<Owner>{{"A", 1}});

  // A stops its keepalives (a hung process): after the ttl its record and entries are gone, and A knows it.
  a->PauseKeepAliveForTesting();
  CHECK(WaitFor([&] { return !FindMember(*b, "A").has_value() && OwnersOf(*b, ns, Key(0)).empty(); }));
  CHECK(WaitFor([&] { return !a->joined(); }));
  RawEtcd raw(etcd.endpoint());
  CHECK(raw.Count("/flexkv/dir/") == 0);
  CHECK(a->Publish(Entries(ns, 0, 1)).code() == StatusCode::kFailedPrecondition);

  // A joins again (same client): epoch 2. An entry of epoch 1 (written raw, as one left over from the old run
  // would be) is never returned; the same entry with epoch 2 is.
  REQUIRE(a->Join(Node("A", "10.0.0.1:7001"), 2s).ok());
  CHECK(a->epoch() == 2);
  auto ma = FindMember(*b, "A");
  REQUIRE(ma.has_value());
  CHECK(ma->epoch == 2);
  CHECK(ma->transfer_endpoint == "10.0.0.1:7001");
  raw.Put(a->EntryKey(ns, Key(7), "A"), a->EncodeEntryValue(a->EntryKey(ns, Key(7), "A"), 1, 16));
  CHECK(OwnersOf(*b, ns, Key(7)).empty());
  raw.Put(a->EntryKey(ns, Key(8), "A"), a->EncodeEntryValue(a->EntryKey(ns, Key(8), "A"), 2, 16));
  CHECK(OwnersOf(*b, ns, Key(8)) == std::vector<Owner>{{"A", 2}});
  // An entry of a node id that is no member at all is not returned either.
  raw.Put(a->EntryKey(ns, Key(9), "ghost"), a->EncodeEntryValue(a->EntryKey(ns, Key(9), "ghost"), 1, 16));
  CHECK(OwnersOf(*b, ns, Key(9)).empty());

  // Destroyed without Leave (a crash): gone after the ttl.
  {
    auto c = Connect(etcd);
    REQUIRE(c->Join(Node("C", "10.0.0.3:7000"), 2s).ok());
    REQUIRE(c->Publish(Entries(ns, 20, 2)).ok());
    REQUIRE(OwnersOf(*b, ns, Key(20)) == std::vector<Owner>{{"C", 1}});
  }
  CHECK(FindMember(*b, "C").has_value());  // the store does not know yet
  CHECK(WaitFor([&] { return !FindMember(*b, "C").has_value() && OwnersOf(*b, ns, Key(20)).empty(); }));
  // Its successor gets epoch 2 right away.
  auto c2 = Connect(etcd);
  REQUIRE(c2->Join(Node("C", "10.0.0.3:7000"), 2s).ok());
  CHECK(c2->epoch() == 2);
  CHECK(b->skipped_values() == 0);
}

TEST_CASE("cluster directory: a node id held by a live node cannot join until it leaves", "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  auto a = Connect(etcd);
  auto impostor = Connect(etcd);
  REQUIRE(a->Join(Node("A", "10.0.0.1:7000"), 10s).ok());
  Status s = impostor->Join(Node("A", "10.0.0.9:7000"), 10s);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("held by a live node") && Catch::Contains("10.0.0.1:7000"));
  CHECK_FALSE(impostor->joined());
  // The refused join left no lease behind and did not touch the epoch.
  auto ma = FindMember(*impostor, "A");
  REQUIRE(ma.has_value());
  CHECK(ma->epoch == 1);
  CHECK(ma->transfer_endpoint == "10.0.0.1:7000");
  // The same client twice.
  s = a->Join(Node("A", "10.0.0.1:7000"), 10s);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("already joined"));
  // Bad arguments.
  CHECK(impostor->Join(Node("a/b", "h:1"), 10s).code() == StatusCode::kInvalidArgument);
  CHECK(impostor->Join(Node("x", "no-port"), 10s).code() == StatusCode::kInvalidArgument);
  CHECK(impostor->Join(Node("x", "h:1"), 100ms).code() == StatusCode::kInvalidArgument);
  NodeInfo big = Node("x", "h:1");
  big.pool_info.assign(kMaxPoolInfoBytes + 1, 'p');
  CHECK(impostor->Join(big, 10s).code() == StatusCode::kInvalidArgument);

  // Once A leaves, the id is free at once, with the next epoch.
  REQUIRE(a->Leave().ok());
  REQUIRE(impostor->Join(Node("A", "10.0.0.9:7000"), 10s).ok());
  CHECK(impostor->epoch() == 2);
  CHECK(FindMember(*a, "A")->epoch == 2);
}

// Issue 29 item 2: a daemon killed with kill -9 leaves its member record under a lease that lives for the whole ttl;
// its restarted run (which proved the record is its own) releases it and joins at once, under the next epoch.
TEST_CASE("cluster directory: ReleaseNodeId frees a node id a dead run's lease still holds, with that run's entries",
          "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  const std::string ns = "m";
  auto b = Connect(etcd);
  REQUIRE(b->Join(Node("B", "10.0.0.2:7000"), 30s).ok());
  {
    auto dead = Connect(etcd);  // destroyed without Leave: its lease (30 s) lives on
    REQUIRE(dead->Join(Node("A", "10.0.0.1:7000"), 30s).ok());
    REQUIRE(dead->Publish(Entries(ns, 0, 4)).ok());
  }
  REQUIRE(OwnersOf(*b, ns, Key(0)) == std::vector<Owner>{{"A", 1}});
  auto next = Connect(etcd);
  CHECK(next->Join(Node("A", "10.0.0.1:7000"), 30s).code() == StatusCode::kFailedPrecondition);
  REQUIRE(next->ReleaseNodeId("A").ok());
  // The record and every entry of the dead run are gone at once, not after the ttl.
  CHECK_FALSE(FindMember(*b, "A").has_value());
  CHECK(OwnersOf(*b, ns, Key(0)).empty());
  RawEtcd raw(etcd.endpoint());
  CHECK(raw.Count("/flexkv/dir/") == 0);
  REQUIRE(next->Join(Node("A", "10.0.0.1:7000"), 30s).ok());
  CHECK(next->epoch() == 2);
  // Nothing held: OK. Held by this very client: refused (Leave is the way). Another node's id is not touched by
  // releasing one's own.
  CHECK(next->ReleaseNodeId("nobody").ok());
  CHECK(next->ReleaseNodeId("A").code() == StatusCode::kFailedPrecondition);
  CHECK(next->ReleaseNodeId("a/b").code() == StatusCode::kInvalidArgument);
  CHECK(FindMember(*b, "B").has_value());
  CHECK(b->joined());
}

TEST_CASE("cluster directory: with etcd stopped calls fail UNAVAILABLE within the deadline and the node drops out",
          "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  const std::string ns = "m";
  auto a = Connect(etcd, 1000ms);
  REQUIRE(a->Join(Node("A", "10.0.0.1:7000"), 2s).ok());
  REQUIRE(a->Publish(Entries(ns, 0, 2)).ok());

  etcd.Stop();
  auto start = std::chrono::steady_clock::now();
  Status published = a->Publish(Entries(ns, 2, 2));
  auto looked_up = a->Lookup(ns, Keys(0, 2));
  auto members = a->Members();
  auto fresh = Connect(etcd, 1000ms);
  Status joined = fresh->Join(Node("B", "10.0.0.2:7000"), 2s);
  auto took = std::chrono::steady_clock::now() - start;
  // Each of the four calls gives up after its 1 s deadline; the bound is generous for a loaded machine.
  CHECK(took < 20s);
  // Publish may already see the lease as gone (FAILED_PRECONDITION) on a slow machine.
  CHECK((published.code() == StatusCode::kUnavailable || published.code() == StatusCode::kFailedPrecondition));
  REQUIRE_FALSE(looked_up.ok());
  CHECK(looked_up.status().code() == StatusCode::kUnavailable);
  CHECK_THAT(looked_up.status().message(), Catch::Contains(etcd.endpoint()));
  REQUIRE_FALSE(members.ok());
  CHECK(members.status().code() == StatusCode::kUnavailable);
  CHECK(joined.code() == StatusCode::kUnavailable);
  CHECK_THAT(joined.message(), Catch::Contains(etcd.endpoint()));
  // No keepalive for a whole ttl: A considers itself out.
  CHECK(WaitFor([&] { return !a->joined(); }));
  CHECK(a->Leave().code() == StatusCode::kUnavailable);  // cannot revoke; the lease ends by itself

  // The store comes back (leases survive an etcd restart and get a fresh ttl): A joins again once its old lease
  // has ended, with the next epoch.
  etcd.Start();
  Status last_join;
  const bool rejoined = WaitFor([&] {
    last_join = a->Join(Node("A", "10.0.0.1:7000"), 2s);
    return last_join.ok();
  }, 60s);
  INFO("the last Join answered: " << last_join.ToString());  // CI once saw 30 s of failed Joins here
  CHECK(rejoined);
  CHECK(a->joined());
  CHECK(a->epoch() == 2);
  CHECK(OwnersOf(*fresh, ns, Key(0)).empty());
}

TEST_CASE("cluster directory: corrupt or foreign values under the prefix are skipped and counted",
          "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  const std::string ns = "m";
  auto a = Connect(etcd);
  auto b = Connect(etcd);
  REQUIRE(a->Join(Node("A", "10.0.0.1:7000"), 10s).ok());
  REQUIRE(b->Join(Node("B", "10.0.0.2:7000"), 10s).ok());
  REQUIRE(a->Publish(Entries(ns, 0, 1)).ok());
  RawEtcd raw(etcd.endpoint());
  raw.Put("/flexkv/members/garbage", "hello");
  raw.Put("/flexkv/members/bad id!", "hello");
  raw.Put("/flexkv/members/trunc", std::string("FM\x01\x02", 4));
  std::string huge = "FM";
  huge.push_back('\x01');
  huge.append(8, '\x01');
  huge.append("\xff\xff\xff\xff", 4);  // an endpoint length of 4 GiB
  raw.Put("/flexkv/members/huge", huge);
  raw.Put(a->EntryKey(ns, Key(0), "X"), "not an entry");
  raw.Put(a->EntryKey(ns, Key(0), "A") + "/extra", a->EncodeEntryValue(a->EntryKey(ns, Key(0), "A") + "/extra", 1, 1));
  raw.Put(a->EntryKey(ns, Key(0), "Z"), a->EncodeEntryValue(a->EntryKey(ns, Key(0), "Z"), 1, 0));  // 0 blocks
  raw.Put("/flexkv/dir/" + std::string(1, '\xff'), "");

  auto members = b->Members();
  REQUIRE(members.ok());
  CHECK(members->size() == 2);
  CHECK(b->skipped_values() == 1);          // "bad id!"
  CHECK(b->unauthenticated_values() == 3);  // "hello" (no signature), trunc and huge (version 1: unsigned)
  CHECK(OwnersOf(*b, ns, Key(0)) == std::vector<Owner>{{"A", 1}});
  CHECK(b->skipped_values() > 1);
  CHECK(b->unauthenticated_values() > 3);

  // An epoch key that is not ours: the join refuses (DATA_LOSS naming the key) rather than guess an epoch.
  raw.Put("/flexkv/epochs/E", "17");
  auto e = Connect(etcd);
  Status s = e->Join(Node("E", "10.0.0.5:7000"), 10s);
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK_THAT(s.message(), Catch::Contains("/flexkv/epochs/E"));
  CHECK_FALSE(FindMember(*b, "E").has_value());
}

// Issue 29 item 1: the accept filter trusts the hosts of member records, and a forged lease-less member record
// naming a stranger's host let that host in. Member records and entries are signed with the cluster secret now.
TEST_CASE("cluster directory: member records and entries written without the cluster secret are ignored and counted",
          "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  const std::string ns = "m";
  auto a = Connect(etcd);
  auto b = Connect(etcd);
  REQUIRE(a->Join(Node("A", "10.0.0.1:7000"), 10s).ok());
  REQUIRE(b->Join(Node("B", "10.0.0.2:7000"), 10s).ok());
  REQUIRE(a->Publish(Entries(ns, 0, 1)).ok());
  RawEtcd raw(etcd.endpoint());
  // A member record as flexkvd wrote it before signatures (version 1), without a lease: the forgery.
  auto unsigned_member = [](uint64_t epoch, const std::string& endpoint) {
    std::string v = "FM";
    v.push_back('\x01');
    for (int i = 0; i < 8; ++i) v.push_back(static_cast<char>((epoch >> (8 * i)) & 0xff));
    const auto n = static_cast<uint32_t>(endpoint.size());
    for (int i = 0; i < 4; ++i) v.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
    v += endpoint;
    v.append(4, '\0');  // pool_info of 0 bytes
    return v;
  };
  raw.Put(a->MemberKey("evil"), unsigned_member(1, "10.9.9.9:7000"));
  // Signed with another secret (an etcd writer who guessed the format), and A's genuine record copied to another key.
  auto stranger = Connect(etcd, 2000ms, "another-secret-of-enough-bytes");
  raw.Put(a->MemberKey("evil2"), stranger->EncodeMemberValue(a->MemberKey("evil2"), 1, "10.9.9.8:7000", ""));
  raw.Put(a->MemberKey("evil3"), a->EncodeMemberValue(a->MemberKey("A"), 1, "10.9.9.7:7000", ""));
  // A correctly signed record without a lease (a copy of a real one after its node left): not a member either.
  raw.Put(a->MemberKey("ghost"), a->EncodeMemberValue(a->MemberKey("ghost"), 1, "10.9.9.6:7000", ""));
  // Entries of A: unsigned, another secret's, and one signed for another key.
  raw.Put(a->EntryKey(ns, Key(5), "A"), std::string("FD\x01", 3) + std::string("\x01\0\0\0\0\0\0\0\x04\0\0\0", 12));
  raw.Put(a->EntryKey(ns, Key(6), "A"), stranger->EncodeEntryValue(a->EntryKey(ns, Key(6), "A"), 1, 4));
  raw.Put(a->EntryKey(ns, Key(7), "A"), a->EncodeEntryValue(a->EntryKey(ns, Key(0), "A"), 1, 4));

  auto members = b->Members();
  REQUIRE(members.ok());
  std::vector<std::string> ids;
  for (const NodeInfo& m : *members) ids.push_back(m.node_id);
  std::sort(ids.begin(), ids.end());
  CHECK(ids == std::vector<std::string>{"A", "B"});
  CHECK(b->unauthenticated_values() == 4);
  CHECK(b->skipped_values() == 0);
  for (uint64_t k : {5, 6, 7}) CHECK(OwnersOf(*b, ns, Key(k)).empty());
  CHECK(OwnersOf(*b, ns, Key(0)) == std::vector<Owner>{{"A", 1}});  // A's own entry still counts
  CHECK(b->unauthenticated_values() >= 4 + 3);
  // A directory without the secret cannot take part: ConnectEtcd refuses it.
  EtcdOptions none;
  none.endpoints = {etcd.endpoint()};
  auto refused = ConnectEtcd(none);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(refused.status().message(), Catch::Contains("secret"));
}

TEST_CASE("cluster directory: separate prefixes are separate clusters", "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  EtcdServer etcd;
  EtcdOptions options;
  options.endpoints = {etcd.endpoint()};
  options.prefix = "/other/";
  options.secret = kSecret;
  auto other = ConnectEtcd(options);
  REQUIRE(other.ok());
  auto a = Connect(etcd);
  REQUIRE(a->Join(Node("A", "10.0.0.1:7000"), 10s).ok());
  REQUIRE((*other)->Join(Node("A", "10.0.0.9:7000"), 10s).ok());  // the same id in another cluster
  REQUIRE(a->Publish(Entries("m", 0, 1)).ok());
  auto members = (*other)->Members();
  REQUIRE(members.ok());
  REQUIRE(members->size() == 1);
  CHECK((*members)[0].transfer_endpoint == "10.0.0.9:7000");
  // Bad options.
  options.prefix = "/no-slash";
  CHECK(ConnectEtcd(options).status().code() == StatusCode::kInvalidArgument);
  options.prefix = "/x/";
  options.endpoints = {};
  CHECK(ConnectEtcd(options).status().code() == StatusCode::kInvalidArgument);
}

// etcdctl (Debian package etcd-client) against `etcd`; REQUIREs success.
void Etcdctl(const EtcdServer& etcd, std::vector<std::string> args) {
  std::vector<std::string> argv = {"/usr/bin/etcdctl", "--endpoints", etcd.endpoint(), "--dial-timeout", "5s"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = flexkv::testing::RunCommand(argv);
  INFO("etcdctl " << args[0] << " " << (args.size() > 1 ? args[1] : "") << ": " << r.output);
  REQUIRE(r.exit_code == 0);
}

TEST_CASE("cluster directory: etcd with auth: credentials from a file, a role scoped to the prefix, tokens renewed",
          "[integration][cluster]") {
  SKIP_WITHOUT_ETCD();
  if (::access("/usr/bin/etcdctl", X_OK) != 0) {
    WARN("skipped: /usr/bin/etcdctl not found (Debian package etcd-client)");
    return;
  }
  // Simple tokens that expire after 1 s, so that every later call needs a renewed one.
  EtcdServer etcd({"--auth-token-ttl", "1"});
  Etcdctl(etcd, {"user", "add", "root", "--new-user-password=rootpw"});
  Etcdctl(etcd, {"user", "add", "flexkv", "--new-user-password=flexkv-pw"});
  Etcdctl(etcd, {"role", "add", "fkv"});
  Etcdctl(etcd, {"role", "grant-permission", "fkv", "--prefix=true", "readwrite", "/flexkv/"});
  Etcdctl(etcd, {"user", "grant-role", "flexkv", "fkv"});
  Etcdctl(etcd, {"auth", "enable"});

  char tmpl[] = "/tmp/flexkv-etcd-creds-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string path = std::string(tmpl) + "/creds";
  {
    std::ofstream out(path);
    out << "user = flexkv\npassword = flexkv-pw\n";
  }
  REQUIRE(::chmod(path.c_str(), 0600) == 0);
  auto creds = ReadCredentialsFile(path);
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  REQUIRE(creds.ok());

  EtcdOptions options;
  options.endpoints = {etcd.endpoint()};
  options.user = creds->user;
  options.password = creds->password;
  options.secret = kSecret;
  auto a = ConnectEtcd(options);
  auto b = ConnectEtcd(options);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE((*a)->Join(Node("A", "10.0.0.1:7000"), 2s).ok());
  REQUIRE((*b)->Join(Node("B", "10.0.0.2:7000"), 10s).ok());
  REQUIRE((*a)->Publish(Entries("m", 0, 3)).ok());
  CHECK(OwnersOf(**b, "m", Key(2)) == std::vector<Owner>{{"A", 1}});
  // Past the token ttl (and the lease ttl): the keepalives and the calls renewed their tokens.
  std::this_thread::sleep_for(4s);
  CHECK((*a)->joined());
  REQUIRE((*a)->Publish(Entries("m", 3, 1)).ok());
  CHECK(OwnersOf(**b, "m", Key(3)) == std::vector<Owner>{{"A", 1}});
  CHECK(dynamic_cast<EtcdDirectory&>(**b).token_renewals() > 0);  // B was idle for longer than the token ttl
  REQUIRE((*a)->Leave().ok());
  CHECK(OwnersOf(**b, "m", Key(2)).empty());

  // A wrong password, no credentials at all, or a prefix outside the role: refused, never UNAVAILABLE.
  options.password = "wrong";
  auto wrong = ConnectEtcd(options);
  REQUIRE(wrong.ok());
  Status s = (*wrong)->Join(Node("W", "10.0.0.3:7000"), 10s);
  CHECK_FALSE(s.ok());
  CHECK(s.code() != StatusCode::kUnavailable);
  CHECK_THAT(s.message(), Catch::Contains("Authenticate as 'flexkv'"));
  auto anonymous = Connect(etcd);
  s = anonymous->Join(Node("W", "10.0.0.3:7000"), 10s);
  CHECK_FALSE(s.ok());
  CHECK(s.code() != StatusCode::kUnavailable);
  options.password = creds->password;
  options.prefix = "/elsewhere/";
  auto elsewhere = ConnectEtcd(options);
  REQUIRE(elsewhere.ok());
  s = (*elsewhere)->Join(Node("W", "10.0.0.3:7000"), 10s);
  CHECK(s.code() == StatusCode::kPermissionDenied);
}

TEST_CASE("cluster directory: a credentials file readable by group or others is refused", "[integration][cluster]") {
  char tmpl[] = "/tmp/flexkv-etcd-creds-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const std::string path = dir + "/etcd.credentials";
  {
    std::ofstream out(path);
    out << "# flexkv's etcd user\nuser = flexkv\npassword =  s3cret=with=equals \n";
  }
  REQUIRE(::chmod(path.c_str(), 0644) == 0);
  auto r = ReadCredentialsFile(path);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kPermissionDenied);
  CHECK_THAT(r.status().message(), Catch::Contains(path) && Catch::Contains("0644") && Catch::Contains("0600"));
  CHECK_THAT(r.status().message(), !Catch::Contains("s3cret"));

  REQUIRE(::chmod(path.c_str(), 0640) == 0);
  CHECK(ReadCredentialsFile(path).status().code() == StatusCode::kPermissionDenied);

  REQUIRE(::chmod(path.c_str(), 0600) == 0);
  r = ReadCredentialsFile(path);
  REQUIRE(r.ok());
  CHECK(r->user == "flexkv");
  CHECK(r->password == "s3cret=with=equals");

  const std::string link = dir + "/link";
  REQUIRE(::symlink(path.c_str(), link.c_str()) == 0);
  CHECK(ReadCredentialsFile(link).status().code() == StatusCode::kPermissionDenied);
  CHECK(ReadCredentialsFile(dir + "/missing").status().code() == StatusCode::kNotFound);
  {
    std::ofstream out(path);
    out << "user = flexkv\nsecret-without-a-name\n";
  }
  r = ReadCredentialsFile(path);
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(r.status().message(), !Catch::Contains("secret-without"));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace flexkv::cluster

// The Directory (daemon/cluster/directory.h) on etcd v3, over the gRPC we already link (proto/etcd/etcd_rpc.proto,
// the subset of etcd's API we use). Why etcd and not Redis: one lease per daemon run takes every entry of the node
// with it; Txn with compares; TLS and users/roles (docs/cluster.md).
//
// Keys, under EtcdOptions::prefix (default "/flexkv/"):
//   <prefix>members/<node_id>                             the member record, under the node's lease
//   <prefix>epochs/<node_id>                              the node id's last epoch, without lease
//   <prefix>dir/<namespace>/<chunk key hex>/<node_id>     a directory entry, under the owner's lease
// <namespace> is the model namespace with every byte outside [A-Za-z0-9._-] written as %XX, so it never holds a
// '/'. Values are binary and versioned: 'F', a kind byte ('M' member, 'E' epoch, 'D' entry), a version byte (2),
// little-endian fields (etcd_value.h), then HMAC-SHA256 under the cluster secret over the key and everything
// before it (issue 29): a writer of the store without the secret can delete values (misses), never add a member or
// an entry. A value whose signature does not verify, or an unsigned one of version 1 (an older flexkvd: a rolling
// upgrade needs every node on the same version), is ignored and counted (unauthenticated_values()); a member record
// without a lease too. A value or key that does not parse is skipped and counted (skipped_values()). Both with a
// rate-limited warning; nothing read from the store is trusted.
//
// One lease per Join: LeaseGrant(ttl), then one Txn that claims the member key only if no live node holds it
// (create_revision == 0) and bumps the epoch key only if nobody else did since we read it (mod_revision
// compare). A thread of the client sends a keepalive every ttl/3 (one short LeaseKeepAlive stream each, with
// a deadline, so a silent partition cannot hang it); when none succeeded for a whole ttl, or etcd says the
// lease is gone, joined() turns false and the thread ends.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/log.h"
#include "common/mutex.h"
#include "daemon/cluster/directory.h"

namespace grpc {
class ClientContext;
class Status;
}  // namespace grpc

namespace flexkv::cluster {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // host:port; tried in order, the one that last answered first
  std::string prefix = "/flexkv/";     // every key lives under it; must end with '/'
  // Optional etcd auth (users/roles): Authenticate gives a token sent as "token" metadata on every call,
  // renewed when etcd says it is invalid (simple tokens expire). Empty user: no auth.
  std::string user, password;
  std::chrono::milliseconds deadline{2000};  // per call, failover between endpoints included
  // The cluster secret (>= 16 bytes, else ConnectEtcd says INVALID_ARGUMENT): every value this client writes is
  // signed with it, every value it reads must carry its signature.
  std::string secret;

  struct Credentials {
    std::string user, password;
  };
};

// Reads etcd credentials from a file the operator protects: lines "user = NAME" and "password = SECRET" ('#'
// starts a comment line; surrounding blanks are trimmed). PERMISSION_DENIED, naming the path and the expected
// mode, when the file is not a regular file or any group/other permission bit is set (mode & 077); NOT_FOUND /
// INVALID_ARGUMENT for a missing or malformed file (the password never appears in a message).
Result<EtcdOptions::Credentials> ReadCredentialsFile(const std::string& path);

// Validates the options and builds the client. Contacts nothing: the first call that needs the store connects
// (so a daemon starts while etcd is down; Join then reports UNAVAILABLE).
Result<std::unique_ptr<Directory>> ConnectEtcd(const EtcdOptions& options);

class EtcdDirectory final : public Directory {
 public:
  explicit EtcdDirectory(EtcdOptions options);  // ConnectEtcd validates the options first
  ~EtcdDirectory() override;                    // stops the keepalives; does not revoke (see Directory::Leave)
  EtcdDirectory(const EtcdDirectory&) = delete;
  EtcdDirectory& operator=(const EtcdDirectory&) = delete;

  Status Join(const NodeInfo& self, std::chrono::milliseconds ttl) override;
  Status Leave() override;
  Status ReleaseNodeId(const std::string& node_id, std::string_view expected_endpoint = {}) override;
  Result<std::vector<NodeInfo>> Members() override;
  Status Publish(std::span<const DirectoryEntry> entries) override;
  Status Withdraw(std::span<const DirectoryEntry> entries) override;
  Result<std::vector<std::vector<Owner>>> Lookup(const std::string& model_namespace,
                                                 std::span<const BlockKey> chunk_keys) override;
  bool joined() const override { return joined_.load(std::memory_order_acquire); }
  uint64_t epoch() const override;

  // Keys and values read back from the store that did not parse (skipped), since construction.
  uint64_t skipped_values() const { return skipped_.load(std::memory_order_relaxed); }
  // Values read back whose signature did not verify, unsigned ones (an older flexkvd's) and member records without a
  // lease: ignored, since construction.
  uint64_t unauthenticated_values() const override { return unauthenticated_.load(std::memory_order_relaxed); }
  // Auth tokens that etcd rejected (expired) and this client replaced.
  uint64_t token_renewals() const { return token_renewals_.load(std::memory_order_relaxed); }
  // The lease of the current join (0 when none).
  int64_t lease_id() const;
  // Tests: the keepalive thread stops sending (as a hung process would); the store drops the node after its ttl.
  void PauseKeepAliveForTesting() { keepalive_paused_.store(true, std::memory_order_release); }

  // The keys this client uses (for tests that write raw values, and for operators reading the store).
  std::string MemberKey(const std::string& node_id) const;
  std::string EpochKey(const std::string& node_id) const;
  std::string EntryKey(const std::string& model_namespace, const BlockKey& chunk_key, const std::string& node_id) const;
  // The values this client writes at `key`, signed with its secret (tests write stale ones raw).
  std::string EncodeEntryValue(const std::string& key, uint64_t epoch, uint32_t blocks) const;
  std::string EncodeMemberValue(const std::string& key, uint64_t epoch, const std::string& endpoint,
                                const std::string& pool_info) const;

  struct Endpoint;  // a channel and its stubs (etcd_directory.cc)

 private:
  // Runs `rpc` on an endpoint (the one that last answered first, then the others) within the deadline, with the
  // auth token; renews the token once when etcd calls it invalid. Returns the gRPC status mapped to ours:
  // UNAVAILABLE naming the endpoints when none answered in time, else etcd's code with `what` as context.
  using Rpc = std::function<grpc::Status(Endpoint&, grpc::ClientContext&)>;
  Status Call(const char* what, const Rpc& rpc, std::chrono::milliseconds deadline);
  // Adds the auth token to `ctx` (authenticating first when there is none). False with `error` set otherwise.
  bool AddToken(Endpoint& ep, grpc::ClientContext& ctx, std::chrono::steady_clock::time_point deadline,
                grpc::Status* error);
  std::string EndpointList() const;
  void CountSkipped(const std::string& key, const char* why);
  // Whether `value` read at `key` carries the cluster secret's signature (*body: the value without it); else counts
  // and logs it.
  bool Authentic(const std::string& key, std::string_view value, std::string_view* body);
  void CountUnauthenticated(const std::string& key, const char* why);

  void KeepAliveLoop(int64_t lease, std::chrono::milliseconds ttl, std::chrono::steady_clock::time_point granted_at);
  // One keepalive: 1 renewed, 0 the lease is gone, -1 the store did not answer.
  int KeepAliveOnce(int64_t lease, std::chrono::milliseconds deadline);
  void StopKeepAlive();
  void MarkLeaseGone(int64_t lease);

  const EtcdOptions options_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::atomic<size_t> current_endpoint_{0};

  Mutex token_mu_;
  std::string token_ ABSL_GUARDED_BY(token_mu_);

  Mutex join_mu_;  // serialises Join and Leave; taken before mu_

  mutable Mutex mu_;
  std::string node_id_ ABSL_GUARDED_BY(mu_);  // of the current (or last) join
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable stop_cv_;
  std::thread keepalive_;  // owned by Join/Leave/destructor under join_mu_

  std::atomic<bool> joined_{false};
  std::atomic<bool> keepalive_paused_{false};
  std::atomic<uint64_t> skipped_{0};
  std::atomic<uint64_t> unauthenticated_{0};
  log::RateLimited unauthenticated_log_{5000};
  std::atomic<uint64_t> token_renewals_{0};
  log::RateLimited skipped_log_{5000};
};

}  // namespace flexkv::cluster

// The Directory on etcd v3 (see etcd_directory.h for the keys, the values and the lease protocol; the values' codec
// and signature are etcd_value.h's). One file of ~900 lines: the per-endpoint RPC plumbing (tokens, deadlines,
// failover) and the protocol share its anonymous helpers.
#include "daemon/cluster/etcd/etcd_directory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <unordered_map>

#include "common/unique_fd.h"
#include "daemon/cluster/etcd/etcd_value.h"
#include "etcd/etcd_rpc.grpc.pb.h"

namespace flexkv::cluster {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

struct EtcdDirectory::Endpoint {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<etcdserverpb::Auth::Stub> auth;
};

namespace {

constexpr const char* kLog = "cluster";
constexpr size_t kMaxTxnOps = 128;  // etcd's default --max-txn-ops
constexpr size_t kMinSecretBytes = 16;

// ---- keys ----

bool ValidNodeId(std::string_view id) {
  if (id.empty() || id.size() > kMaxNodeIdBytes) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

std::string EscapeNamespace(std::string_view ns) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(ns.size());
  for (char c : ns) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
        c == '-') {
      out.push_back(c);
    } else {
      auto u = static_cast<unsigned char>(c);
      out.push_back('%');
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 0xf]);
    }
  }
  return out;
}

// The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    auto& last = prefix.back();
    if (static_cast<unsigned char>(last) < 0xff) {
      last = static_cast<char>(static_cast<unsigned char>(last) + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Status ValidateNamespace(const std::string& ns) {
  if (ns.empty() || ns.size() > kMaxNamespaceBytes) {
    return Status::InvalidArgument(
        fmt::format("model namespace has {} bytes; expected 1..{}", ns.size(), kMaxNamespaceBytes));
  }
  return Status::Ok();
}

// gRPC takes deadlines on the system clock only.
std::chrono::system_clock::time_point ToSystem(steady_clock::time_point t) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(t - steady_clock::now());
}

bool RetryOnAnotherEndpoint(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// etcd's answers that a new token fixes: an expired simple token, or one issued before an auth change.
bool TokenRejected(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
         s.error_message().find("auth store is old") != std::string::npos;
}

bool LeaseNotFound(const Status& s) {
  return s.code() == StatusCode::kNotFound && s.message().find("lease not found") != std::string::npos;
}

std::string Trim(std::string_view s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string_view::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return std::string(s.substr(b, e - b + 1));
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Credentials and construction

Result<EtcdOptions::Credentials> ReadCredentialsFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return Status::NotFound(fmt::format("etcd credentials file {} does not exist", path));
    if (err == ELOOP) {
      return Status::PermissionDenied(
          fmt::format("etcd credentials file {} is a symbolic link; expected a regular file of mode 0600", path));
    }
    return Status(err == EACCES ? StatusCode::kPermissionDenied : StatusCode::kInvalidArgument,
                  fmt::format("etcd credentials file {}: {}", path, std::strerror(err)));
  }
  UniqueFd file(fd);
  struct stat st {};
  if (::fstat(file.get(), &st) != 0) {
    return Status::Internal(fmt::format("etcd credentials file {}: fstat: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return Status::PermissionDenied(
        fmt::format("etcd credentials file {} is not a regular file; expected a regular file of mode 0600", path));
  }
  if ((st.st_mode & 077) != 0) {
    return Status::PermissionDenied(fmt::format(
        "etcd credentials file {} has mode {:04o}; expected 0600 or 0400 (no access for group or others: "
        "chmod 600 {})",
        path, st.st_mode & 07777, path));
  }
  constexpr size_t kMaxBytes = 64 * 1024;
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(file.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Internal(fmt::format("etcd credentials file {}: read: {}", path, std::strerror(errno)));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kMaxBytes) {
      return Status::InvalidArgument(fmt::format("etcd credentials file {} is over {} bytes", path, kMaxBytes));
    }
  }
  EtcdOptions::Credentials creds;
  bool have_user = false, have_password = false;
  size_t line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string line = Trim(std::string_view(text).substr(pos, nl - pos));
    pos = nl + 1;
    ++line_no;
    if (line.empty() || line[0] == '#') continue;
    size_t eq = line.find('=');
    std::string name = eq == std::string::npos ? line : Trim(std::string_view(line).substr(0, eq));
    if (eq == std::string::npos || (name != "user" && name != "password")) {
      // The line may hold the password: name only the line number.
      return Status::InvalidArgument(fmt::format(
          "etcd credentials file {} line {}: expected \"user = NAME\" or \"password = SECRET\"", path, line_no));
    }
    std::string value = Trim(std::string_view(line).substr(eq + 1));
    if (name == "user") {
      creds.user = value;
      have_user = true;
    } else {
      creds.password = value;
      have_password = true;
    }
  }
  if (!have_user || creds.user.empty() || !have_password || creds.password.empty()) {
    return Status::InvalidArgument(
        fmt::format("etcd credentials file {} must set both \"user = NAME\" and \"password = SECRET\"", path));
  }
  return creds;
}

Result<std::unique_ptr<Directory>> ConnectEtcd(const EtcdOptions& options) {
  if (options.endpoints.empty()) return Status::InvalidArgument("etcd: no endpoint given (host:port)");
  for (const auto& ep : options.endpoints) {
    if (ep.empty() || ep.find(':') == std::string::npos || ep.find('/') != std::string::npos) {
      return Status::InvalidArgument(fmt::format("etcd endpoint '{}' is not host:port", ep));
    }
  }
  if (options.prefix.empty() || options.prefix.back() != '/') {
    return Status::InvalidArgument(fmt::format("etcd key prefix '{}' must end with '/'", options.prefix));
  }
  if (options.deadline.count() <= 0) return Status::InvalidArgument("etcd deadline must be positive");
  if (!options.user.empty() && options.password.empty()) {
    return Status::InvalidArgument(fmt::format("etcd user '{}' has no password", options.user));
  }
  if (options.secret.size() < kMinSecretBytes) {
    return Status::InvalidArgument(fmt::format(
        "etcd: the cluster secret is {} bytes; expected at least {} (member records and directory entries are "
        "signed with it)",
        options.secret.size(), kMinSecretBytes));
  }
  return std::unique_ptr<Directory>(std::make_unique<EtcdDirectory>(options));
}

EtcdDirectory::EtcdDirectory(EtcdOptions options) : options_(std::move(options)) {
  for (const auto& address : options_.endpoints) {
    grpc::ChannelArguments args;
    // Reconnect soon after the store comes back (gRPC's default backoff grows to 120 s).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetMaxReceiveMessageSize(256 << 20);  // Members with many 64 KiB pool records
    auto ep = std::make_unique<Endpoint>();
    ep->address = address;
    ep->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    ep->kv = etcdserverpb::KV::NewStub(ep->channel);
    ep->lease = etcdserverpb::Lease::NewStub(ep->channel);
    ep->auth = etcdserverpb::Auth::NewStub(ep->channel);
    endpoints_.push_back(std::move(ep));
  }
}

EtcdDirectory::~EtcdDirectory() {
  MutexLock j(&join_mu_);
  StopKeepAlive();
}

// ---------------------------------------------------------------------------------------------------------------
// Keys

std::string EtcdDirectory::MemberKey(const std::string& node_id) const {
  return options_.prefix + "members/" + node_id;
}
std::string EtcdDirectory::EpochKey(const std::string& node_id) const { return options_.prefix + "epochs/" + node_id; }
std::string EtcdDirectory::EntryKey(const std::string& model_namespace, const BlockKey& chunk_key,
                                    const std::string& node_id) const {
  return options_.prefix + "dir/" + EscapeNamespace(model_namespace) + "/" + chunk_key.ToHex() + "/" + node_id;
}
std::string EtcdDirectory::EncodeEntryValue(const std::string& key, uint64_t epoch, uint32_t blocks) const {
  return etcd_value::Signed(options_.secret, key, etcd_value::EncodeEntry(epoch, blocks));
}

std::string EtcdDirectory::EncodeMemberValue(const std::string& key, uint64_t epoch, const std::string& endpoint,
                                             const std::string& pool_info) const {
  return etcd_value::Signed(options_.secret, key, etcd_value::EncodeMember(epoch, endpoint, pool_info));
}

bool EtcdDirectory::Authentic(const std::string& key, std::string_view value, std::string_view* body) {
  switch (etcd_value::CheckSignature(options_.secret, key, value, body)) {
    case etcd_value::Signature::kValid:
      return true;
    case etcd_value::Signature::kUnsigned:
      CountUnauthenticated(key, "unsigned (written by a flexkvd older than this one: every node of a cluster must "
                                "run the same version)");
      return false;
    case etcd_value::Signature::kBad:
      break;
  }
  CountUnauthenticated(key, "its signature is not the cluster secret's (written without the secret, or damaged)");
  return false;
}

void EtcdDirectory::CountUnauthenticated(const std::string& key, const char* why) {
  unauthenticated_.fetch_add(1, std::memory_order_relaxed);
  std::string shown;  // the key is what a writer of the store chose: a bounded, printable prefix of it
  for (char c : key.substr(0, 200)) shown.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  unauthenticated_log_.Warning(kLog, "etcd: ignored the value of '{}': {}", shown, why);
}

uint64_t EtcdDirectory::epoch() const {
  MutexLock l(&mu_);
  return epoch_;
}
int64_t EtcdDirectory::lease_id() const {
  MutexLock l(&mu_);
  return lease_;
}

void EtcdDirectory::CountSkipped(const std::string& key, const char* why) {
  skipped_.fetch_add(1, std::memory_order_relaxed);
  // The key may be anything a writer of the store chose: print a bounded, printable prefix of it.
  std::string shown;
  for (char c : key.substr(0, 200)) shown.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  skipped_log_.Warning(kLog, "etcd: skipped key '{}': {} (not written by this version of flexkvd?)", shown, why);
}

std::string EtcdDirectory::EndpointList() const {
  std::string s;
  for (const auto& ep : endpoints_) s += (s.empty() ? "" : ",") + ep->address;
  return s;
}

// ---------------------------------------------------------------------------------------------------------------
// Calls

bool EtcdDirectory::AddToken(Endpoint& ep, grpc::ClientContext& ctx, steady_clock::time_point deadline,
                             grpc::Status* error) {
  if (options_.user.empty()) return true;
  MutexLock l(&token_mu_);
  if (token_.empty()) {
    grpc::ClientContext actx;
    actx.set_deadline(ToSystem(deadline));
    etcdserverpb::AuthenticateRequest req;
    req.set_name(options_.user);
    req.set_password(options_.password);
    etcdserverpb::AuthenticateResponse resp;
    grpc::Status s = ep.auth->Authenticate(&actx, req, &resp);
    if (!s.ok()) {
      *error = grpc::Status(s.error_code(), "Authenticate as '" + options_.user + "': " + s.error_message());
      return false;
    }
    token_ = resp.token();
  }
  ctx.AddMetadata("token", token_);
  return true;
}

Status EtcdDirectory::Call(const char* what, const Rpc& rpc, milliseconds deadline) {
  const auto end = steady_clock::now() + deadline;
  const size_t n = endpoints_.size();
  const size_t first = current_endpoint_.load(std::memory_order_relaxed);
  grpc::Status last;
  bool renewed = false;
  for (size_t i = 0; i < n;) {
    const size_t idx = (first + i) % n;
    Endpoint& ep = *endpoints_[idx];
    const auto now = steady_clock::now();
    if (now >= end) break;
    // The endpoints not tried yet share what is left of the deadline.
    const auto ep_deadline = now + (end - now) / static_cast<int64_t>(n - i);
    grpc::ClientContext ctx;
    ctx.set_deadline(ToSystem(ep_deadline));
    grpc::Status s;
    if (AddToken(ep, ctx, ep_deadline, &s)) s = rpc(ep, ctx);
    if (s.ok()) {
      current_endpoint_.store(idx, std::memory_order_relaxed);
      return Status::Ok();
    }
    if (!options_.user.empty() && TokenRejected(s) && !renewed) {
      renewed = true;  // a new token, once, on the same endpoint
      token_renewals_.fetch_add(1, std::memory_order_relaxed);
      log::Debug(kLog, "etcd {}: token rejected ({}); authenticating again", ep.address, s.error_message());
      MutexLock l(&token_mu_);
      token_.clear();
      continue;
    }
    if (RetryOnAnotherEndpoint(s.error_code())) {
      last = s;
      ++i;
      continue;
    }
    current_endpoint_.store(idx, std::memory_order_relaxed);
    return Status(static_cast<StatusCode>(s.error_code()),
                  fmt::format("etcd {} at {}: {}", what, ep.address, s.error_message()));
  }
  return Status::Unavailable(fmt::format("etcd at {} not reachable within {} ms ({}{}{})", EndpointList(),
                                         deadline.count(), what, last.error_message().empty() ? "" : ": ",
                                         last.error_message()));
}

// ---------------------------------------------------------------------------------------------------------------
// Join, keepalive, Leave

Status EtcdDirectory::Join(const NodeInfo& self, milliseconds ttl) {
  if (!ValidNodeId(self.node_id)) {
    return Status::InvalidArgument(
        fmt::format("node id '{}' must be 1..{} characters of [A-Za-z0-9._-]", self.node_id, kMaxNodeIdBytes));
  }
  if (self.transfer_endpoint.empty() || self.transfer_endpoint.size() > kMaxEndpointBytes ||
      self.transfer_endpoint.find(':') == std::string::npos) {
    return Status::InvalidArgument(
        fmt::format("transfer endpoint '{}' is not host:port (at most {} bytes)", self.transfer_endpoint,
                    kMaxEndpointBytes));
  }
  if (self.pool_info.size() > kMaxPoolInfoBytes) {
    return Status::InvalidArgument(
        fmt::format("pool info has {} bytes; at most {}", self.pool_info.size(), kMaxPoolInfoBytes));
  }
  if (ttl < std::chrono::seconds(1) || ttl > std::chrono::hours(24)) {
    return Status::InvalidArgument(fmt::format("lease ttl {} ms is outside 1 s..24 h", ttl.count()));
  }
  MutexLock j(&join_mu_);
  if (joined()) {
    MutexLock l(&mu_);
    return Status::FailedPrecondition(
        fmt::format("already joined as '{}' (epoch {}); Leave first", node_id_, epoch_));
  }
  StopKeepAlive();  // the thread of an earlier join whose lease ended
  keepalive_paused_.store(false, std::memory_order_release);

  const std::string member_key = MemberKey(self.node_id);
  const std::string epoch_key = EpochKey(self.node_id);
  const int64_t ttl_s = (ttl.count() + 999) / 1000;
  int64_t lease = 0;
  steady_clock::time_point granted_at;
  auto revoke = [&] {
    if (lease == 0) return;
    etcdserverpb::LeaseRevokeRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseRevokeResponse resp;
    (void)Call("LeaseRevoke", [&](Endpoint& ep, grpc::ClientContext& ctx) {
      return ep.lease->LeaseRevoke(&ctx, req, &resp);
    }, options_.deadline);
  };

  for (int attempt = 0; attempt < 8; ++attempt) {
    // 1. The node id's last epoch (and the revision to compare against, 0 when there is none).
    etcdserverpb::RangeRequest rreq;
    rreq.set_key(epoch_key);
    etcdserverpb::RangeResponse rresp;
    Status s = Call("Range", [&](Endpoint& ep, grpc::ClientContext& ctx) {
      return ep.kv->Range(&ctx, rreq, &rresp);
    }, options_.deadline);
    if (!s.ok()) {
      revoke();
      return s;
    }
    uint64_t previous = 0;
    int64_t epoch_mod_revision = 0;
    if (rresp.kvs_size() > 0) {
      const auto& kv = rresp.kvs(0);
      // The epoch only has to grow: one an older flexkvd wrote (unsigned) is read as it is. A forged one can make
      // this node's epoch larger (harmless) or repeat an old one of ours, whose entries we signed ourselves.
      std::string_view body;
      using etcd_value::Signature;
      const Signature sig = etcd_value::CheckSignature(options_.secret, epoch_key, kv.value(), &body);
      const bool decoded =
          sig == Signature::kValid      ? etcd_value::DecodeEpoch(body, &previous)
          : sig == Signature::kUnsigned ? etcd_value::DecodeEpoch(body, &previous, etcd_value::kUnsignedVersion)
                                        : false;
      if (kv.key() != epoch_key || !decoded || previous == UINT64_MAX) {
        CountSkipped(kv.key(), "not an epoch record");
        revoke();
        return Status::DataLoss(fmt::format(
            "etcd key {} does not hold an epoch record of flexkvd, so the next epoch of node '{}' is unknown; "
            "delete it (etcdctl del {}) only when no daemon runs as '{}'",
            epoch_key, self.node_id, epoch_key, self.node_id));
      }
      epoch_mod_revision = kv.mod_revision();
    }
    // 2. The lease, once (kept over retries).
    if (lease == 0) {
      etcdserverpb::LeaseGrantRequest greq;
      greq.set_ttl(ttl_s);
      etcdserverpb::LeaseGrantResponse gresp;
      granted_at = steady_clock::now();
      s = Call("LeaseGrant", [&](Endpoint& ep, grpc::ClientContext& ctx) {
        return ep.lease->LeaseGrant(&ctx, greq, &gresp);
      }, options_.deadline);
      if (!s.ok()) return s;
      if (!gresp.error().empty() || gresp.id() == 0) {
        return Status::Unavailable(fmt::format("etcd at {}: LeaseGrant: {}", EndpointList(),
                                               gresp.error().empty() ? "no lease id" : gresp.error()));
      }
      lease = gresp.id();
    }
    // 3. Claim the member key (no live holder) and bump the epoch (nobody else did since step 1), at once.
    const uint64_t epoch = previous + 1;
    etcdserverpb::TxnRequest txn;
    auto* c1 = txn.add_compare();
    c1->set_key(member_key);
    c1->set_target(etcdserverpb::Compare::CREATE);
    c1->set_result(etcdserverpb::Compare::EQUAL);
    c1->set_create_revision(0);
    auto* c2 = txn.add_compare();
    c2->set_key(epoch_key);
    c2->set_target(etcdserverpb::Compare::MOD);
    c2->set_result(etcdserverpb::Compare::EQUAL);
    c2->set_mod_revision(epoch_mod_revision);
    auto* put_epoch = txn.add_success()->mutable_request_put();
    put_epoch->set_key(epoch_key);
    put_epoch->set_value(etcd_value::Signed(options_.secret, epoch_key, etcd_value::EncodeEpoch(epoch)));
    auto* put_member = txn.add_success()->mutable_request_put();
    put_member->set_key(member_key);
    put_member->set_value(EncodeMemberValue(member_key, epoch, self.transfer_endpoint, self.pool_info));
    put_member->set_lease(lease);
    txn.add_failure()->mutable_request_range()->set_key(member_key);
    etcdserverpb::TxnResponse tresp;
    s = Call("Txn", [&](Endpoint& ep, grpc::ClientContext& ctx) { return ep.kv->Txn(&ctx, txn, &tresp); },
             options_.deadline);
    if (!s.ok()) {
      revoke();
      return s;
    }
    if (tresp.succeeded()) {
      {
        MutexLock l(&mu_);
        node_id_ = self.node_id;
        epoch_ = epoch;
        lease_ = lease;
        stop_ = false;
      }
      joined_.store(true, std::memory_order_release);
      keepalive_ = std::thread([this, lease, ttl, granted_at] { KeepAliveLoop(lease, ttl, granted_at); });
      log::Info(kLog, "joined the cluster at etcd {} as '{}' (epoch {}, lease {:x}, ttl {} ms)", EndpointList(),
                self.node_id, epoch, lease, ttl.count());
      return Status::Ok();
    }
    if (tresp.responses_size() > 0 && tresp.responses(0).response_range().kvs_size() > 0) {
      NodeInfo holder;
      const auto& kv = tresp.responses(0).response_range().kvs(0);
      std::string_view body;
      const bool parsed =
          etcd_value::CheckSignature(options_.secret, kv.key(), kv.value(), &body) == etcd_value::Signature::kValid &&
          etcd_value::DecodeMember(body, &holder);
      revoke();
      return Status::FailedPrecondition(fmt::format(
          "node id '{}' is held by a live node ({}) in etcd at {}; it is free once that node leaves or its lease "
          "ends",
          self.node_id,
          parsed ? fmt::format("epoch {}, transfer endpoint {}", holder.epoch, holder.transfer_endpoint)
                 : std::string("an unreadable member record"),
          EndpointList()));
    }
    // The epoch key changed between steps 1 and 3 (another join of this id that then ended): read it again.
  }
  revoke();
  return Status(StatusCode::kAborted,
                fmt::format("etcd key {} kept changing while node '{}' joined", epoch_key, self.node_id));
}

int EtcdDirectory::KeepAliveOnce(int64_t lease, milliseconds deadline) {
  int64_t ttl_left = -1;
  Status s = Call("LeaseKeepAlive", [&](Endpoint& ep, grpc::ClientContext& ctx) {
    // A short stream per keepalive: its deadline bounds the wait even when the store went silent.
    auto stream = ep.lease->LeaseKeepAlive(&ctx);
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseKeepAliveResponse resp;
    if (stream->Write(req) && stream->Read(&resp)) {
      ttl_left = resp.ttl();
      stream->WritesDone();
      (void)stream->Finish();  // the answer is in; how the stream ends does not matter
      return grpc::Status::OK;
    }
    grpc::Status st = stream->Finish();
    return st.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "keepalive stream ended without an answer") : st;
  }, deadline);
  if (s.ok()) return ttl_left > 0 ? 1 : 0;
  if (LeaseNotFound(s)) return 0;
  return -1;
}

void EtcdDirectory::MarkLeaseGone(int64_t lease) {
  MutexLock l(&mu_);
  if (lease_ == lease) joined_.store(false, std::memory_order_release);
}

void EtcdDirectory::KeepAliveLoop(int64_t lease, milliseconds ttl, steady_clock::time_point granted_at) {
  const auto period = std::max<milliseconds>(ttl / 3, milliseconds(100));
  const auto retry = std::max<milliseconds>(ttl / 10, milliseconds(50));
  const auto attempt_deadline = std::min<milliseconds>(options_.deadline, period);
  // Conservative: a keepalive counts from when it was sent, so the node believes itself out no later than etcd
  // drops it.
  steady_clock::time_point last_ok = granted_at;
  steady_clock::time_point next = granted_at + period;
  uint64_t failures = 0;
  for (;;) {
    {
      MutexLock l(&mu_);
      const auto wake = std::min(next, last_ok + ttl);
      while (!stop_ && steady_clock::now() < wake) mu_.WaitFor(&stop_cv_, wake - steady_clock::now());
      if (stop_) return;
    }
    if (steady_clock::now() - last_ok >= ttl) {
      MarkLeaseGone(lease);
      log::Warning(kLog, "etcd: no keepalive of lease {:x} succeeded for {} ms ({} failed): out of the cluster "
                   "until the next Join", lease, ttl.count(), failures);
      return;
    }
    if (keepalive_paused_.load(std::memory_order_acquire)) {
      next = steady_clock::now() + retry;
      continue;
    }
    const auto sent = steady_clock::now();
    const int r = KeepAliveOnce(lease, attempt_deadline);
    if (r == 1) {
      last_ok = sent;
      next = sent + period;
    } else if (r == 0) {
      MarkLeaseGone(lease);
      log::Warning(kLog, "etcd: lease {:x} is gone (expired or revoked): out of the cluster until the next Join",
                   lease);
      return;
    } else {
      ++failures;
      next = steady_clock::now() + retry;
    }
  }
}

void EtcdDirectory::StopKeepAlive() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (keepalive_.joinable()) keepalive_.join();
  MutexLock l(&mu_);
  stop_ = false;
}

Status EtcdDirectory::Leave() {
  MutexLock j(&join_mu_);
  StopKeepAlive();
  int64_t lease = 0;
  {
    MutexLock l(&mu_);
    lease = lease_;
    lease_ = 0;
    joined_.store(false, std::memory_order_release);
  }
  if (lease == 0) return Status::Ok();
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease);
  etcdserverpb::LeaseRevokeResponse resp;
  Status s = Call("LeaseRevoke", [&](Endpoint& ep, grpc::ClientContext& ctx) {
    return ep.lease->LeaseRevoke(&ctx, req, &resp);
  }, options_.deadline);
  if (LeaseNotFound(s)) return Status::Ok();  // it had ended already
  if (!s.ok()) return s.WithContext(fmt::format("Leave (the lease ends by itself within its ttl)"));
  log::Info(kLog, "left the cluster (lease {:x} revoked)", lease);
  return Status::Ok();
}

Status EtcdDirectory::ReleaseNodeId(const std::string& node_id, std::string_view expected_endpoint) {
  if (!ValidNodeId(node_id)) {
    return Status::InvalidArgument(
        fmt::format("node id '{}' must be 1..{} characters of [A-Za-z0-9._-]", node_id, kMaxNodeIdBytes));
  }
  {
    MutexLock l(&mu_);
    if (joined() && node_id_ == node_id) {
      return Status::FailedPrecondition(fmt::format("this client holds node id '{}'; Leave instead", node_id));
    }
  }
  // The record must be one this node can prove its own (signed with the secret, its endpoint the caller's): a forged
  // or another node's record keeps its lease. Revoking takes nothing but that record and the entries published under
  // the same lease.
  const std::string member_key = MemberKey(node_id);
  etcdserverpb::RangeRequest rreq;
  rreq.set_key(member_key);
  etcdserverpb::RangeResponse rresp;
  Status s = Call("Range", [&](Endpoint& ep, grpc::ClientContext& ctx) { return ep.kv->Range(&ctx, rreq, &rresp); },
                  options_.deadline);
  if (!s.ok()) return s;
  if (rresp.kvs_size() == 0) return Status::Ok();
  const int64_t lease = rresp.kvs(0).lease();
  std::string_view body;
  NodeInfo holder;
  if (!Authentic(member_key, rresp.kvs(0).value(), &body) || !etcd_value::DecodeMember(body, &holder)) {
    return Status::FailedPrecondition(fmt::format(
        "etcd key {} is not a member record signed with the cluster secret; its lease is left alone", member_key));
  }
  if (!expected_endpoint.empty() && holder.transfer_endpoint != expected_endpoint) {
    return Status::FailedPrecondition(fmt::format(
        "node id '{}' is held by a record of transfer endpoint {}, not {}: another node's, left alone", node_id,
        holder.transfer_endpoint, expected_endpoint));
  }
  if (lease == 0) {
    return Status::FailedPrecondition(fmt::format(
        "etcd key {} has no lease, so flexkvd did not write it; delete it (etcdctl del {}) only when no daemon runs "
        "as '{}'",
        member_key, member_key, node_id));
  }
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease);
  etcdserverpb::LeaseRevokeResponse resp;
  s = Call("LeaseRevoke", [&](Endpoint& ep, grpc::ClientContext& ctx) {
    return ep.lease->LeaseRevoke(&ctx, req, &resp);
  }, options_.deadline);
  if (LeaseNotFound(s)) return Status::Ok();  // it ended meanwhile
  if (!s.ok()) return s;
  log::Info(kLog, "released node id '{}': revoked lease {:x} of its previous holder", node_id, lease);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------------------------
// Members, Publish, Withdraw, Lookup

Result<std::vector<NodeInfo>> EtcdDirectory::Members() {
  const std::string prefix = options_.prefix + "members/";
  etcdserverpb::RangeRequest req;
  req.set_key(prefix);
  req.set_range_end(PrefixEnd(prefix));
  etcdserverpb::RangeResponse resp;
  Status s = Call("Range", [&](Endpoint& ep, grpc::ClientContext& ctx) { return ep.kv->Range(&ctx, req, &resp); },
                  options_.deadline);
  if (!s.ok()) return s;
  std::vector<NodeInfo> members;
  for (const auto& kv : resp.kvs()) {
    NodeInfo info;
    if (kv.key().size() <= prefix.size() || kv.key().compare(0, prefix.size(), prefix) != 0) {
      CountSkipped(kv.key(), "outside the members prefix");
      continue;
    }
    info.node_id = kv.key().substr(prefix.size());
    if (!ValidNodeId(info.node_id)) {
      CountSkipped(kv.key(), "not a valid node id");
      continue;
    }
    std::string_view body;
    if (!Authentic(kv.key(), kv.value(), &body)) continue;
    if (!etcd_value::DecodeMember(body, &info)) {
      CountSkipped(kv.key(), "not a member record");
      continue;
    }
    if (kv.lease() == 0) {  // flexkvd writes its member record under its lease, always
      CountUnauthenticated(kv.key(), "a member record without a lease (a copy of an old record?)");
      continue;
    }
    members.push_back(std::move(info));
  }
  return members;
}

Status EtcdDirectory::Publish(std::span<const DirectoryEntry> entries) {
  for (const auto& e : entries) {
    FLEXKV_RETURN_IF_ERROR(ValidateNamespace(e.model_namespace));
    if (e.blocks == 0) return Status::InvalidArgument("directory entry of 0 blocks");
  }
  std::string node_id;
  uint64_t epoch = 0;
  int64_t lease = 0;
  {
    MutexLock l(&mu_);
    node_id = node_id_;
    epoch = epoch_;
    lease = lease_;
  }
  if (!joined() || lease == 0) return Status::FailedPrecondition("Publish: not joined to the cluster");
  for (size_t begin = 0; begin < entries.size(); begin += kMaxTxnOps) {
    const size_t end = std::min(entries.size(), begin + kMaxTxnOps);
    etcdserverpb::TxnRequest txn;
    for (size_t i = begin; i < end; ++i) {
      auto* put = txn.add_success()->mutable_request_put();
      put->set_key(EntryKey(entries[i].model_namespace, entries[i].chunk_key, node_id));
      put->set_value(EncodeEntryValue(put->key(), epoch, entries[i].blocks));
      put->set_lease(lease);
    }
    etcdserverpb::TxnResponse resp;
    Status s = Call("Txn", [&](Endpoint& ep, grpc::ClientContext& ctx) { return ep.kv->Txn(&ctx, txn, &resp); },
                    options_.deadline);
    if (LeaseNotFound(s)) {
      MarkLeaseGone(lease);
      return Status::FailedPrecondition(
          fmt::format("Publish: the lease of node '{}' (epoch {}) is gone; Join again", node_id, epoch));
    }
    FLEXKV_RETURN_IF_ERROR(s);
  }
  return Status::Ok();
}

Status EtcdDirectory::Withdraw(std::span<const DirectoryEntry> entries) {
  for (const auto& e : entries) FLEXKV_RETURN_IF_ERROR(ValidateNamespace(e.model_namespace));
  std::string node_id;
  {
    MutexLock l(&mu_);
    node_id = node_id_;
  }
  if (!joined()) return Status::FailedPrecondition("Withdraw: not joined to the cluster");
  for (size_t begin = 0; begin < entries.size(); begin += kMaxTxnOps) {
    const size_t end = std::min(entries.size(), begin + kMaxTxnOps);
    etcdserverpb::TxnRequest txn;
    for (size_t i = begin; i < end; ++i) {
      txn.add_success()->mutable_request_delete_range()->set_key(
          EntryKey(entries[i].model_namespace, entries[i].chunk_key, node_id));
    }
    etcdserverpb::TxnResponse resp;
    FLEXKV_RETURN_IF_ERROR(Call("Txn", [&](Endpoint& ep, grpc::ClientContext& ctx) {
      return ep.kv->Txn(&ctx, txn, &resp);
    }, options_.deadline));
  }
  return Status::Ok();
}

Result<std::vector<std::vector<Owner>>> EtcdDirectory::Lookup(const std::string& model_namespace,
                                                              std::span<const BlockKey> chunk_keys) {
  FLEXKV_RETURN_IF_ERROR(ValidateNamespace(model_namespace));
  std::string self;
  {
    MutexLock l(&mu_);
    self = node_id_;
  }
  const std::string members_prefix = options_.prefix + "members/";
  const std::string ns_prefix = options_.prefix + "dir/" + EscapeNamespace(model_namespace) + "/";
  std::vector<std::vector<Owner>> owners(chunk_keys.size());
  for (size_t begin = 0; begin < chunk_keys.size(); begin += kLookupBatch) {
    const size_t end = std::min(chunk_keys.size(), begin + kLookupBatch);
    // One Txn: the members (their current epochs), then one prefix Range per key. Serializable: served by the
    // member it reaches; a stale answer costs at most a failed pull, which the puller verifies anyway.
    etcdserverpb::TxnRequest txn;
    auto* members = txn.add_success()->mutable_request_range();
    members->set_key(members_prefix);
    members->set_range_end(PrefixEnd(members_prefix));
    members->set_serializable(true);
    std::vector<std::string> key_prefixes;
    for (size_t i = begin; i < end; ++i) {
      key_prefixes.push_back(ns_prefix + chunk_keys[i].ToHex() + "/");
      auto* r = txn.add_success()->mutable_request_range();
      r->set_key(key_prefixes.back());
      r->set_range_end(PrefixEnd(key_prefixes.back()));
      r->set_serializable(true);
    }
    etcdserverpb::TxnResponse resp;
    Status s = Call("Txn", [&](Endpoint& ep, grpc::ClientContext& ctx) { return ep.kv->Txn(&ctx, txn, &resp); },
                    options_.deadline);
    if (!s.ok()) return s;
    if (static_cast<size_t>(resp.responses_size()) != 1 + (end - begin)) {
      return Status::Internal(fmt::format("etcd Txn of {} ranges answered {} responses", 1 + (end - begin),
                                          resp.responses_size()));
    }
    std::unordered_map<std::string, uint64_t> live;  // node id -> current epoch
    for (const auto& kv : resp.responses(0).response_range().kvs()) {
      NodeInfo info;
      if (kv.key().size() <= members_prefix.size() || kv.key().compare(0, members_prefix.size(), members_prefix) != 0 ||
          !ValidNodeId(std::string_view(kv.key()).substr(members_prefix.size()))) {
        CountSkipped(kv.key(), "not a member record");
        continue;
      }
      std::string_view body;
      if (!Authentic(kv.key(), kv.value(), &body)) continue;
      if (!etcd_value::DecodeMember(body, &info)) {
        CountSkipped(kv.key(), "not a member record");
        continue;
      }
      if (kv.lease() == 0) {
        CountUnauthenticated(kv.key(), "a member record without a lease (a copy of an old record?)");
        continue;
      }
      live.emplace(kv.key().substr(members_prefix.size()), info.epoch);
    }
    for (size_t i = begin; i < end; ++i) {
      const std::string& key_prefix = key_prefixes[i - begin];
      for (const auto& kv : resp.responses(static_cast<int>(1 + i - begin)).response_range().kvs()) {
        if (kv.key().size() <= key_prefix.size() || kv.key().compare(0, key_prefix.size(), key_prefix) != 0) {
          CountSkipped(kv.key(), "outside the range asked for");
          continue;
        }
        std::string node = kv.key().substr(key_prefix.size());
        uint64_t epoch = 0;
        uint32_t blocks = 0;
        if (!ValidNodeId(node)) {
          CountSkipped(kv.key(), "not a directory entry");
          continue;
        }
        std::string_view body;
        if (!Authentic(kv.key(), kv.value(), &body)) continue;
        if (!etcd_value::DecodeEntry(body, &epoch, &blocks)) {
          CountSkipped(kv.key(), "not a directory entry");
          continue;
        }
        if (node == self) continue;
        auto it = live.find(node);
        if (it == live.end() || it->second != epoch) continue;  // a dead node's, or an earlier epoch's
        owners[i].push_back(Owner{std::move(node), epoch});
      }
    }
  }
  return owners;
}

}  // namespace flexkv::cluster

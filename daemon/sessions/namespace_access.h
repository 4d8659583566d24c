// NamespaceAccess: who may read (match, load) and who may write (store) a namespace's blocks. Decided once per
// session at Attach, never per request: the data plane only sees the session's SessionAccess.
//
// The trust model (docs/operations.md, "Security"): the socket's mode and group say who may connect at all.
// A namespace with an operator ACL ([namespace."<name>"] in --config) is read by its `readers` (everyone who may
// connect when absent) and written by its `writers` only. A namespace without one is read by everyone who may
// connect and written only by the uid whose Attach created it (kept in the pool file across restarts). Admins
// (root, the daemon's uid, --admin-group) may always read and write.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/uds.h"
#include "flexkv/status.h"

namespace flexkv {

// One entry of an ACL list, resolved to an id when the config is read.
struct AccessPrincipal {
  enum class Kind : uint8_t { kUser, kGroup };
  Kind kind = Kind::kUser;
  uint32_t id = 0;   // uid or gid
  std::string text;  // as the config wrote it ("alice", "1000", "group:inference"), for messages

  // A user matches the peer's uid; a group the peer's primary gid or one of its supplementary groups as the
  // kernel reported them for the connection (SO_PEERGROUPS).
  bool Matches(const PeerCredentials& peer) const;
};

// An operator-set ACL of one namespace.
struct NamespaceAcl {
  std::vector<AccessPrincipal> writers;                 // may store; empty: admins only
  std::optional<std::vector<AccessPrincipal>> readers;  // may attach, match and load; none: everyone who may connect
  std::string source;                                   // where it was set ("/etc/flexkvd.toml line 12"), for messages
};

// What a session may do with its namespace's blocks, decided at Attach.
struct SessionAccess {
  // OK when the session may store; otherwise the error every Store of the session is answered with
  // (PERMISSION_DENIED naming the namespace, the session's uid and who its writers are).
  Status store;
  // OK when the session may Prefetch with pulls from peers (which stores the pulled blocks in its namespace: the
  // same right as store); otherwise the error such a Prefetch is answered with (PERMISSION_DENIED naming the
  // namespace, the session's uid and the missing right).
  Status prefetch;
  bool may_store() const { return store.ok(); }
};

// The access rules of the daemon: the ACLs from the config, keyed by namespace. Immutable; thread-safe.
class NamespaceAccess {
 public:
  NamespaceAccess() = default;
  explicit NamespaceAccess(std::map<std::string, NamespaceAcl, std::less<>> acls) : acls_(std::move(acls)) {}

  // OK when `peer` may read `model_namespace` (attach to it, match, load). `admin`: the peer is an admin (always
  // allowed). PERMISSION_DENIED naming the namespace, the peer's uid and the ACL's readers and source otherwise.
  // A writer may always read.
  Status CheckReader(std::string_view model_namespace, const PeerCredentials& peer, bool admin) const;

  // Whether `peer` may read a domain named in the KV events, where a domain the daemon knows only from SSD blocks is
  // named "#" and the 16 hex digits of its namespace's hash (docs/kv_events.md): such a name is readable only when
  // every ACL'd namespace with that hash, and the name itself, let the peer read.
  bool MayReadDomainNamed(std::string_view domain_name, const PeerCredentials& peer, bool admin) const;

  // What a session of `peer` (a reader) may do in `model_namespace`, whose domain was created by `creator_uid`
  // (nullopt: unknown, then only admins write a namespace without an ACL).
  SessionAccess Decide(std::string_view model_namespace, const PeerCredentials& peer, bool admin,
                       std::optional<uid_t> creator_uid) const;

  // The namespace's ACL, or nullptr when it has none.
  const NamespaceAcl* AclOf(std::string_view model_namespace) const;

 private:
  std::map<std::string, NamespaceAcl, std::less<>> acls_;
};

}  // namespace flexkv

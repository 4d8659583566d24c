// Who may read and write a namespace's blocks; see namespace_access.h.
#include "daemon/sessions/namespace_access.h"

#include <fmt/format.h>

#include <algorithm>

#include "flexkv/block_key.h"

namespace flexkv {
namespace {

bool AnyMatches(const std::vector<AccessPrincipal>& list, const PeerCredentials& peer) {
  return std::any_of(list.begin(), list.end(), [&](const AccessPrincipal& p) { return p.Matches(peer); });
}

std::string ListText(const std::vector<AccessPrincipal>& list) {
  std::string out = "[";
  for (size_t i = 0; i < list.size(); ++i) {
    if (i > 0) out += ", ";
    out += list[i].text;
  }
  return out + "]";
}

}  // namespace

bool AccessPrincipal::Matches(const PeerCredentials& peer) const {
  return kind == Kind::kUser ? peer.uid == id : peer.InGroup(id);
}

const NamespaceAcl* NamespaceAccess::AclOf(std::string_view model_namespace) const {
  auto it = acls_.find(model_namespace);
  return it == acls_.end() ? nullptr : &it->second;
}

Status NamespaceAccess::CheckReader(std::string_view model_namespace, const PeerCredentials& peer, bool admin) const {
  const NamespaceAcl* acl = AclOf(model_namespace);
  if (admin || acl == nullptr || !acl->readers || AnyMatches(*acl->readers, peer) || AnyMatches(acl->writers, peer)) {
    return Status::Ok();
  }
  return Status::PermissionDenied(fmt::format(
      "uid {} (pid {}) may not use namespace '{}': its readers are {} and its writers {} ({}), besides admins; "
      "expected a listed user or a member of a listed group (ask the operator)",
      peer.uid, peer.pid, model_namespace, ListText(*acl->readers), ListText(acl->writers), acl->source));
}

bool NamespaceAccess::MayReadDomainNamed(std::string_view domain_name, const PeerCredentials& peer, bool admin) const {
  if (admin) return true;
  if (!CheckReader(domain_name, peer, admin).ok()) return false;
  if (domain_name.size() != 17 || domain_name[0] != '#') return true;
  uint64_t hash = 0;
  for (const char c : domain_name.substr(1)) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return true;  // not a hash name: the name's own ACL decided
    hash = hash << 4 | static_cast<uint64_t>(digit);
  }
  for (const auto& [name, acl] : acls_) {
    if (NamespaceHash(name) == hash && !CheckReader(name, peer, admin).ok()) return false;
  }
  return true;
}

// The refusal reaches the client in a completion's 88-byte message: who, the namespace and where its writers come
// from lead, the rest (the list, which may be long) follows. A read-only session's Prefetch is refused as well: it
// would store the blocks it pulls from peers into the namespace.
SessionAccess NamespaceAccess::Decide(std::string_view model_namespace, const PeerCredentials& peer, bool admin,
                                      std::optional<uid_t> creator_uid) const {
  if (admin) return SessionAccess{Status::Ok(), Status::Ok()};
  const auto read_only = [&](std::string writers) {
    return SessionAccess{
        Status::PermissionDenied(fmt::format(
            "uid {} may not store in namespace '{}': {}; admins may too; this session may match and load only",
            peer.uid, model_namespace, writers)),
        Status::PermissionDenied(fmt::format(
            "uid {} may not prefetch into namespace '{}': it lacks the store right that pulled blocks need ({}); "
            "Match instead",
            peer.uid, model_namespace, writers))};
  };
  if (const NamespaceAcl* acl = AclOf(model_namespace)) {
    if (AnyMatches(acl->writers, peer)) return SessionAccess{Status::Ok(), Status::Ok()};
    return read_only(fmt::format("its writers are set by {}: {}", acl->source, ListText(acl->writers)));
  }
  if (creator_uid && *creator_uid == peer.uid) return SessionAccess{Status::Ok(), Status::Ok()};
  return read_only(creator_uid ? fmt::format("its writer is uid {}, which created it, as the config sets no ACL for it",
                                             *creator_uid)
                               : std::string("its writer is unknown (no creator recorded), as the config sets no ACL "
                                             "for it"));
}

}  // namespace flexkv

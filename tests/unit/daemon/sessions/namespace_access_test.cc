// NamespaceAccess: without an ACL everyone reads and only the creator uid (and admins) writes; with one, its
// writers write (the creator default is ignored) and its readers (plus writers and admins) may attach. Group
// entries match the primary gid or a supplementary group of the peer.
#include "daemon/sessions/namespace_access.h"

#include <fmt/format.h>

#include <catch2/catch.hpp>

#include "flexkv/block_key.h"

using flexkv::AccessPrincipal;
using flexkv::NamespaceAccess;
using flexkv::NamespaceAcl;
using flexkv::PeerCredentials;
using flexkv::StatusCode;

namespace {

PeerCredentials Peer(uid_t uid, gid_t gid = 100, std::vector<gid_t> groups = {}) {
  PeerCredentials p;
  p.pid = 42;
  p.uid = uid;
  p.gid = gid;
  p.groups = std::move(groups);
  return p;
}

AccessPrincipal User(uint32_t uid, std::string text) { return {AccessPrincipal::Kind::kUser, uid, std::move(text)}; }
AccessPrincipal Group(uint32_t gid, std::string text) { return {AccessPrincipal::Kind::kGroup, gid, std::move(text)}; }

NamespaceAccess WithAcl(std::vector<AccessPrincipal> writers, std::optional<std::vector<AccessPrincipal>> readers) {
  std::map<std::string, NamespaceAcl, std::less<>> acls;
  acls["llama"] = NamespaceAcl{std::move(writers), std::move(readers), "--config /etc/flexkvd.toml line 3"};
  return NamespaceAccess(std::move(acls));
}

}  // namespace

TEST_CASE("namespace access: without an ACL everyone reads, the creator and admins write", "[unit][security]") {
  const NamespaceAccess access;
  CHECK(access.CheckReader("llama", Peer(1001), false).ok());
  CHECK(access.Decide("llama", Peer(1000), false, 1000).may_store());
  CHECK(access.Decide("llama", Peer(0), true, 1000).may_store());
  const auto other = access.Decide("llama", Peer(1001), false, 1000);
  CHECK_FALSE(other.may_store());
  CHECK(other.store.code() == StatusCode::kPermissionDenied);
  CHECK(other.store.message() ==
        "uid 1001 may not store in namespace 'llama': its writer is uid 1000, which created it, as the config sets no "
        "ACL for it; admins may too; this session may match and load only");
  // A group does not stand in for the creator's uid.
  CHECK_FALSE(access.Decide("llama", Peer(1001, 1000, {1000}), false, 1000).may_store());
  CHECK_FALSE(access.Decide("llama", Peer(1001), false, std::nullopt).may_store());
}

TEST_CASE("namespace access: an ACL's writers write, whoever created the namespace", "[unit][security]") {
  const NamespaceAccess access = WithAcl({User(1001, "alice"), Group(500, "group:inference")}, std::nullopt);
  CHECK(access.Decide("llama", Peer(1001), false, 1000).may_store());
  CHECK(access.Decide("llama", Peer(1002, 500), false, 1000).may_store());         // primary group
  CHECK(access.Decide("llama", Peer(1003, 100, {7, 500}), false, 1000).may_store());  // supplementary group
  CHECK(access.Decide("llama", Peer(0), true, 1000).may_store());                  // admin
  const auto creator = access.Decide("llama", Peer(1000), false, 1000);
  CHECK(creator.store.message() ==
        "uid 1000 may not store in namespace 'llama': its writers are set by --config /etc/flexkvd.toml line 3: "
        "[alice, group:inference]; admins may too; this session may match and load only");
  // Readers absent: everyone who may connect reads.
  CHECK(access.CheckReader("llama", Peer(2000), false).ok());
  // Another namespace has no ACL: the creator default holds there.
  CHECK(access.Decide("qwen", Peer(1000), false, 1000).may_store());
  CHECK_FALSE(access.Decide("qwen", Peer(1001), false, 1000).may_store());
}

TEST_CASE("namespace access: an ACL's readers, its writers and admins may attach, nobody else", "[unit][security]") {
  const NamespaceAccess access = WithAcl({User(1001, "alice")}, std::vector{Group(600, "group:serving")});
  CHECK(access.CheckReader("llama", Peer(2000, 600), false).ok());
  CHECK(access.CheckReader("llama", Peer(2001, 100, {600}), false).ok());
  CHECK(access.CheckReader("llama", Peer(1001), false).ok());  // a writer reads
  CHECK(access.CheckReader("llama", Peer(0), true).ok());
  const auto refused = access.CheckReader("llama", Peer(2002), false);
  CHECK(refused.code() == StatusCode::kPermissionDenied);
  CHECK(refused.message() ==
        "uid 2002 (pid 42) may not use namespace 'llama': its readers are [group:serving] and its writers [alice] "
        "(--config /etc/flexkvd.toml line 3), besides admins; expected a listed user or a member of a listed group "
        "(ask the operator)");
  CHECK_FALSE(access.Decide("llama", Peer(2000, 600), false, 2000).may_store());  // a reader only
  const NamespaceAccess admins_only = WithAcl({}, std::nullopt);
  CHECK_FALSE(admins_only.Decide("llama", Peer(1000), false, 1000).may_store());
  CHECK(admins_only.Decide("llama", Peer(0), true, 1000).may_store());
}

// The KV events name a domain the daemon knows only from SSD blocks "#<hash>" (issue 29 item 4: a subscriber sees the
// domains it may read): such a name is readable only when the ACL'd namespace with that hash lets the peer read.
TEST_CASE("namespace access: a domain named by its namespace's hash follows that namespace's readers",
          "[unit][security]") {
  const NamespaceAccess access = WithAcl({User(1000, "alice")}, std::vector<AccessPrincipal>{User(1001, "bob")});
  const std::string hashed = fmt::format("#{:016x}", flexkv::NamespaceHash("llama"));
  CHECK(access.MayReadDomainNamed("llama", Peer(1001), false));
  CHECK(access.MayReadDomainNamed("llama", Peer(1000), false));  // a writer reads
  CHECK_FALSE(access.MayReadDomainNamed("llama", Peer(1002), false));
  CHECK(access.MayReadDomainNamed(hashed, Peer(1001), false));
  CHECK_FALSE(access.MayReadDomainNamed(hashed, Peer(1002), false));
  CHECK(access.MayReadDomainNamed(hashed, Peer(1002), true));  // admins read all
  // Other namespaces, hashed or not, have no ACL: everyone reads them.
  CHECK(access.MayReadDomainNamed("mistral", Peer(1002), false));
  CHECK(access.MayReadDomainNamed(fmt::format("#{:016x}", flexkv::NamespaceHash("mistral")), Peer(1002), false));
  CHECK(access.MayReadDomainNamed("#not-a-hash-name", Peer(1002), false));
}

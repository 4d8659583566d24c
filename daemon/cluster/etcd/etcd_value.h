// The values the etcd directory writes and reads back (etcd_directory.h says under which keys): 'F', a kind byte
// ('M' member, 'E' epoch, 'D' entry), a version byte, little-endian fields, then (version 2) HMAC-SHA256 under the
// cluster secret over the key and everything before it. Decoders take untrusted bytes: every length and field is
// checked, and a value that does not parse is refused (false), never trusted in part.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "daemon/cluster/directory.h"

namespace flexkv::cluster::etcd_value {

// 2: signed (a trailing HMAC-SHA256 under the cluster secret, over the key and the value before it). 1: unsigned,
// written by flexkvd before issue 29: ignored and counted (an epoch record of 1 is still read, see Join).
inline constexpr char kVersion = 2;
inline constexpr char kUnsignedVersion = 1;

// The bodies, unsigned (Signed appends the signature).
std::string EncodeMember(uint64_t epoch, const std::string& endpoint, const std::string& pool_info);
std::string EncodeEpoch(uint64_t epoch);
std::string EncodeEntry(uint64_t epoch, uint32_t blocks);

// Parse a body (the value without its signature) of `version`; false when it is not exactly one such record (a
// field out of range included: a zero epoch, an empty endpoint, zero blocks). *info / *epoch / *blocks may be
// partly written then.
bool DecodeMember(std::string_view v, NodeInfo* info);
bool DecodeEpoch(std::string_view v, uint64_t* epoch, char version = kVersion);
bool DecodeEntry(std::string_view v, uint64_t* epoch, uint32_t* blocks);

// `body` with the signature of (key, body) under `secret` appended: a value signed for one key never verifies
// under another.
std::string Signed(const std::string& secret, std::string_view key, std::string body);

// What a value read back from the store is, before it is parsed.
enum class Signature { kValid, kUnsigned, kBad };
// Checks the signature of a value of version 2 and cuts it off (*body: the value without it). A value of version 1
// is kUnsigned (*body: the whole value); anything else that is not version 2 with a valid MAC is kBad.
Signature CheckSignature(const std::string& secret, std::string_view key, std::string_view value,
                         std::string_view* body);

}  // namespace flexkv::cluster::etcd_value

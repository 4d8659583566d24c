// See etcd_value.h. Split from etcd_directory.cc: the value codec and its signature, apart from the store protocol.
#include "daemon/cluster/etcd/etcd_value.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

namespace flexkv::cluster::etcd_value {
namespace {

constexpr char kMagic = 'F';
constexpr char kKindMember = 'M';
constexpr char kKindEpoch = 'E';
constexpr char kKindEntry = 'D';
constexpr size_t kMacBytes = 32;

void PutHeader(std::string& s, char kind) {
  s.push_back(kMagic);
  s.push_back(kind);
  s.push_back(kVersion);
}
void PutU64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// HMAC-SHA256(secret, "flexkv-etcd-v2" | key | body), each field preceded by its length (u32 little endian), so
// that a value signed for one key never verifies under another.
std::string ValueMac(const std::string& secret, std::string_view key, std::string_view body) {
  std::string input;
  for (std::string_view f : {std::string_view("flexkv-etcd-v2"), key, body}) {
    PutU32(input, static_cast<uint32_t>(f.size()));
    input.append(f);
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(input.data()), input.size(), out, &len) == nullptr ||
      len != kMacBytes) {
    return std::string();  // never verifies
  }
  return std::string(reinterpret_cast<const char*>(out), len);
}

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  bool Header(char kind, char version = kVersion) {
    if (s_.size() < 3 || s_[0] != kMagic || s_[1] != kind || s_[2] != version) return false;
    s_.remove_prefix(3);
    return true;
  }
  bool U64(uint64_t* v) { return Fixed(8, v); }
  bool U32(uint32_t* v) {
    uint64_t x = 0;
    if (!Fixed(4, &x)) return false;
    *v = static_cast<uint32_t>(x);
    return true;
  }
  // A u32 length, then that many bytes (at most `max`).
  bool Bytes(size_t max, std::string* out) {
    uint32_t n = 0;
    if (!U32(&n) || n > max || n > s_.size()) return false;
    out->assign(s_.substr(0, n));
    s_.remove_prefix(n);
    return true;
  }
  bool done() const { return s_.empty(); }

 private:
  bool Fixed(size_t n, uint64_t* v) {
    if (s_.size() < n) return false;
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i) x |= static_cast<uint64_t>(static_cast<unsigned char>(s_[i])) << (8 * i);
    s_.remove_prefix(n);
    *v = x;
    return true;
  }
  std::string_view s_;
};

}  // namespace

std::string Signed(const std::string& secret, std::string_view key, std::string body) {
  body += ValueMac(secret, key, body);
  return body;
}

Signature CheckSignature(const std::string& secret, std::string_view key, std::string_view value,
                         std::string_view* body) {
  if (value.size() >= 3 && value[0] == kMagic && value[2] == kUnsignedVersion) {
    *body = value;
    return Signature::kUnsigned;
  }
  if (value.size() < 3 + kMacBytes || value[0] != kMagic || value[2] != kVersion) return Signature::kBad;
  *body = value.substr(0, value.size() - kMacBytes);
  const std::string expected = ValueMac(secret, key, *body);
  if (expected.size() != kMacBytes ||
      CRYPTO_memcmp(expected.data(), value.data() + body->size(), kMacBytes) != 0) {
    return Signature::kBad;
  }
  return Signature::kValid;
}

std::string EncodeMember(uint64_t epoch, const std::string& endpoint, const std::string& pool_info) {
  std::string s;
  PutHeader(s, kKindMember);
  PutU64(s, epoch);
  PutU32(s, static_cast<uint32_t>(endpoint.size()));
  s += endpoint;
  PutU32(s, static_cast<uint32_t>(pool_info.size()));
  s += pool_info;
  return s;
}
bool DecodeMember(std::string_view v, NodeInfo* info) {
  Reader r(v);
  return r.Header(kKindMember) && r.U64(&info->epoch) && info->epoch > 0 &&
         r.Bytes(kMaxEndpointBytes, &info->transfer_endpoint) && !info->transfer_endpoint.empty() &&
         r.Bytes(kMaxPoolInfoBytes, &info->pool_info) && r.done();
}
std::string EncodeEpoch(uint64_t epoch) {
  std::string s;
  PutHeader(s, kKindEpoch);
  PutU64(s, epoch);
  return s;
}
bool DecodeEpoch(std::string_view v, uint64_t* epoch, char version) {
  Reader r(v);
  return r.Header(kKindEpoch, version) && r.U64(epoch) && *epoch > 0 && r.done();
}
std::string EncodeEntry(uint64_t epoch, uint32_t blocks) {
  std::string s;
  PutHeader(s, kKindEntry);
  PutU64(s, epoch);
  PutU32(s, blocks);
  return s;
}
bool DecodeEntry(std::string_view v, uint64_t* epoch, uint32_t* blocks) {
  Reader r(v);
  return r.Header(kKindEntry) && r.U64(epoch) && *epoch > 0 && r.U32(blocks) && *blocks > 0 && r.done();
}

}  // namespace flexkv::cluster::etcd_value

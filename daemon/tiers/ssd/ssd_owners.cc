// See ssd_owners.h. The file is text, so an operator can read it (`cat DIR/flexkv-owners`):
//   flexkv-owners 1                     magic and version
//   sequence <n>                        bumped at every write: the newest valid copy wins
//   owner <uid> <namespace>             one per namespace; the namespace is the rest of the line
//   xxh3 <16 hex digits>                XXH3-64 of every byte before this line
// A namespace passes CheckName (no control characters, so no newline), 1..256 bytes.
#include "daemon/tiers/ssd/ssd_owners.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/log.h"
#include "common/unique_fd.h"
#include "daemon/cache/cache_domain.h"
#include "daemon/tiers/ssd/ssd_block_file.h"

namespace flexkv {
namespace {

constexpr std::string_view kMagic = "flexkv-owners";
constexpr size_t kMaxFileBytes = size_t{16} << 20;  // far above any real record (~100 bytes a namespace)
constexpr size_t kMaxOwners = 65536;

std::string FilePath(const std::string& dir) { return dir + (dir.ends_with('/') ? "" : "/") + kSsdOwnersFileName; }

template <typename T>
bool ParseNumber(std::string_view s, T* out, int base = 10) {
  if (s.empty()) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, base);
  return ec == std::errc() && end == s.data() + s.size();
}

Status WriteFileAtomically(const std::string& dir, const std::string& text) {
  const std::string path = FilePath(dir);
  const std::string tmp = path + ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) return SsdErrnoStatus(errno, fmt::format("create {}", tmp));
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : ENOSPC;
        ::unlink(tmp.c_str());
        return SsdErrnoStatus(err, fmt::format("write {}", tmp));
      }
      done += static_cast<size_t>(n);
    }
    if (::fsync(fd.get()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      return SsdErrnoStatus(err, fmt::format("fsync {}", tmp));
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return SsdErrnoStatus(err, fmt::format("rename {} to {}", tmp, path));
  }
  UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d) (void)::fsync(d.get());  // the rename itself survives a power cut
  return Status::Ok();
}

}  // namespace

SsdOwners::SsdOwners(std::vector<std::string> paths) : paths_(std::move(paths)) {}

std::string SsdOwners::Encode(const std::map<std::string, uid_t, std::less<>>& owners, uint64_t sequence) {
  std::string text = fmt::format("{} {}\nsequence {}\n", kMagic, kSsdOwnersVersion, sequence);
  for (const auto& [ns, uid] : owners) text += fmt::format("owner {} {}\n", uid, ns);
  text += fmt::format("xxh3 {:016x}\n", XXH3_64bits(text.data(), text.size()));
  return text;
}

Result<SsdOwners::Decoded> SsdOwners::Decode(std::string_view text) {
  if (text.size() > kMaxFileBytes) {
    return Status::InvalidArgument(fmt::format("{} bytes; expected at most {}", text.size(), kMaxFileBytes));
  }
  // The checksum line is the last one.
  if (!text.ends_with('\n')) return Status::InvalidArgument("it does not end with a newline (cut short?)");
  const size_t last = text.rfind('\n', text.size() - 2);
  const size_t sum_at = last == std::string_view::npos ? 0 : last + 1;
  const std::string_view sum_line = text.substr(sum_at, text.size() - 1 - sum_at);
  uint64_t sum = 0;
  if (!sum_line.starts_with("xxh3 ") || sum_line.size() != 5 + 16 || !ParseNumber(sum_line.substr(5), &sum, 16)) {
    return Status::InvalidArgument("its last line is not 'xxh3 <16 hex digits>' (cut short or edited?)");
  }
  const std::string_view body = text.substr(0, sum_at);
  if (XXH3_64bits(body.data(), body.size()) != sum) {
    return Status::InvalidArgument(fmt::format("its checksum does not match (xxh3 {:016x} recorded, {:016x} of the "
                                               "bytes): damaged or edited",
                                               sum, XXH3_64bits(body.data(), body.size())));
  }
  Decoded out;
  size_t pos = 0;
  size_t line_no = 0;
  while (pos < body.size()) {
    const size_t nl = body.find('\n', pos);
    const std::string_view line = body.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (line_no == 1) {
      uint32_t version = 0;
      if (!line.starts_with(kMagic) || line.size() <= kMagic.size() + 1 || line[kMagic.size()] != ' ' ||
          !ParseNumber(line.substr(kMagic.size() + 1), &version)) {
        return Status::InvalidArgument("its first line is not 'flexkv-owners <version>': not an owners record");
      }
      if (version != kSsdOwnersVersion) {
        return Status::FailedPrecondition(
            fmt::format("it is of version {}; this flexkvd reads version {}", version, kSsdOwnersVersion));
      }
      continue;
    }
    if (line_no == 2) {
      if (!line.starts_with("sequence ") || !ParseNumber(line.substr(9), &out.sequence)) {
        return Status::InvalidArgument("line 2 is not 'sequence <n>'");
      }
      continue;
    }
    if (!line.starts_with("owner ")) {
      return Status::InvalidArgument(fmt::format("line {} is not 'owner <uid> <namespace>'", line_no));
    }
    const std::string_view rest = line.substr(6);
    const size_t space = rest.find(' ');
    uid_t uid = 0;
    if (space == std::string_view::npos || !ParseNumber(rest.substr(0, space), &uid) || uid == static_cast<uid_t>(-1)) {
      return Status::InvalidArgument(fmt::format("line {}: expected 'owner <uid> <namespace>' with a uid below 2^32-1",
                                                 line_no));
    }
    const std::string_view ns = rest.substr(space + 1);
    if (Status valid = CheckName("namespace", ns, 256); !valid.ok()) {
      return valid.WithContext(fmt::format("line {}", line_no));
    }
    if (out.owners.size() >= kMaxOwners) {
      return Status::InvalidArgument(fmt::format("more than {} namespaces", kMaxOwners));
    }
    if (!out.owners.emplace(std::string(ns), uid).second) {
      return Status::InvalidArgument(fmt::format("line {}: namespace '{}' is listed twice", line_no, ns));
    }
  }
  if (line_no < 2) return Status::InvalidArgument("it has no 'sequence' line");
  return out;
}

void SsdOwners::Load(std::vector<std::string>* warnings) {
  MutexLock lock(&mu_);
  bool found = false;
  for (const std::string& dir : paths_) {
    const std::string path = FilePath(dir);
    std::ifstream in(path, std::ios::binary);
    if (!in.is_open()) continue;  // no record (yet)
    std::string text;
    text.resize(kMaxFileBytes + 1);
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(in.gcount()));
    Result<Decoded> decoded = Decode(text);
    if (!decoded.ok()) {
      const std::string w = fmt::format(
          "namespace owners record {} is ignored: {}. Namespaces it named have no recorded owner unless another "
          "--ssd-path holds a valid copy; their next Attach without an ACL makes its uid the owner (set [namespace] "
          "writers in --config to decide, or remove the file)",
          path, decoded.status().message());
      log::Warning("ssd", "{}", w);
      if (warnings) warnings->push_back(w);
      continue;
    }
    if (!found || decoded->sequence > sequence_) {
      owners_ = std::move(decoded->owners);
      sequence_ = decoded->sequence;
      found = true;
    }
  }
  if (found) log::Info("ssd", "namespace owners restored from the SSD tier: {} namespace(s)", owners_.size());
}

std::optional<uid_t> SsdOwners::OwnerOf(std::string_view model_namespace) const {
  MutexLock lock(&mu_);
  auto it = owners_.find(model_namespace);
  if (it == owners_.end()) return std::nullopt;
  return it->second;
}

std::map<std::string, uid_t, std::less<>> SsdOwners::Owners() const {
  MutexLock lock(&mu_);
  return owners_;
}

Result<uid_t> SsdOwners::Record(std::string_view model_namespace, uid_t uid) {
  MutexLock lock(&mu_);
  auto [it, added] = owners_.try_emplace(std::string(model_namespace), uid);
  if (!added && !dirty_) return it->second;
  // What Decode would refuse at the next start is never written: a record it dropped whole would hand every
  // namespace on SSD to the first uid that attaches. The namespace over the limit keeps its blocks in DRAM.
  if (added && (owners_.size() > kMaxOwners || Encode(owners_, sequence_ + 1).size() > kMaxFileBytes)) {
    owners_.erase(it);
    return Status::ResourceExhausted(fmt::format(
        "the SSD owner record is full ({} namespaces; at most {} namespaces in {} bytes): namespace '{}' is not "
        "recorded, so its blocks stay in DRAM until namespaces without blocks on SSD are forgotten at the next start",
        owners_.size(), kMaxOwners, kMaxFileBytes, model_namespace));
  }
  FLEXKV_RETURN_IF_ERROR(WriteLocked());
  return it->second;
}

Status SsdOwners::Retain(const std::function<bool(std::string_view)>& keep) {
  MutexLock lock(&mu_);
  bool changed = false;
  for (auto it = owners_.begin(); it != owners_.end();) {
    if (keep(it->first)) {
      ++it;
    } else {
      log::Info("ssd", "namespace '{}' has no block on SSD any more: its recorded owner uid {} is forgotten", it->first,
                it->second);
      it = owners_.erase(it);
      changed = true;
    }
  }
  if (!changed && !dirty_) return Status::Ok();
  return WriteLocked();
}

Status SsdOwners::WriteLocked() {
  ++sequence_;
  const std::string text = Encode(owners_, sequence_);
  Status first;
  size_t written = 0;
  for (const std::string& dir : paths_) {
    Status s = WriteFileAtomically(dir, text);
    if (s.ok()) {
      ++written;
    } else if (first.ok()) {
      first = s;
    }
  }
  // One good copy is enough to restore the owners; the others are retried at the next change.
  dirty_ = written < paths_.size();
  if (written == 0 && !paths_.empty()) {
    return first.WithContext("the namespace owners record could not be written to any --ssd-path");
  }
  return Status::Ok();
}

}  // namespace flexkv

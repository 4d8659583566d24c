// SsdOwners: who owns each namespace whose blocks the SSD tier keeps (issue 29 item 5). Without a config ACL only
// a namespace's creator uid may store in it (NamespaceAccess); the DRAM pool file records that uid, but a reboot
// loses the pool file while the SSD keeps the blocks. This record keeps the owner where the blocks are: a small
// checksummed, versioned file in each --ssd-path directory (`flexkv-owners`, docs/ssd.md "Namespace owners"),
// read at start before any Attach, and written (atomically, before the namespace's first block goes to SSD) when a
// namespace gets its first owner. The first owner recorded stays: a later pool of the same namespace made by
// another uid does not replace it (an admin removes the file to hand a namespace over).
// Thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "flexkv/status.h"

namespace flexkv {

// The record file's name in each --ssd-path directory.
inline constexpr const char* kSsdOwnersFileName = "flexkv-owners";
// Bump on any change to the file's layout or meaning; a file of another version is ignored with a warning.
inline constexpr uint32_t kSsdOwnersVersion = 1;

class SsdOwners {
 public:
  // The record lives in each directory of `paths` (the --ssd-path directories).
  explicit SsdOwners(std::vector<std::string> paths);
  SsdOwners(const SsdOwners&) = delete;
  SsdOwners& operator=(const SsdOwners&) = delete;

  // Reads the record in every directory and keeps the valid copy with the highest sequence. A file that is missing
  // is no record; one that is damaged (checksum, syntax, another version, a uid or namespace out of range) is
  // ignored with a warning naming the file and what was wrong (logged, and appended to `warnings`); never an error.
  // A namespace's owner then comes from a valid copy in another directory, or is unknown.
  void Load(std::vector<std::string>* warnings = nullptr);

  // The recorded owner of `model_namespace`, if any.
  std::optional<uid_t> OwnerOf(std::string_view model_namespace) const;
  // Records `uid` as the owner of `model_namespace` unless one is recorded already (the first owner stays), and
  // writes the record to every directory (a temporary file, fsync, rename, fsync of the directory) before it
  // returns. Returns the owner recorded now (the earlier one when there was one). The error of a write that failed
  // (the owner is then known in memory only, and Record tries again next time).
  Result<uid_t> Record(std::string_view model_namespace, uid_t uid);
  // Forgets the namespaces `keep` does not hold (e.g. none of their blocks is on SSD any more) and writes the
  // record when that changed anything.
  Status Retain(const std::function<bool(std::string_view model_namespace)>& keep);
  std::map<std::string, uid_t, std::less<>> Owners() const;

  // The record's text for `owners` and `sequence` (what the file holds), and its parser: the owners, or what is
  // wrong with `text` (INVALID_ARGUMENT / FAILED_PRECONDITION for another version). Exposed for tests and fuzzing.
  static std::string Encode(const std::map<std::string, uid_t, std::less<>>& owners, uint64_t sequence);
  struct Decoded {
    std::map<std::string, uid_t, std::less<>> owners;
    uint64_t sequence = 0;
  };
  static Result<Decoded> Decode(std::string_view text);

 private:
  Status WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  std::vector<std::string> paths_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uid_t, std::less<>> owners_ ABSL_GUARDED_BY(mu_);
  uint64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
  bool dirty_ ABSL_GUARDED_BY(mu_) = false;  // a write failed: the next Record writes again
};

}  // namespace flexkv

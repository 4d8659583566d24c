// SsdBlockFile: the one block file of an --ssd-path directory, opened for the store: the filesystem probed for
// direct I/O, the file locked against a second daemon, its header read and checked (or written for a new file),
// its space allocated up front. No I/O on slots here: the store does that through io_uring.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/unique_fd.h"
#include "daemon/tiers/ssd/ssd_format.h"
#include "flexkv/status.h"

namespace flexkv {

// What to do with files, or blocks, that this store cannot use as they are: another format version, another
// slot geometry, another domain than the configured ones, or a file that is not a flexkv block file.
enum class SsdMismatchPolicy {
  kRefuse,   // Open fails with FAILED_PRECONDITION naming the file and what differed; nothing on disk is changed
  kDiscard,  // a warning naming the file and what differed; the file is reformatted / the blocks dropped
};

struct SsdFileOptions {
  uint64_t slot_count = 0;          // slots the file is to have (>= 1)
  uint64_t payload_capacity = 0;    // the largest payload of a slot (>= 1)
  bool allow_buffered = false;      // where O_DIRECT is refused: buffered I/O with a warning, instead of an error
  bool sync_writes = false;         // O_DSYNC: a write completes once the drive has it on stable media (FUA)
  SsdMismatchPolicy on_mismatch = SsdMismatchPolicy::kRefuse;
};

class SsdBlockFile {
 public:
  // Opens (or creates) `dir`/flexkv-ssd.blocks. Errors, each naming the path and saying what to do:
  //   NOT_FOUND            `dir` does not exist
  //   FAILED_PRECONDITION  the filesystem refuses O_DIRECT or keeps its files in memory (tmpfs, ramfs) and
  //                        allow_buffered is off; the file is locked by another process; the file is of another
  //                        format version or slot geometry, or not a block file, under kRefuse
  //   PERMISSION_DENIED    the file or directory cannot be opened for reading and writing
  //   RESOURCE_EXHAUSTED   the filesystem cannot allocate the file's size (ENOSPC, EDQUOT, EFBIG); a file this
  //                        call created is removed again, an existing one keeps its size
  //   UNAVAILABLE / INTERNAL  another error of the filesystem (EIO...)
  // `*warning` is set (never cleared) when the file is usable but the operator must hear something: buffered
  // I/O, a file reformatted under kDiscard, a file found truncated.
  static Result<std::unique_ptr<SsdBlockFile>> Open(const std::string& dir, const SsdFileOptions& options,
                                                    std::string* warning);

  SsdBlockFile(const SsdBlockFile&) = delete;
  SsdBlockFile& operator=(const SsdBlockFile&) = delete;

  const std::string& path() const { return path_; }
  int fd() const { return fd_.get(); }
  // Whether I/O on fd() bypasses the page cache (O_DIRECT); false only under allow_buffered.
  bool direct() const { return direct_; }
  const std::string& filesystem() const { return filesystem_; }  // "ext4", "xfs", "tmpfs", or the magic in hex
  const SsdFileHeader& header() const { return header_; }
  // True when the file was created or reformatted by Open: no slot of it holds a block.
  bool fresh() const { return fresh_; }
  // Bytes the file had when Open found it (slots ending past this were cut off by a truncation: lost).
  uint64_t found_bytes() const { return found_bytes_; }
  // Slots the file's header gave when Open found it (0 for a fresh file): above slot_count when --ssd-size shrank.
  uint64_t found_slot_count() const { return found_slot_count_; }

 private:
  SsdBlockFile() = default;

  std::string path_;
  UniqueFd fd_;
  bool direct_ = true;
  std::string filesystem_;
  SsdFileHeader header_;
  bool fresh_ = false;
  uint64_t found_bytes_ = 0;
  uint64_t found_slot_count_ = 0;
};

// Checks, without creating the block file, that `dir` can hold one of `bytes` bytes: the directory exists, is
// writable, takes O_DIRECT (a probe file is created, written and read with it, then removed; memory filesystems are
// refused as Open refuses them) unless allow_buffered, and has the space (free bytes plus the block file already
// there). For a daemon that cannot open its store yet (the block size is not known before the first pool) but must
// refuse a bad --ssd-path at start. Errors as SsdBlockFile::Open's; `*warning` as there (buffered I/O).
Status SsdPreflight(const std::string& dir, uint64_t bytes, bool allow_buffered, std::string* warning);

// The name of the filesystem holding `path` (statfs), e.g. "ext4"; "fs 0x…" for one this code does not name.
std::string SsdFilesystemName(const std::string& path);

// Status for a failed system call on an SSD file: the code that fits `err` (ENOSPC: RESOURCE_EXHAUSTED, EACCES:
// PERMISSION_DENIED, EIO: UNAVAILABLE...) and "<what>: <strerror> (<ENAME>)<hint>", with a hint saying what to do
// for the common cases.
Status SsdErrnoStatus(int err, const std::string& what);

}  // namespace flexkv

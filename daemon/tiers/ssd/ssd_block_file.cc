// See ssd_block_file.h.
#include "daemon/tiers/ssd/ssd_block_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "common/units.h"

namespace flexkv {
namespace {

constexpr int kLockWaitMs = 2000;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedSector = std::unique_ptr<uint8_t, FreeDeleter>;

AlignedSector NewSector() {
  void* p = nullptr;
  if (posix_memalign(&p, kSsdAlign, kSsdHeaderSector) != 0) std::abort();
  std::memset(p, 0, kSsdHeaderSector);
  return AlignedSector(static_cast<uint8_t*>(p));
}

std::span<uint8_t, kSsdHeaderSector> SectorSpan(const AlignedSector& s) {
  return std::span<uint8_t, kSsdHeaderSector>(s.get(), kSsdHeaderSector);
}

bool MemoryFilesystem(int64_t magic) { return magic == TMPFS_MAGIC || magic == RAMFS_MAGIC; }

std::string FilesystemName(int64_t magic) {
  switch (magic) {
    case EXT4_SUPER_MAGIC: return "ext4";  // also ext2/ext3: one magic
    case XFS_SUPER_MAGIC: return "xfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case F2FS_SUPER_MAGIC: return "f2fs";
    case TMPFS_MAGIC: return "tmpfs";
    case RAMFS_MAGIC: return "ramfs";
    case NFS_SUPER_MAGIC: return "nfs";
    case OVERLAYFS_SUPER_MAGIC: return "overlayfs";
    case FUSE_SUPER_MAGIC: return "fuse";
    case 0x2fc12fc1: return "zfs";
    default: return fmt::format("fs 0x{:x}", static_cast<uint64_t>(magic));
  }
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs s {};
  if (statvfs(dir.c_str(), &s) != 0) return 0;
  return uint64_t{s.f_bavail} * s.f_frsize;
}

// pread/pwrite of exactly n bytes (short transfers retried; 0 from pread is an error: the file ended).
int PreadFull(int fd, void* buf, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, static_cast<uint8_t*>(buf) + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return ENODATA;
    done += static_cast<size_t>(r);
  }
  return 0;
}
int PwriteFull(int fd, const void* buf, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pwrite(fd, static_cast<const uint8_t*>(buf) + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    done += static_cast<size_t>(r);
  }
  return 0;
}

uint64_t RandomFileId() {
  uint64_t id = 0;
  while (id == 0) {
    if (getrandom(&id, sizeof(id), 0) != sizeof(id)) id = static_cast<uint64_t>(::time(nullptr)) ^ 0x9E3779B97F4A7C15ull;
  }
  return id;
}

// `dir` exists and is a directory (NOT_FOUND / INVALID_ARGUMENT naming --ssd-path otherwise); `*fs` its filesystem.
Status StatSsdDirectory(const std::string& dir, struct statfs* fs) {
  struct stat dst {};
  if (::stat(dir.c_str(), &dst) != 0) {
    const int e = errno;
    if (e == ENOENT) return Status::NotFound(fmt::format("ssd path {} does not exist; create it (a directory on the "
                                                         "drive) or fix --ssd-path", dir));
    return SsdErrnoStatus(e, fmt::format("ssd path {}", dir));
  }
  if (!S_ISDIR(dst.st_mode)) {
    return Status::InvalidArgument(fmt::format("ssd path {} is not a directory; --ssd-path names a directory", dir));
  }
  if (statfs(dir.c_str(), fs) != 0) return SsdErrnoStatus(errno, fmt::format("statfs {}", dir));
  return Status::Ok();
}

}  // namespace

Status SsdPreflight(const std::string& dir, uint64_t bytes, bool allow_buffered, std::string* warning) {
  struct statfs fs {};
  FLEXKV_RETURN_IF_ERROR(StatSsdDirectory(dir, &fs));
  const std::string filesystem = FilesystemName(static_cast<int64_t>(fs.f_type));
  std::string no_direct;
  if (MemoryFilesystem(static_cast<int64_t>(fs.f_type))) {
    no_direct = fmt::format("{} keeps its files in memory: no direct I/O to a drive, and the blocks do not survive a "
                            "reboot", filesystem);
  }
  const std::string probe = dir + (dir.ends_with('/') ? "" : "/") + ".flexkv-ssd-probe";
  if (no_direct.empty()) {
    UniqueFd fd(::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0600));
    if (!fd && errno == EINVAL) {
      no_direct = fmt::format("{} refuses O_DIRECT (open: EINVAL)", filesystem);
    } else if (!fd) {
      return SsdErrnoStatus(errno, fmt::format("create {}", probe));
    } else {
      AlignedSector sector = NewSector();
      int e = PwriteFull(fd.get(), sector.get(), kSsdHeaderSector, 0);
      if (e == 0) e = PreadFull(fd.get(), sector.get(), kSsdHeaderSector, 0);
      ::unlink(probe.c_str());
      if (e == EINVAL) {
        no_direct = fmt::format("{} refuses O_DIRECT transfers (EINVAL)", filesystem);
      } else if (e != 0) {
        return SsdErrnoStatus(e, fmt::format("probe {}", probe));
      }
    }
  }
  if (!no_direct.empty()) {
    if (!allow_buffered) {
      return Status::FailedPrecondition(fmt::format(
          "ssd path {} ({}): {}; point --ssd-path at a directory on an NVMe drive, or allow buffered I/O "
          "(--ssd-allow-buffered) to use it anyway, slower: every block is copied through the page cache",
          dir, filesystem, no_direct));
    }
    if (!warning->empty()) *warning += "; ";
    *warning += fmt::format("ssd path {} ({}): {}; buffered I/O (--ssd-allow-buffered): slower", dir, filesystem, no_direct);
    UniqueFd fd(::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) return SsdErrnoStatus(errno, fmt::format("create {}", probe));
    ::unlink(probe.c_str());
  }
  struct stat existing {};
  const std::string file = dir + (dir.ends_with('/') ? "" : "/") + kSsdFileName;
  const uint64_t have = ::stat(file.c_str(), &existing) == 0 ? static_cast<uint64_t>(existing.st_blocks) * 512 : 0;
  const uint64_t free_bytes = FreeBytes(dir);
  if (free_bytes + have < bytes) {
    return Status::ResourceExhausted(fmt::format(
        "ssd path {} ({}): the block file needs {} ({} bytes) but the filesystem has {} free{}; lower --ssd-size or "
        "free space on the drive", dir, filesystem, FormatByteSize(bytes), bytes, FormatByteSize(free_bytes),
        have > 0 ? fmt::format(" (plus {} in the existing block file)", FormatByteSize(have)) : std::string()));
  }
  return Status::Ok();
}

std::string SsdFilesystemName(const std::string& path) {
  struct statfs s {};
  if (statfs(path.c_str(), &s) != 0) return "unknown";
  return FilesystemName(static_cast<int64_t>(s.f_type));
}

Status SsdErrnoStatus(int err, const std::string& what) {
  const std::string base = fmt::format("{}: {} ({})", what, std::strerror(err), strerrorname_np(err) ? strerrorname_np(err) : "?");
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return Status::ResourceExhausted(base + "; free space on the drive or lower --ssd-size");
    case EFBIG:
      return Status::ResourceExhausted(base + "; the file size limit (ulimit -f, LimitFSIZE=) or the filesystem's "
                                              "largest file is below the file's size: raise it or lower --ssd-size");
    case EACCES:
    case EPERM:
    case EROFS:
      return Status::PermissionDenied(base + "; the daemon's user needs read and write access to the directory and "
                                             "the file, on a filesystem mounted read-write");
    case ENOENT:
    case ENOTDIR:
      return Status::NotFound(base);
    case EISDIR:
      return Status::FailedPrecondition(base + "; a directory stands where the block file should be: remove it");
    case EIO:
    case ENODATA:
    case ENXIO:
      return Status::Unavailable(base + "; the drive reported an error: check dmesg and the drive's health");
    case ENOMEM:
    case EAGAIN:
    case EMFILE:
    case ENFILE:
      return Status::ResourceExhausted(base);
    default:
      return Status::Internal(base);
  }
}

Result<std::unique_ptr<SsdBlockFile>> SsdBlockFile::Open(const std::string& dir, const SsdFileOptions& options,
                                                        std::string* warning) {
  if (options.slot_count == 0 || options.payload_capacity == 0) {
    return Status::InvalidArgument(fmt::format("ssd file in {}: {} slots of {} payload bytes; expected at least one "
                                               "slot of at least one byte", dir, options.slot_count,
                                               options.payload_capacity));
  }
  auto add_warning = [&](const std::string& w) {
    if (!warning->empty()) *warning += "; ";
    *warning += w;
  };
  struct statfs fs {};
  FLEXKV_RETURN_IF_ERROR(StatSsdDirectory(dir, &fs));

  std::unique_ptr<SsdBlockFile> f(new SsdBlockFile());
  f->path_ = dir + (dir.ends_with('/') ? "" : "/") + kSsdFileName;
  f->filesystem_ = FilesystemName(static_cast<int64_t>(fs.f_type));
  const int sync_flag = options.sync_writes ? O_DSYNC : 0;

  // Direct I/O: refused by some filesystems at open (EINVAL), accepted but meaningless on memory filesystems
  // (tmpfs takes O_DIRECT since Linux 6.6, yet its pages stay in RAM and a reboot loses them), and refused by
  // others only at the first transfer (probed below with the header read).
  std::string no_direct;
  if (MemoryFilesystem(static_cast<int64_t>(fs.f_type))) {
    no_direct = fmt::format("{} keeps its files in memory: no direct I/O to a drive, and the blocks do not survive a "
                            "reboot", f->filesystem_);
  }
  bool created = false;
  auto open_file = [&](bool direct) -> int {
    int fd = ::open(f->path_.c_str(), O_RDWR | O_CLOEXEC | sync_flag | (direct ? O_DIRECT : 0));
    if (fd < 0 && errno == ENOENT) {
      fd = ::open(f->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | sync_flag | (direct ? O_DIRECT : 0), 0600);
      if (fd >= 0) created = true;
    }
    return fd;
  };
  int fd = -1;
  if (no_direct.empty()) {
    fd = open_file(true);
    if (fd < 0 && errno == EINVAL) no_direct = fmt::format("{} refuses O_DIRECT (open: EINVAL)", f->filesystem_);
    else if (fd < 0) return SsdErrnoStatus(errno, fmt::format("open {}", f->path_));
  }
  auto refuse_buffered = [&]() {
    return Status::FailedPrecondition(fmt::format(
        "ssd path {} ({}): {}; point --ssd-path at a directory on an NVMe drive, or allow buffered I/O "
        "(--ssd-allow-buffered) to use it anyway, slower: every block is copied through the page cache",
        dir, f->filesystem_, no_direct));
  };
  if (!no_direct.empty()) {
    if (fd >= 0) ::close(fd);
    if (!options.allow_buffered) {
      if (created) ::unlink(f->path_.c_str());
      return refuse_buffered();
    }
    fd = open_file(false);
    if (fd < 0) return SsdErrnoStatus(errno, fmt::format("open {}", f->path_));
    f->direct_ = false;
  }
  f->fd_.reset(fd);
  // A daemon killed with I/O in flight keeps the file (and so its lock) until the kernel has finished that I/O
  // and torn its io_uring down, a few milliseconds after the process is gone: wait that long before refusing.
  for (int waited_ms = 0; ::flock(fd, LOCK_EX | LOCK_NB) != 0;) {
    const int e = errno;
    if (e == EINTR) continue;
    if (e != EWOULDBLOCK) return SsdErrnoStatus(e, fmt::format("flock {}", f->path_));
    if (waited_ms >= kLockWaitMs) {
      return Status::FailedPrecondition(fmt::format("ssd file {} is in use by another process (still locked after "
                                                    "{} ms); one flexkvd per --ssd-path", f->path_, kLockWaitMs));
    }
    ::usleep(10'000);
    waited_ms += 10;
  }
  auto fail_created = [&](Status s) {
    if (created) ::unlink(f->path_.c_str());
    return s;
  };

  struct stat st {};
  if (::fstat(fd, &st) != 0) return fail_created(SsdErrnoStatus(errno, fmt::format("fstat {}", f->path_)));
  f->found_bytes_ = static_cast<uint64_t>(st.st_size);

  SsdFileHeader want;
  want.payload_capacity = options.payload_capacity;
  want.slot_stride = SsdSlotStride(options.payload_capacity);
  want.slot_count = options.slot_count;

  AlignedSector sector = NewSector();
  bool reformat = created || f->found_bytes_ == 0;
  if (!reformat) {
    if (f->found_bytes_ < kSsdHeaderSector) {
      std::memset(sector.get(), 0, kSsdHeaderSector);
    } else if (const int e = PreadFull(fd, sector.get(), kSsdHeaderSector, 0); e != 0) {
      if (e == EINVAL && f->direct_) {
        no_direct = fmt::format("{} refuses O_DIRECT reads (EINVAL)", f->filesystem_);
        if (!options.allow_buffered) return refuse_buffered();
        // Reopen buffered and read again.
        const int bfd = ::open(f->path_.c_str(), O_RDWR | O_CLOEXEC | sync_flag);
        if (bfd < 0) return SsdErrnoStatus(errno, fmt::format("open {}", f->path_));
        f->fd_.reset(bfd);
        fd = bfd;
        f->direct_ = false;
        if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {  // reset closed the direct fd and its lock: lock again
          return SsdErrnoStatus(errno, fmt::format("flock {}", f->path_));
        }
        if (const int e2 = PreadFull(fd, sector.get(), kSsdHeaderSector, 0); e2 != 0) {
          return SsdErrnoStatus(e2, fmt::format("read the header of {}", f->path_));
        }
      } else {
        return SsdErrnoStatus(e, fmt::format("read the header of {}", f->path_));
      }
    }
    const SsdDecodedFile d = DecodeFileHeader(SectorSpan(sector));
    std::string mismatch;
    switch (d.kind) {
      case SsdSectorKind::kEmpty:
        mismatch = "it has no flexkv SSD file header (not a block file, or never finished)";
        break;
      case SsdSectorKind::kCorrupt:
        mismatch = "its file header is corrupt (checksum)";
        break;
      case SsdSectorKind::kOtherVersion:
        mismatch = fmt::format("it is of format version {}, written by {} flexkvd; this flexkvd reads version {} "
                               "(to keep its blocks, run the flexkvd release that wrote it)",
                               d.version, d.version > kSsdFormatVersion ? "a newer" : "an older", kSsdFormatVersion);
        break;
      case SsdSectorKind::kValid:
        if (d.header.payload_capacity != want.payload_capacity || d.header.slot_stride != want.slot_stride) {
          mismatch = fmt::format("its slots hold {} payload bytes ({} per slot); this store needs {} ({} per slot): "
                                 "another geometry", d.header.payload_capacity, d.header.slot_stride,
                                 want.payload_capacity, want.slot_stride);
        }
        break;
    }
    if (!mismatch.empty()) {
      if (options.on_mismatch == SsdMismatchPolicy::kRefuse) {
        return Status::FailedPrecondition(fmt::format(
            "ssd file {}: {}; nothing was changed. Remove the file, point --ssd-path elsewhere, or let flexkvd "
            "discard it (--ssd-on-mismatch=discard)", f->path_, mismatch));
      }
      add_warning(fmt::format("ssd file {}: {}; discarded (--ssd-on-mismatch=discard): the file is reformatted and "
                              "its blocks are dropped", f->path_, mismatch));
      reformat = true;
    } else {
      f->header_ = d.header;
      f->found_slot_count_ = d.header.slot_count;
      if (f->found_bytes_ < d.header.FileBytes()) {
        add_warning(fmt::format("ssd file {} is {} bytes, shorter than its {} slots need ({} bytes): it was truncated; "
                                "the blocks past its end are lost, the others are kept", f->path_, f->found_bytes_,
                                d.header.slot_count, d.header.FileBytes()));
      }
    }
  }
  if (reformat) {
    f->header_ = want;
    f->header_.file_id = RandomFileId();
    f->fresh_ = true;
  } else {
    f->header_.slot_count = want.slot_count;  // --ssd-size changed: slots past the new end are dropped at rebuild
  }

  // Space first, header last: a file whose allocation failed never has a header that promises its slots.
  const uint64_t bytes = f->header_.FileBytes();
  if (reformat && f->found_bytes_ > 0) {
    // Zero the old header before anything else, so that a crash below leaves no old-format header behind.
    std::memset(sector.get(), 0, kSsdHeaderSector);
    if (const int e = PwriteFull(fd, sector.get(), kSsdHeaderSector, 0); e != 0) {
      return SsdErrnoStatus(e, fmt::format("clear the header of {}", f->path_));
    }
    if (::ftruncate(fd, 0) != 0) return SsdErrnoStatus(errno, fmt::format("truncate {}", f->path_));
  }
  if (bytes != f->found_bytes_ || reformat) {
    if (bytes < f->found_bytes_ && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      return SsdErrnoStatus(errno, fmt::format("shrink {} to {} bytes", f->path_, bytes));
    }
    if (::fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      if (e == EOPNOTSUPP) {
        add_warning(fmt::format("ssd file {}: {} cannot allocate space up front; the file is sparse, so a full "
                                "drive shows as write errors later", f->path_, f->filesystem_));
        if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
          return fail_created(SsdErrnoStatus(errno, fmt::format("size {} to {} bytes", f->path_, bytes)));
        }
      } else {
        const uint64_t free_bytes = FreeBytes(dir);
        if (created) ::unlink(f->path_.c_str());
        else if (reformat) ::unlink(f->path_.c_str());  // its header is gone: nothing in it can be used
        else if (::ftruncate(fd, static_cast<off_t>(f->found_bytes_)) != 0) {}  // keep the old size
        return SsdErrnoStatus(e, fmt::format("allocate {} bytes for ssd file {} ({} free on {})", bytes, f->path_,
                                             free_bytes, dir));
      }
    }
  }
  EncodeFileHeader(f->header_, SectorSpan(sector));
  if (const int e = PwriteFull(fd, sector.get(), kSsdHeaderSector, 0); e != 0) {
    if (e == EINVAL && f->direct_) {
      return fail_created(Status::FailedPrecondition(fmt::format(
          "ssd path {} ({}): O_DIRECT writes are refused (EINVAL); allow buffered I/O (--ssd-allow-buffered) to use "
          "it anyway, slower", dir, f->filesystem_)));
    }
    return fail_created(SsdErrnoStatus(e, fmt::format("write the header of {}", f->path_)));
  }
  if (::fdatasync(fd) != 0) return fail_created(SsdErrnoStatus(errno, fmt::format("fdatasync {}", f->path_)));
  if (!f->direct_) {
    add_warning(fmt::format("ssd path {} ({}): {}; using buffered I/O as allowed (--ssd-allow-buffered): slower, "
                            "every block is copied through the page cache", dir, f->filesystem_, no_direct));
  }
  return f;
}

}  // namespace flexkv

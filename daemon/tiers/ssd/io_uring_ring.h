// IoUringRing: one io_uring (liburing), owned: set up by Init, torn down once by the destructor. Move-free and
// copy-free; used by one thread at a time (the SSD store's drive thread, or Open's rebuild before it starts).
#pragma once

#include <liburing.h>

#include <cstring>

#include "flexkv/status.h"

namespace flexkv {

class IoUringRing {
 public:
  IoUringRing() = default;
  ~IoUringRing() {
    if (ready_) io_uring_queue_exit(&ring_);
  }
  IoUringRing(const IoUringRing&) = delete;
  IoUringRing& operator=(const IoUringRing&) = delete;

  // `entries` submission slots (rounded up to a power of two by the kernel). The error names the errno: ENOMEM
  // (locked memory), EPERM (io_uring disabled: sysctl kernel.io_uring_disabled), ENOSYS (kernel without it).
  Status Init(unsigned entries) {
    const int r = io_uring_queue_init(entries, &ring_, 0);
    if (r < 0) {
      return Status::Unavailable(std::string("io_uring_queue_init: ") + std::strerror(-r) +
                                 "; the SSD tier needs io_uring (Linux 5.6 or later, kernel.io_uring_disabled=0)");
    }
    ready_ = true;
    return Status::Ok();
  }
  io_uring* get() { return &ring_; }

 private:
  io_uring ring_{};
  bool ready_ = false;
};

}  // namespace flexkv

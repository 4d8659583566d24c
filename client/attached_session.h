// AttachedSession: everything one attached session of a Client owns (rings, session channel, host KV mapping),
// shared by the Client and the calls running on it. Internal to libflexkv.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/session_rings.h"
#include "common/unique_fd.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// One MAP_SHARED mapping of host KV buffers, unmapped once by its owner. Move-only.
class KvMapping {
 public:
  KvMapping() = default;
  KvMapping(uint8_t* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
  KvMapping(KvMapping&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  KvMapping& operator=(KvMapping&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  KvMapping(const KvMapping&) = delete;
  KvMapping& operator=(const KvMapping&) = delete;
  ~KvMapping() { Reset(); }

  uint8_t* data() const { return data_; }
  explicit operator bool() const { return data_ != nullptr; }
  void Reset();

 private:
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// Everything one attached session owns. Shared (shared_ptr) by the Client while it is the current session and by
// every call running on it: Detach and a re-Attach swap the Client's pointer and Drop() the session; the last
// holder frees it (rings unmapped, fds closed, KV mapping unmapped), so a call never touches freed memory.
struct AttachedSession {
  uint64_t generation = 0;
  uint64_t session_id = 0;
  std::string token;
  // The geometry this session attached with (the daemon accepted it): sizes host KV buffers and lays out hybrid
  // Load/Store ids. Set before the session is shared; never changed.
  Geometry geometry;
  UniqueFd channel;                     // the session channel; the rings watch a dup of it
  std::unique_ptr<SessionRings> rings;  // thread-safe itself

  absl::Mutex mu;  // one fd offer at a time on `channel`; the KV registrations
  uint32_t next_fd_tag ABSL_GUARDED_BY(mu) = 1;
  // Host KV buffers per geometry component (index = component); an empty mapping: not registered (yet).
  std::vector<KvMapping> kv ABSL_GUARDED_BY(mu);
  bool dropped ABSL_GUARDED_BY(mu) = false;

  // The daemon closed the session channel (it stopped or restarted).
  bool Lost() const;
  // The Client let go of this session: calls running on it end with `why`, the daemon sees the channel hang up
  // (shutdown reaches the rings' dup too), and a KV registration still in progress is refused. Returns the KV
  // mappings (registered ones only), for the caller to keep or drop.
  std::vector<KvMapping> Drop(const Status& why);
  // Offers one fd on the session channel and waits for the daemon's acknowledgement; returns the tag a
  // later RegisterKv names it by. FAILED_PRECONDITION once dropped.
  Result<uint32_t> OfferFd(int fd, const char* what, std::chrono::milliseconds call_timeout);
};

}  // namespace flexkv

// Shared-memory layout of a session's rings (docs/protocol.md "Session rings"); the protocol over it, both
// ends, is common/ring/ (RingSubmitter for the client, RingConsumer for the daemon).
// One sealed memfd per session, created by the daemon, mapped by both sides:
//   header | index cache lines | submit ring | completion ring | payload arena
// The client produces submissions and consumes completions; the daemon the reverse. Offsets, never
// pointers. Every field the daemon reads from this memory is untrusted: it copies a descriptor once,
// then validates the copy. Bump kRingLayoutVersion on any change.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "flexkv/block_key.h"

namespace flexkv {

inline constexpr uint32_t kRingMagic = 0x52564B46;  // "FKVR" little-endian
// 3: hybrid geometries (docs/hybrid.md): Load and Store carry block ids for every component; Store's state_count.
// 4: Load names a CUDA layer-event set (SubmitDescriptor::event_set, once `reserved`); the daemon answers it with a
//    "launched" progress completion (kCompletionFlagLaunched) once every copy and event record is enqueued.
// 5: a Load names the first block of the match it copies (SubmitDescriptor::first_block, the word a Store's
//    state_count is in), so that an engine holding a prefix on the GPU loads only past it; a hybrid Store names how
//    many of its last keys carry sliding-window ids (SubmitDescriptor::window_keys, the word a Load's event_set is
//    in); a Load's completion counts the bytes it copied. A layout-4 daemon refuses both words (INVALID_ARGUMENT),
//    and libflexkv refuses them before it sends them to one (it maps layout 4 rings too, kMinRingLayoutVersion).
// 6: a Load names its launch deadline (SubmitDescriptor::launch_deadline_ns, the word a Match's or Store's
//    keys_offset is in): the daemon never starts copying it after that CLOCK_MONOTONIC time, and ends it with
//    DEADLINE_EXCEEDED instead. A layout-5 daemon ignores the word (a Load has no keys), so libflexkv refuses a
//    deadline before it sends one to a daemon of layout 4 or 5 (FAILED_PRECONDITION).
inline constexpr uint32_t kRingLayoutVersion = 6;
// The oldest layout libflexkv maps: version 4's and 5's rings differ from version 6's only in the words above, which
// the library never sets non-zero for such a daemon.
inline constexpr uint32_t kMinRingLayoutVersion = 4;

enum class RingOp : uint16_t {
  kMatch = 1,    // keys → leading cached blocks; flag kPin pins them and returns a match handle
  kLoad = 2,     // match handle + destination block ids → copies the matched blocks into the session's KV
  kStore = 3,    // parent + keys + source block ids → stores the blocks not yet cached, keys[0] under parent
  kRelease = 4,  // match handle → drops its pins
  // keys (a prompt's chain from its first block) → the leading blocks cached here, then the blocks after them
  // pulled from peer daemons (cluster tier, docs/cluster.md) and cached here once verified. Asynchronous: the
  // completion comes when the pull ended (deadline-bounded). Pins nothing; Match after it to load. flags 0,
  // match_handle 0, parent zero, block ids none. A daemon without a cluster tier answers with the local hits.
  kPrefetch = 5,
};
inline constexpr uint16_t kMatchFlagPin = 1;
// Load: post a progress completion (kCompletionFlagLayerDone, matched_blocks = layer) as each layer lands.
inline constexpr uint16_t kLoadFlagLayerwise = 1;
// Completion flags.
inline constexpr uint16_t kCompletionFlagLayerDone = 1;  // progress, not the end of the request
// With kCompletionFlagLayerDone (so it is progress, never the end of the request): a Load naming an event set
// has enqueued every layer's copies and recorded every layer's event on the daemon's copy stream. Only after
// this (or the request's final completion) may the engine enqueue cudaStreamWaitEvent on the set's events.
inline constexpr uint16_t kCompletionFlagLaunched = 2;

// Client → daemon. 64 bytes.
struct SubmitDescriptor {
  uint64_t user_data;         // echoed in the completion
  uint16_t opcode;            // RingOp
  uint16_t flags;
  uint32_t count;             // blocks (keys and/or block ids)
  union {
    uint64_t keys_offset;     // arena offset of `count` 16-byte keys (Match, Store, Prefetch)
    // Load (layout 6): the latest CLOCK_MONOTONIC time (ns) at which the daemon may start copying it; 0: none. Past
    // it the Load ends DEADLINE_EXCEEDED with nothing copied. At most INT64_MAX (else INVALID_ARGUMENT).
    uint64_t launch_deadline_ns;
  };
  uint64_t block_ids_offset;  // arena offset of `count` u32 block ids (Load, Store)
  uint64_t match_handle;      // Load, Release
  // Store: the key keys[0] hangs under (the block before it in the prompt); all zero when keys[0] is the
  // prompt's first block (root). Zero for every other opcode.
  BlockKey parent;
  // One word, two meanings by opcode (as io_uring's SQE shares its fields); zero for every other request.
  union {
    // Store of a hybrid geometry: how many state boundaries it carries (0..count).
    uint32_t state_count;
    // Load (layout 5): the first block of the match it copies (0: from the prefix's first block). The blocks
    // [first_block, count) move; the engine holds the ones before it.
    uint32_t first_block;
  };
  union {
    // Load (layout 4): the CUDA layer-event set (RegisterLayerEvents) whose event[layer] the daemon records on its
    // copy stream right after that layer's copies; 0: none.
    uint32_t event_set;
    // Store of a hybrid geometry (layout 5): how many of its last keys carry sliding-window ids (0: min(window_blocks,
    // count) per window, as in layout 3; else at least that for every window, and at most count).
    uint32_t window_keys;
  };
};
static_assert(sizeof(SubmitDescriptor) == 64);
static_assert(offsetof(SubmitDescriptor, parent) == 40 && sizeof(BlockKey) == 16);
static_assert(offsetof(SubmitDescriptor, keys_offset) == 16 && offsetof(SubmitDescriptor, launch_deadline_ns) == 16);
static_assert(offsetof(SubmitDescriptor, state_count) == 56 && offsetof(SubmitDescriptor, event_set) == 60);
static_assert(offsetof(SubmitDescriptor, first_block) == 56 && offsetof(SubmitDescriptor, window_keys) == 60);

// Block ids of a hybrid geometry's Load and Store (docs/hybrid.md "Ring requests"). `count` stays the number of
// keys (Store) or prefix blocks (Load: exactly the match handle's e), and block_ids_offset points at
// LayoutIds(...).total u32 values, components in geometry order (component 0 = FULL); k = first_block:
//   Load:  FULL: count - k ids (blocks [k, count)); SLIDING_WINDOW: min(window_blocks, count - k) ids (the blocks
//          [max(k, count - window_blocks), count)); STATE: 1 id (the engine state slot for the snapshot at count).
//   Store: FULL: count ids; SLIDING_WINDOW: window_keys ids (0: min(window_blocks, count)) for the last keys; then
//          state_count boundaries (each in 1..count, strictly increasing; boundary b = the snapshot after
//          keys[b - 1]); then per STATE component state_count ids (its snapshot at each boundary).
// FULL and SLIDING_WINDOW ids come first in component order, STATE ids last: common/hybrid_ids.h computes it.
// A full-attention geometry's Load carries count - first_block ids (blocks [first_block, count)); its Store is
// unchanged (count ids, state_count and window_keys 0).

// Daemon → client. 128 bytes.
struct CompletionDescriptor {
  uint64_t user_data;
  int32_t status_code;       // StatusCode; 0 = OK
  uint16_t opcode;
  uint16_t flags;            // kCompletionFlagLayerDone: progress of a layer-wise Load
  uint32_t matched_blocks;   // Match: leading blocks cached; Store: leading blocks already cached;
                             // layer progress: the layer that landed; Prefetch: leading blocks cached here
                             // before the pull
  uint32_t done_blocks;      // Load: FULL blocks copied (count - first_block); Store: blocks newly stored;
                             // Prefetch: blocks pulled from a peer and now cached here (after the matched_blocks)
  uint64_t match_handle;     // Match with kMatchFlagPin: handle to Load/Release (0 when nothing pinned)
  uint64_t bytes;            // Prefetch: bytes pulled from peers (done_blocks blocks); Load (layout 5): bytes
                             // copied into the engine, every component's; 0 for every other opcode
  // NUL-terminated reason when status_code != 0. Prefetch with status OK: the source node's id when blocks were
  // pulled, else why none were ("" when no peer has them, e.g. "peer node-a: deadline exceeded").
  char message[88];
};
static_assert(sizeof(CompletionDescriptor) == 128);

// One single-producer/single-consumer index pair, each index on its own cache line. Free-running
// 32-bit counters; the slot of index i is i & (entries - 1).
struct alignas(64) RingIndex {
  std::atomic<uint32_t> value;
  char pad[60];
};
static_assert(sizeof(RingIndex) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct RingHeader {
  uint32_t magic;               // kRingMagic
  uint32_t layout_version;      // kRingLayoutVersion
  uint32_t submit_entries;      // power of two
  uint32_t completion_entries;  // power of two
  uint64_t submit_offset;
  uint64_t completion_offset;
  uint64_t arena_offset;
  uint64_t arena_bytes;
  uint64_t total_bytes;
  // Pin lease (docs/protocol.md "Pins"). The client's library writes its monotonic clock in ms here at least four
  // times per pin_lease_ms while the process runs; the daemon reads it only to see that it changed (its value is
  // never trusted), and releases the session's pins once it stayed the same for pin_lease_ms. Written by the client.
  std::atomic<uint64_t> client_heartbeat_ms;
  uint32_t pin_lease_ms;        // written by the daemon at creation; 0: pins never lapse
  char pad[256 - 68];
  RingIndex submit_tail;        // written by the client
  RingIndex submit_head;        // written by the daemon
  RingIndex completion_tail;    // written by the daemon; clients futex-wait on it
  RingIndex completion_head;    // written by the client
  RingIndex daemon_parked;      // 1 while the daemon sleeps: the client then rings the doorbell (eventfd)
  RingIndex client_waiting;     // >0 while a client thread futex-waits on completion_tail
};
static_assert(sizeof(RingHeader) == 256 + 6 * 64);
static_assert(offsetof(RingHeader, client_heartbeat_ms) == 56 && offsetof(RingHeader, pin_lease_ms) == 64);

struct RingGeometry {
  uint32_t submit_entries;
  uint32_t completion_entries;
  uint64_t arena_bytes;

  uint64_t submit_offset() const { return 1024; }
  uint64_t completion_offset() const { return submit_offset() + uint64_t{submit_entries} * sizeof(SubmitDescriptor); }
  uint64_t arena_offset() const {
    const uint64_t end = completion_offset() + uint64_t{completion_entries} * sizeof(CompletionDescriptor);
    return (end + 4095) & ~uint64_t{4095};
  }
  uint64_t total_bytes() const { return (arena_offset() + arena_bytes + 4095) & ~uint64_t{4095}; }
};

}  // namespace flexkv

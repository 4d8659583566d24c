// libflexkv: how an engine process talks to the node's flexkvd. One Client per process (per DP/TP
// worker); it holds one gRPC channel and, once attached, one session.
//
//   auto client = flexkv::Client::Connect({});            // $FLEXKV_SOCKET or the default socket
//   if (!client.ok()) return client.status();
//   auto session = (*client)->Attach({.client_name = "vllm-dp0", .model_namespace = "llama3-8b",
//                                     .geometry = flexkv::Llama3_8B()});
//
// Thread safety: all methods may be called from several threads at once, Detach and Attach included: a call
// works on the session that was current when it started (it holds a reference to that session's state), and
// one still running when Detach (or a re-Attach) drops that session ends with FAILED_PRECONDITION (detached)
// or UNAVAILABLE (the daemon lost it), never on another session. Only destruction must not race other calls.
// No method throws.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

struct ConnectOptions {
  // Empty: $FLEXKV_SOCKET, else the default socket of a flexkvd started by the same user.
  std::string socket_path;
  // How long Connect waits for a daemon that is not up yet (socket missing or refusing).
  std::chrono::milliseconds connect_timeout{5000};
  // Deadline of each control call.
  std::chrono::milliseconds call_timeout{10000};
};

struct AttachOptions {
  std::string client_name;      // shown by `flexkvctl sessions`
  uint32_t dp_rank = 0;
  uint32_t tp_rank = 0;
  std::string model_namespace;  // cache domain; sessions share blocks within it
  Geometry geometry;
};

struct SessionInfo {
  uint64_t session_id = 0;
  uint64_t block_bytes = 0;      // host bytes per block, fixed by the daemon
  uint64_t capacity_blocks = 0;  // pool slots
  bool read_only = false;        // the session may match and load, but its Stores are refused PERMISSION_DENIED
  // Per geometry component (component 0 first; one entry for a full-attention model): host bytes of one slot
  // and the slots of its sub-pool (docs/hybrid.md).
  std::vector<uint64_t> component_slot_bytes;
  std::vector<uint64_t> component_capacity;
};

struct DaemonStatus {
  std::string state;  // "serving" | "draining" | "drained"
  std::string version;
  uint32_t pid = 0;
  uint64_t uptime_s = 0;
  struct Pool {
    uint64_t block_bytes = 0, capacity_blocks = 0, used_blocks = 0, pinned_blocks = 0, budget_bytes = 0;
    std::string backing;
    uint64_t unverified_blocks = 0;  // restored at start, still being verified (not served yet)
    // A new domain's pool is allocated and registered in the background: "preparing" (active_bytes growing to
    // target_bytes), "failed: <why>", or "" (done). prepare_ms: how long it ran or has run; first_serve_ms: until
    // its first grants served (0: not yet).
    std::string preparation;
    uint64_t active_bytes = 0, target_bytes = 0, prepare_ms = 0, first_serve_ms = 0;
    // Hybrid geometries: one entry per component's sub-pool, component 0 first (the fields above are the totals);
    // empty before a domain is set or from a daemon that does not report them.
    struct Component {
      ComponentKind kind = ComponentKind::kFull;
      uint64_t slot_bytes = 0, capacity = 0, used = 0, pinned = 0, evicted = 0;
      uint64_t unanchored = 0;  // entries whose full-attention block is gone (evicted first)
    };
    std::vector<Component> components;
  };
  // With several cache domains, pool / index_blocks / counters are the totals of every domain (pool.budget_bytes is
  // the daemon's budget) and model_namespace is set only while exactly one domain exists.
  Pool pool;
  uint64_t index_blocks = 0;
  uint32_t sessions = 0;
  std::map<std::string, uint64_t> counters;  // only the counters this daemon counts
  struct Backend {
    std::string name;
    std::vector<std::string> devices;
  };
  std::vector<Backend> backends;
  std::string model_namespace;
  // One cache domain (a model namespace with its geometry, its own pool and index), in the order they were created.
  struct Domain {
    std::string model_namespace;
    Geometry geometry;
    Pool pool;                                 // budget_bytes: this domain's share of the daemon's budget
    uint64_t index_blocks = 0;
    std::map<std::string, uint64_t> counters;  // as above, without errors (not counted per domain)
    uint32_t sessions = 0;
    uint64_t idle_s = 0;       // since its last session ended (or it was created); 0 while one is attached
    uint64_t limit_bytes = 0;  // the operator's pool_size for its namespace; 0: none
  };
  std::vector<Domain> domains;  // empty from a daemon older than several domains
  // A cache tier below DRAM (today "ssd", with --ssd-path; docs/ssd.md).
  struct Tier {
    std::string name;   // "ssd"
    std::string state;  // "serving" | "waiting for the first pool" | "failed: <why>"
    uint64_t capacity_blocks = 0, used_blocks = 0, capacity_bytes = 0, block_bytes = 0;
    double read_bytes_per_s = 0, write_bytes_per_s = 0;  // over the last second
    double rebuild_s = 0;                                // opening the tier at start (reading every slot header)
    // promoted_blocks, promotion_requests, promotion_refused_blocks, promotion_failed_blocks, written_back_blocks,
    // writeback_refused_blocks, writeback_failed_blocks, evicted_written_blocks, evicted_unwritten_blocks,
    // store_waits, store_wait_expired, promotion_waits, promotion_wait_expired,
    // evicted_blocks, reads_in_flight, writes_in_flight, read_bytes, write_bytes, read_errors, write_errors,
    // data_loss_blocks, refused, rebuilt_blocks, rebuild_corrupt_headers, rebuild_truncated (docs/protocol.md)
    std::map<std::string, uint64_t> counters;
    struct File {
      std::string path, filesystem;
      bool direct_io = true;
      uint64_t slots = 0;
    };
    std::vector<File> files;
    std::vector<std::string> notes;
  };
  std::vector<Tier> tiers;  // none without a tier below DRAM
  // The cluster tier (docs/cluster.md); nullopt without --etcd-endpoints.
  struct Cluster {
    std::string state;  // "joining" | "joined" | "retrying: <why> (attempt N)" | "failed: <why>" | "stopped"
    std::string node_id, endpoint, last_error;
    uint64_t epoch = 0;
    struct Member {
      std::string node_id, endpoint;
      uint64_t epoch = 0;
      bool self = false;
    };
    std::vector<Member> members;
    // published_keys, publish_queue, publish_failures, rejoins, prefetches, pulls_ok, pulls_failed,
    // pulled_blocks, pulled_bytes, verify_failures, pulls_in_flight, lookups_served, blocks_offered, peer_reads_ok,
    // peer_reads_failed, peer_read_deadlines, connections_accepted, connections_rejected, auth_failures,
    // replies_dropped, requests_refused, directory_unauthenticated
    // (docs/protocol.md, ClusterStatus)
    std::map<std::string, uint64_t> counters;
    std::vector<std::string> transports, rdma_devices;
  };
  std::optional<Cluster> cluster;
  // The KV event stream (flexkv/kv_events.h, docs/kv_events.md).
  struct KvEvents {
    uint64_t instance_id = 0;   // random per daemon start
    uint64_t last_seq = 0;      // the last event's seq (events are numbered only while someone subscribes)
    uint32_t subscribers = 0;
    uint64_t cut_off = 0;       // subscribers cut off for falling behind
    uint64_t buffer_events = 0;
    std::string zmq_endpoint;   // empty: no ZMQ publisher
    uint64_t zmq_batches = 0, zmq_events = 0, zmq_resyncs = 0;
  };
  KvEvents kv_events;
};

// What a scrub found (Client::Scrub).
struct ScrubResult {
  uint64_t checked_blocks = 0, failed_blocks = 0, dropped_blocks = 0, bytes = 0;
  double seconds = 0;
};

struct SessionEntry {
  uint64_t session_id = 0;
  std::string client_name;
  uint32_t pid = 0, uid = 0, gid = 0, dp_rank = 0, tp_rank = 0;
  std::string model_namespace;
  std::string state;  // "attaching" | "active"
  uint64_t attached_unix_ms = 0, pinned_blocks = 0, inflight_requests = 0;
};

// KV buffers the client created in shared memory and registered with the daemon (host backend).
struct HostKvBuffers {
  uint8_t* data = nullptr;  // valid until Detach / destruction (also across a re-Attach, see Attach)
  uint64_t bytes = 0;
  uint32_t num_blocks = 0;
  KvLayout layout = KvLayout::kBlockFirst;
};

// One TP rank's KV buffers in GPU memory, as RegisterGpuKv sends them (see flexkv/cuda.h to fill it).
// Two kinds of memory: cudaMalloc allocations travel as CUDA IPC handles (plain bytes: a TP worker may
// describe its buffers and hand the result to the attached process); cuMem/VMM allocations (PyTorch's
// expandable segments) travel as shareable file descriptors, which this struct owns, so such a description
// must be registered by the process that made it (or its fds passed on with SCM_RIGHTS).
struct GpuKvRegistration {
  std::string gpu_uuid;   // "GPU-xxxxxxxx-...", never a CUDA_VISIBLE_DEVICES-dependent index
  KvLayout layout = KvLayout::kLayerFirst;
  uint32_t num_blocks = 0;
  uint32_t tp_rank = 0;
  uint32_t component = 0;  // the geometry component these buffers hold (docs/hybrid.md); 0: full attention
  // One physical cuMem allocation, exported as a POSIX fd (closed when the last copy of it goes).
  struct VmmAllocation {
    std::shared_ptr<const int> fd;
    uint64_t bytes = 0;  // the allocation's whole size (a multiple of the allocation granularity)
  };
  struct Region {
    std::string ipc_handle;  // cudaIpcMemHandle_t bytes (64); empty for a VMM region
    uint64_t offset = 0;     // of the region inside the allocation (VMM: inside the first allocation)
    uint64_t bytes = 0;
    // VMM region: indices into vmm_allocations, in address order; the allocations are mapped back to back.
    std::vector<uint32_t> vmm_allocations;
  };
  std::vector<Region> regions;  // kLayerFirst: one per layer; otherwise one
  std::vector<VmmAllocation> vmm_allocations;
};

// One TP rank's per-layer CUDA interprocess events, exported for RegisterLayerEvents: plain bytes, so a TP worker
// may export its events (CudaLayerEvents in flexkv/cuda.h) and hand the result to the attached process.
struct LayerEventHandles {
  std::string gpu_uuid;              // the GPU the events (and the rank's KV buffers) are on, "GPU-..."
  uint32_t tp_rank = 0;
  std::vector<std::string> handles;  // one cudaIpcEventHandle_t (64 bytes) per layer, layer 0 first
};

// Names one submitted request; Wait/TryWait return its result exactly once. `generation` names the session
// that issued it: every Attach in this process (of any Client) gets a new one, so a ticket never answers for a
// request of another session: its Wait, TryWait and WaitLayers fail with FAILED_PRECONDITION instead.
// `id` counts from 1 within its session.
struct Ticket {
  uint64_t id = 0;
  uint64_t generation = 0;
};

// The end of one data-plane request.
struct OpResult {
  Status status;                // OK, or why (part of) the request was not done
  uint32_t matched_blocks = 0;  // Match: leading blocks cached. Store: leading blocks already cached
  uint32_t done_blocks = 0;     // Load: blocks copied. Store: blocks newly stored
  uint64_t match_handle = 0;    // Match with pin: pass to Load / Release (0 when nothing matched)
  uint64_t bytes = 0;           // Prefetch: bytes pulled from peers. Load: bytes copied (0 from a layout-4 flexkvd)
  std::string source;           // Prefetch: the node the blocks came from, or why none were pulled (empty: no peer
                                // had them); empty for every other request and for one that failed
};

class Client;

// A registered layer-event set, released (ReleaseLayerEvents) when this goes. Move-only. Must not outlive its
// Client; the CUDA events themselves are the engine's (CudaLayerEvents) and must outlive every load naming the set.
class LayerEventSet {
 public:
  LayerEventSet() = default;
  static Result<LayerEventSet> Register(Client& client, std::span<const LayerEventHandles> ranks);
  ~LayerEventSet();
  LayerEventSet(LayerEventSet&& other) noexcept;
  LayerEventSet& operator=(LayerEventSet&& other) noexcept;
  LayerEventSet(const LayerEventSet&) = delete;
  LayerEventSet& operator=(const LayerEventSet&) = delete;
  uint32_t id() const { return id_; }  // for Client::LoadWithEvents; 0 when empty
  // Releases now; OK when empty. Errors as ReleaseLayerEvents (the set is forgotten here in any case).
  Status Release();

 private:
  Client* client_ = nullptr;
  uint32_t id_ = 0;
};

class Client {
 public:
  // Connects to flexkvd. Retries only while the daemon is not up yet (no socket, or nobody listening)
  // until connect_timeout, then UNAVAILABLE. Any other failure (permission denied, not a flexkvd)
  // returns at once with its cause. The message always names the socket path.
  static Result<std::unique_ptr<Client>> Connect(const ConnectOptions& options);

  // Detaches the session, if any.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Opens this process's session: validates the geometry against the daemon's cache domain and opens
  // the session channel that ties the session to this process. FAILED_PRECONDITION when already
  // attached, a geometry mismatch or a version mismatch; INVALID_ARGUMENT for a bad geometry.
  // After the daemon lost the session (it restarted), Attach opens a new one: data-plane calls still running
  // on the old session end with UNAVAILABLE, its tickets answer FAILED_PRECONDITION, and its host KV buffers
  // stay mapped (unused by the daemon) until Detach or destruction, so pointers the engine still holds never
  // dangle. Register KV buffers again.
  Result<SessionInfo> Attach(const AttachOptions& options);
  // Ends the session; everything it held is released (calls still running on it end with FAILED_PRECONDITION;
  // its host KV buffers are unmapped once the last of them returned). OK when not attached.
  Status Detach();
  bool attached() const;

  // --- Data plane (after Attach). Submissions are asynchronous: each returns a Ticket at once (or an
  // error when the rings are full or the session is gone), many may be in flight, and one doorbell serves
  // many requests. Every request ends: Wait returns its result, DEADLINE_EXCEEDED (ticket still valid), or
  // UNAVAILABLE when the daemon went away (Attach again).
  //
  // What Wait, WaitLayers and TryWait answer for a ticket that has no result (coming):
  //   FAILED_PRECONDITION  not attached, or the ticket is of another session: one that has ended (Detach,
  //                        re-Attach, daemon restart), another Client's, or a generation never issued;
  //                        also a wait still running when Detach drops the session
  //   NOT_FOUND            of this session, but never issued by it, or its result was already taken by an
  //                        earlier Wait/TryWait (the message says which)
  //   UNAVAILABLE          the daemon closed the session (stopped or restarted): Attach again

  // Creates num_blocks blocks of KV buffers in `layout` in a sealed memfd shared with the daemon and
  // registers them (RegisterKv). One registration per session.
  Result<HostKvBuffers> CreateHostKv(KvLayout layout, uint32_t num_blocks);
  // Hybrid geometries: the host KV buffers of one component (its copy geometry, Geometry::Component), once per
  // component; a hybrid session registers every component before it loads or stores (docs/hybrid.md). A state
  // component's "blocks" are the engine's state slots.
  Result<HostKvBuffers> CreateHostKv(uint32_t component, KvLayout layout, uint32_t num_blocks);

  // Registers one TP rank's GPU KV buffers (CUDA backend), once per rank. Each TP worker describes its own
  // buffers (DescribeGpuKv in flexkv/cuda.h; the result is plain data it can hand to the attached process);
  // the attached process registers every rank. Load/Store need all tp_size ranks registered.
  Status RegisterGpuKv(const GpuKvRegistration& registration);

  // Leading blocks of `keys` that are cached. With `pin`, they stay pinned (never evicted) until Release,
  // and the result carries a match handle for Load. A session pins at most the daemon's
  // --max-session-pin-share of the pool: beyond it nothing is pinned and the result is RESOURCE_EXHAUSTED.
  // The library renews the pins' lease while this process runs; a process stopped for longer than the
  // daemon's --pin-lease loses them (Load/Release of the handle: FAILED_PRECONDITION). docs/protocol.md, "Pins".
  Result<Ticket> Match(std::span<const BlockKey> keys, bool pin = false);
  // Warms this node's cache for a prompt: `keys` (the prompt's chain from its first block, as for Match) → the
  // leading blocks cached here (matched_blocks), then the blocks after them pulled from peer daemons (the cluster
  // tier, docs/cluster.md) and cached here once verified (done_blocks; bytes: what was pulled; source: the node
  // they came from, else why none were pulled, empty when no peer had them). OK even when nothing was pulled.
  // For a hybrid geometry a pull is a whole hit (its FULL blocks, windows and state: docs/hybrid.md) or nothing:
  // matched_blocks + done_blocks is then the hit end held here, done_blocks counts FULL blocks, bytes every component's.
  // Asynchronous: the request ends when the pull has ended, bounded by the daemon's deadline for a pull; a session
  // has at most the daemon's per-session limit of prefetches in flight (beyond it the request ends with
  // RESOURCE_EXHAUSTED). It pins nothing: Match (with pin) after it, then Load. A daemon without a cluster tier
  // answers with the local hits only (done_blocks 0). A read-only session (Attach's read_only: its uid may not store
  // in the namespace) on a daemon with a cluster tier ends with PERMISSION_DENIED: a pull stores what it pulls. It ends with the session: a wait on one still in flight
  // then answers FAILED_PRECONDITION (Detach, re-Attach) or UNAVAILABLE (the daemon went away).
  // INVALID_ARGUMENT for empty keys (nothing sent); the request ends with INVALID_ARGUMENT for an all-zero key
  // (reserved: never cached) or more keys than the daemon takes in one request.
  Result<Ticket> Prefetch(std::span<const BlockKey> keys);
  // Copies blocks [first_block, first_block + dst_block_ids.size()) of a pinned match into these KV blocks, one
  // id each: an engine that holds the prefix's first `first_block` blocks already loads only past them (their KV
  // blocks are not touched). The result's done_blocks and bytes count what moved. With `layerwise`, WaitLayers
  // reports each layer as it lands, so compute on layer 0 can start while later layers copy. first_block > 0 needs
  // a flexkvd of ring layout 5: an older one is refused FAILED_PRECONDITION before anything is sent.
  //
  // Launch deadline (every Load overload; ring layout 6): `launch_deadline_ns` > 0 is an absolute CLOCK_MONOTONIC
  // time in ns (flexkv::NowNs(); the daemon is on this node, so it reads the same clock). flexkvd starts none of the
  // load's copies after it: the request then ends DEADLINE_EXCEEDED ("not launched by its launch deadline; nothing
  // was copied") with its pins released, as any failed load. So a client that gives up on a load at its deadline
  // (WaitLaunched or Wait timed out there) may hand the target blocks to someone else: whatever started before the
  // deadline finishes promptly (Wait for it), nothing starts after it. Only a load of several copies (TP ranks,
  // hybrid components, each layer of a hybrid layer-wise load) that straddled the deadline ends DEADLINE_EXCEEDED
  // with its blocks partly written. 0: no
  // deadline. INVALID_ARGUMENT for a negative one; FAILED_PRECONDITION, nothing sent, for a flexkvd of layout 4 or 5
  // (it would ignore the deadline).
  Result<Ticket> Load(uint64_t match_handle, std::span<const uint32_t> dst_block_ids, bool layerwise = false,
                      uint32_t first_block = 0, int64_t launch_deadline_ns = 0);

  // --- Layer-wise loads completed by CUDA events (no CPU wake-up between layers; docs/protocol.md "Layer events").
  // The engine creates one interprocess event per layer on each TP rank's GPU (CudaLayerEvents, flexkv/cuda.h) and
  // registers them as a set; a load naming the set makes the daemon record event[layer] on its copy stream right
  // after it enqueued that layer's copies, and the engine's compute stream waits on it (cudaStreamWaitEvent).
  //
  // The ordering contract (each step happens-before the next):
  //   1. LoadWithEvents(handle, ids, set) submits the load. The set is busy from here until the load's final
  //      completion: a second load naming it meanwhile ends with FAILED_PRECONDITION ("event_set N is busy").
  //   2. The daemon enqueues every layer's copies and records, then reports "launched"; WaitLaunched returns OK.
  //   3. Only now may the engine enqueue cudaStreamWaitEvent(its stream, event[layer]) (CudaLayerEvents::StreamWait)
  //      - a wait enqueued before step 2 would bind to the *previous* load's recording (or none: a never-recorded
  //      event does not block) and let the stream read the layer before its bytes are there. A wait binds to the
  //      recording that was last when it was enqueued, so the next load of the set cannot disturb waits already
  //      enqueued for this one.
  //   4. Wait(ticket) still ends the request (the set is free again once its result is here) and must be checked:
  //      an error after step 2 (a failed copy) means the layers' bytes are not to be trusted.
  // If WaitLaunched answers an error, nothing may wait on the events for this load (they were not all recorded).
  // Enqueue a load's waits before submitting the set's next load: a wait enqueued later binds to the later load's
  // recording (safe, but it waits for that load). Lifetime: release the set (ReleaseLayerEvents / ~LayerEventSet)
  // and destroy the engine's events only after every load naming it has ended (Wait), in that order - CUDA leaves
  // a recording into an event whose exporter destroyed it undefined.
  // Registers one set: `ranks` has every TP rank of the geometry once, each with one handle per layer. Returns the
  // set's id (never 0). INVALID_ARGUMENT naming the rank and count when they do not fit the geometry;
  // FAILED_PRECONDITION when the daemon has no CUDA backend; RESOURCE_EXHAUSTED beyond 16 sets a session.
  // A hybrid geometry's set has total_layers() events per rank, event i for entry i of Geometry::LayerOrder.
  Result<uint32_t> RegisterLayerEvents(std::span<const LayerEventHandles> ranks);
  // Forgets a set (the daemon closes its events once no load records them). NOT_FOUND for an unknown id.
  Status ReleaseLayerEvents(uint32_t event_set);
  // A Load (as above, never layer-wise by progress completions) whose layers are reported by the set's events.
  Result<Ticket> LoadWithEvents(uint64_t match_handle, std::span<const uint32_t> dst_block_ids, uint32_t event_set,
                                uint32_t first_block = 0, int64_t launch_deadline_ns = 0);
  // The same for a hybrid geometry (the component ids as the component Load above): the set's event i is recorded
  // right after the copies of entry i of Geometry::LayerOrder (a component that moves nothing records none: a wait
  // on its events passes).
  Result<Ticket> LoadWithEvents(uint64_t match_handle, std::span<const std::span<const uint32_t>> component_ids,
                                uint32_t event_set, uint32_t first_block = 0, int64_t launch_deadline_ns = 0);
  // Step 2 above: OK once the load's copies and event records are all enqueued (or it ended OK); the load's error
  // when it ended with one (its result stays for Wait); DEADLINE_EXCEEDED on timeout; the ticket errors of Wait.
  Status WaitLaunched(Ticket ticket, std::chrono::microseconds timeout);
  // Stores blocks keys[i] from KV block src_block_ids[i], keys[0] under keys.parent() (the root for a chain
  // made from a prompt's keys; the key before the slice for chain.Slice(begin, end)), so that a Match of the
  // prompt from its first block reaches them. The part of `keys` already cached under that parent is skipped.
  // A block becomes matchable only once its bytes are complete. INVALID_ARGUMENT for an all-zero key (it is
  // reserved) or a count mismatch. The request ends with FAILED_PRECONDITION, nothing stored, when the parent
  // is not cached (evicted meanwhile, or never stored): Match the prompt and store from its first uncached
  // block; with ABORTED, nothing stored, when the parent's own store has not completed yet: Wait for it first
  // (or store both in one request).
  Result<Ticket> Store(const BlockKeyChain& keys, std::span<const uint32_t> src_block_ids);
  // Hybrid geometries (docs/hybrid.md), one span of engine block ids per component, in geometry order:
  // Load copies what the handle's prefix end e needs past the engine's own first `first_block` blocks (k, 0..e):
  // component_ids[0] has e - k FULL ids for the blocks [k, e) (e = the Match's matched_blocks: a hybrid match ends
  // only at e), a sliding-window component min(window_blocks, e - k) ids for the blocks [max(k, e - w), e), a state
  // component 1 id (the engine state slot for the snapshot at e). k > 0 needs a flexkvd of ring layout 5
  // (FAILED_PRECONDITION before anything is sent otherwise). With `layerwise`, WaitLayers counts the layers of every
  // component together in Geometry::LayerOrder (layer i = the order's entry i; a component that moves nothing has
  // landed at once): wait for WaitLayers(ticket, i + 1) before computing the model layer that is entry i. A daemon
  // older than hybrid layer-wise loads refuses it (the request ends INVALID_ARGUMENT).
  Result<Ticket> Load(uint64_t match_handle, std::span<const std::span<const uint32_t>> component_ids,
                      uint32_t first_block = 0, int64_t launch_deadline_ns = 0, bool layerwise = false);
  // Store of n keys: component_ids[0] has n FULL ids, a sliding-window component the ids of its last m keys, a
  // state component one id per entry of `state_boundaries` (each in 1..n, increasing; boundary b = the snapshot
  // after keys[b - 1]). m is `window_keys`, or min(window_blocks, n) when it is 0 (the trailing window); an engine
  // that still holds more window blocks gives up to n of them (m at least every window's min(window_blocks, n)),
  // so that every prefix end inside the store whose window (and state) is there becomes a hit. window_keys > 0
  // needs a flexkvd of ring layout 5 (FAILED_PRECONDITION before anything is sent otherwise). All or none: when a
  // sub-pool cannot take its part, nothing is stored (RESOURCE_EXHAUSTED). INVALID_ARGUMENT (nothing sent) when a
  // span's size does not match.
  Result<Ticket> Store(const BlockKeyChain& keys, std::span<const std::span<const uint32_t>> component_ids,
                       std::span<const uint32_t> state_boundaries, uint32_t window_keys = 0);
  // Drops the pins of a match handle.
  Result<Ticket> Release(uint64_t match_handle);

  // The same lookup as Match without pin, as a unary gRPC call: ~50x slower than the rings. For
  // comparison (flexkv-bench ring) and diagnostics.
  Result<uint32_t> MatchViaControl(std::span<const BlockKey> keys);

  Result<OpResult> Wait(Ticket ticket, std::chrono::microseconds timeout);
  // For a layer-wise Load: waits until at least `layers` layers have landed (or the request ended, also when
  // its result was taken); returns how many have. DEADLINE_EXCEEDED on timeout.
  Result<uint32_t> WaitLayers(Ticket ticket, uint32_t layers, std::chrono::microseconds timeout);
  // The result if the request has ended, nullopt while it is in flight ("not yet"); the errors above otherwise.
  Result<std::optional<OpResult>> TryWait(Ticket ticket);

  Result<DaemonStatus> GetStatus();
  Result<std::vector<SessionEntry>> ListSessions();
  // The daemon's Prometheus metrics, in the text exposition format 0.0.4 (docs/operations.md, "Metrics").
  Result<std::string> GetMetrics();
  // Admin calls (root, the daemon's uid, or --admin-group). Return the state after the call.
  Result<std::string> Drain();
  Result<std::string> Resume();
  // Admin: drops the cache domain of `model_namespace` (empty: the only one; INVALID_ARGUMENT when there are
  // several) and its pool, blocks included, so that its budget is free and the namespace may take another geometry.
  // FAILED_PRECONDITION while a session of that domain is attached, its blocks are pinned, or it has had a session
  // within `min_idle_s`; NOT_FOUND (naming the domains there are) when no domain has that namespace. Other domains
  // are untouched. Returns the blocks dropped.
  Result<uint64_t> DropDomain(const std::string& model_namespace = {}, uint64_t min_idle_s = 0);
  // Admin: checks every cached block's bytes against its checksum (failed ones are dropped) and answers when
  // done, at most `max_bytes_per_s` (0: unlimited); `timeout` bounds the wait. Every domain's pool, or only
  // `model_namespace`'s.
  Result<ScrubResult> Scrub(uint64_t max_bytes_per_s, std::chrono::milliseconds timeout,
                            const std::string& model_namespace = {});
  // grpc.health.v1 Check of the whole server: OK when SERVING, UNAVAILABLE otherwise.
  Status CheckHealth();

  const std::string& socket_path() const;

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  // The component Load and LoadWithEvents: layer progress or the set's events (never both).
  Result<Ticket> LoadComponents(uint64_t match_handle, std::span<const std::span<const uint32_t>> component_ids,
                                uint32_t first_block, int64_t launch_deadline_ns, bool layerwise, uint32_t event_set);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexkv

/* libflexkv C ABI: the whole client API for languages that cannot use the C++ one (the Python package
 * `flexkv` loads it with ctypes). Mirrors flexkv/client.h; read that header for the semantics of each call.
 *
 * Conventions:
 *  - Every function that can fail returns a status code: 0 = OK, otherwise the gRPC code number
 *    (FLEXKV_INVALID_ARGUMENT = 3, FLEXKV_DEADLINE_EXCEEDED = 4, FLEXKV_UNAVAILABLE = 14, ...).
 *  - The message of the last failure *on the calling thread* is flexkv_last_error(); it stays valid until
 *    the next call on that thread. A client may be used from several threads at once (the C++ client is
 *    thread-safe), flexkv_attach and flexkv_detach included (a call running on a session that flexkv_detach
 *    ends returns FLEXKV_FAILED_PRECONDITION); only flexkv_close must not race with other calls on it.
 *  - Waits block at most the timeout they are given (more than a year counts as a year). Every other call is
 *    bounded by the client's call timeout (10 s) per daemon round trip it makes: attach and close make up to
 *    three, create_host_kv two, register_gpu_kv one per cuMem allocation it offers plus one.
 *  - No C++ exception crosses this ABI: an out-of-memory inside libflexkv returns RESOURCE_EXHAUSTED.
 *  - Block keys are 16-byte {lo, hi} pairs, as flexkv_compute_block_keys writes them.
 *  - The ABI is versioned: FLEXKV_ABI_VERSION below is this header's, flexkv_abi_version() the loaded library's.
 *    A binding checks that they match and that flexkv_struct_size() agrees with its own structs before any
 *    other call (the Python package refuses to import otherwise). */
#ifndef FLEXKV_C_H_
#define FLEXKV_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on every change that a caller built against the previous header would misread: a function's
 * parameters or meaning, a struct's layout, a status code's meaning. 2: tickets became flexkv_ticket.
 * 3: flexkv_store takes the parent key of its first key.
 * 4: hybrid models: flexkv_geometry gains n_components and components (flexkv_component); new
 *    flexkv_create_host_kv_component, flexkv_gpu_kv_set_component, flexkv_load_components,
 *    flexkv_store_components, flexkv_session_component and flexkv_get_status_components
 *    (flexkv_component_status).
 * 5: Prefetch: new flexkv_prefetch; flexkv_op_result gains bytes and source at its end.
 * 6: layer-wise loads completed by CUDA events: flexkv_layer_events (create, stream_wait, free),
 *    flexkv_register_layer_events, flexkv_release_layer_events, flexkv_load_with_events, flexkv_wait_launched. */
#define FLEXKV_ABI_VERSION 6

enum {
  FLEXKV_OK = 0,
  FLEXKV_CANCELLED = 1,
  FLEXKV_UNKNOWN = 2,
  FLEXKV_INVALID_ARGUMENT = 3,
  FLEXKV_DEADLINE_EXCEEDED = 4,
  FLEXKV_NOT_FOUND = 5,
  FLEXKV_ALREADY_EXISTS = 6,
  FLEXKV_PERMISSION_DENIED = 7,
  FLEXKV_RESOURCE_EXHAUSTED = 8,
  FLEXKV_FAILED_PRECONDITION = 9,
  FLEXKV_ABORTED = 10,
  FLEXKV_OUT_OF_RANGE = 11,
  FLEXKV_UNIMPLEMENTED = 12,
  FLEXKV_INTERNAL = 13,
  FLEXKV_UNAVAILABLE = 14,
  FLEXKV_DATA_LOSS = 15,
  FLEXKV_UNAUTHENTICATED = 16,
};

/* KV layouts (flexkv::KvLayout; docs/protocol.md "KV layouts"). LAYER_BLOCK_REGIONS (added within ABI 6; a
 * libflexkv from before refuses it with FLEXKV_INVALID_ARGUMENT): [layer][block][plane][chunk] with one GPU region
 * per layer, as vLLM's FlashInfer / Triton per-layer tensors (num_blocks, 2, block_size, heads, head_dim). */
enum {
  FLEXKV_LAYOUT_LAYER_FIRST = 1,
  FLEXKV_LAYOUT_BLOCK_FIRST = 2,
  FLEXKV_LAYOUT_LAYER_BLOCK = 3,
  FLEXKV_LAYOUT_LAYER_BLOCK_REGIONS = 4
};

typedef struct flexkv_client flexkv_client;

/* Component kinds of a hybrid model (flexkv::ComponentKind). */
enum { FLEXKV_COMPONENT_FULL = 1, FLEXKV_COMPONENT_SLIDING_WINDOW = 2, FLEXKV_COMPONENT_STATE = 3 };

/* A component of a hybrid model beside its full-attention layers (flexkv::ComponentSpec; docs/protocol.md
 * "Geometry"). SLIDING_WINDOW: kv_planes, kv_heads_per_rank, head_dim, dtype_bytes as the geometry's fields of the
 * same name, and window_tokens; state_bytes_per_layer 0. STATE: state_bytes_per_layer (one layer's snapshot on one
 * TP rank, a multiple of 16); window_tokens 0, the attention fields ignored. */
typedef struct flexkv_component {
  uint32_t kind; /* FLEXKV_COMPONENT_SLIDING_WINDOW or FLEXKV_COMPONENT_STATE */
  uint32_t num_layers;
  uint32_t kv_planes;
  uint32_t kv_heads_per_rank;
  uint32_t head_dim;
  uint32_t dtype_bytes;
  uint32_t window_tokens;
  uint32_t reserved; /* must be 0 */
  uint64_t state_bytes_per_layer;
} flexkv_component;

/* The geometry's own fields are component 0 (the full-attention layers); a hybrid model lists its other
 * components in `components` (n_components entries, at most 7; read during flexkv_attach only). A full-attention
 * model: n_components 0 and components NULL. */
typedef struct flexkv_geometry {
  uint32_t tokens_per_block;
  uint32_t num_layers;
  uint32_t kv_planes;
  uint32_t kv_heads_per_rank;
  uint32_t head_dim;
  uint32_t dtype_bytes;
  uint32_t tp_size;
  uint32_t n_components;
  const flexkv_component* components;
} flexkv_geometry;

typedef struct flexkv_daemon_status {
  char state[16];        /* "serving" | "draining" | "drained" */
  char version[32];
  uint32_t pid;
  uint64_t uptime_s;
  uint64_t block_bytes;
  uint64_t capacity_blocks;
  uint64_t used_blocks;
  uint64_t pinned_blocks;
  uint64_t index_blocks;
  uint32_t sessions;
} flexkv_daemon_status;

/* One sub-pool of the daemon's cache domain (flexkv::DaemonStatus::Pool::Component); component 0 first. */
typedef struct flexkv_component_status {
  uint32_t kind; /* FLEXKV_COMPONENT_* */
  uint32_t reserved;
  uint64_t slot_bytes;
  uint64_t capacity; /* slots */
  uint64_t used;     /* pending + committed */
  uint64_t pinned;
  uint64_t evicted;
  uint64_t unanchored; /* entries whose full-attention block is gone (evicted first) */
} flexkv_component_status;

typedef struct flexkv_block_key {
  uint64_t lo;
  uint64_t hi;
} flexkv_block_key;

/* The end of one data-plane request (flexkv::OpResult). status_code 0 = done; otherwise why (part of) the
 * request was not done, with the daemon's message. */
typedef struct flexkv_op_result {
  int32_t status_code;
  uint32_t matched_blocks; /* Match: leading blocks cached. Store: leading blocks already cached */
  uint32_t done_blocks;    /* Load: blocks copied. Store: blocks newly stored */
  uint64_t match_handle;   /* Match with pin: for flexkv_load / flexkv_release (0 when nothing matched) */
  char message[256];       /* NUL-terminated; empty when status_code is 0 */
  uint64_t bytes;          /* Prefetch: bytes pulled from peers (5) */
  /* Prefetch with status_code 0: the node the blocks came from, or why none were pulled; empty when no peer had
   * them. NUL-terminated; empty for every other request (5). */
  char source[96];
} flexkv_op_result;

/* Names one submitted request (flexkv::Ticket). generation names the session that issued it (every attach in
 * the process gets a new one); id counts from 1 within that session. A ticket of another session (one that
 * ended, another client's, a generation never issued) is answered with FLEXKV_FAILED_PRECONDITION, never
 * with another request's result. */
typedef struct flexkv_ticket {
  uint64_t id;
  uint64_t generation;
} flexkv_ticket;

/* One rank's GPU KV buffers described for registration (flexkv::GpuKvRegistration); may hold file
 * descriptors (cuMem/VMM allocations), released by flexkv_gpu_kv_free. */
typedef struct flexkv_gpu_kv flexkv_gpu_kv;

/* ---- Versions (no daemon needed) ---- */

/* The loaded library's FLEXKV_ABI_VERSION. */
uint32_t flexkv_abi_version(void);
/* sizeof one struct of this header as the library was built ("flexkv_geometry", "flexkv_component",
 * "flexkv_daemon_status", "flexkv_component_status", "flexkv_block_key", "flexkv_op_result", "flexkv_ticket");
 * 0 for a name it does not know (also NULL). */
size_t flexkv_struct_size(const char* name);
/* libflexkv's release version ("0.1.0"): the project version it was built as, the one flexkvd reports. */
const char* flexkv_version(void);

/* ---- Block keys (no daemon needed) ---- */

/* Keys of the whole blocks of `tokens` in `model_namespace` (namespace_len bytes, need not be
 * NUL-terminated). Writes min(n_tokens / tokens_per_block, capacity) keys to out and the number of whole
 * blocks to *count. INVALID_ARGUMENT when tokens_per_block is 0 or a pointer is NULL with a non-zero size. */
int flexkv_compute_block_keys(const char* model_namespace, size_t namespace_len, const int32_t* tokens,
                              size_t n_tokens, uint32_t tokens_per_block, flexkv_block_key* out, size_t capacity,
                              size_t* count);
/* As flexkv_compute_block_keys, with what changes a block's KV besides its tokens (flexkv::BlockExtra): `extras`
 * holds n_extras digests of 16 bytes, block i's at extras + 16 * i (all zero: none; blocks past n_extras have
 * none). A block with an extra gets another key, and so does every block after it. extras may be NULL with
 * n_extras 0. Added without an ABI bump (a new function). */
int flexkv_compute_block_keys_extra(const char* model_namespace, size_t namespace_len, const int32_t* tokens,
                                    size_t n_tokens, uint32_t tokens_per_block, const uint8_t* extras,
                                    size_t n_extras, flexkv_block_key* out, size_t capacity, size_t* count);

/* XXH3-64 of `model_namespace` (namespace_len bytes; NULL only with 0): the seed of its block keys, and the name a KV
 * event gives a domain the daemon knows only by this hash ("#" and 16 lowercase hex digits: an SSD block whose
 * namespace has not been attached since the daemon started, docs/kv_events.md). Added without an ABI bump. */
uint64_t flexkv_namespace_hash(const char* model_namespace, size_t namespace_len);

/* ---- Connection and session ---- */

/* socket_path may be NULL ($FLEXKV_SOCKET or the default). On success *out owns a client. On failure
 * *out is NULL and, when error_buf is non-NULL, the reason is copied there (NUL-terminated; also
 * flexkv_last_error()). */
int flexkv_connect(const char* socket_path, int timeout_ms, flexkv_client** out, char* error_buf, size_t error_len);
int flexkv_attach(flexkv_client* client, const char* client_name, const char* model_namespace, uint32_t dp_rank,
                  uint32_t tp_rank, const flexkv_geometry* geometry, uint64_t* session_id);
int flexkv_detach(flexkv_client* client);
/* What the attach answered for one geometry component (0 = the full-attention layers): the host bytes of one slot
 * (a block, or a state snapshot) and the slots of its sub-pool. FLEXKV_FAILED_PRECONDITION when not attached,
 * FLEXKV_INVALID_ARGUMENT for a component the geometry does not have. */
int flexkv_session_component(flexkv_client* client, uint32_t component, uint64_t* slot_bytes, uint64_t* capacity);
int flexkv_get_status(flexkv_client* client, flexkv_daemon_status* out);
/* The sub-pools of the daemon's cache domain (GetStatus): writes min(count, capacity) entries to `out` and the number
 * of sub-pools to *count (0 before a domain is set, or from a daemon that does not report them). */
int flexkv_get_status_components(flexkv_client* client, flexkv_component_status* out, size_t capacity,
                                 size_t* count);
/* What a router compares (docs/kv_events.md, docs/routing.md "Liveness"): the KV event stream's part of GetStatus and
 * the cluster tier's (flexkv::DaemonStatus::KvEvents, ::Cluster). Added without an ABI bump (new functions and
 * structs only). */
typedef struct flexkv_kv_events_status {
  uint64_t instance_id;   /* random per daemon start */
  uint64_t last_seq;      /* the last event's seq (numbered only while someone subscribes) */
  uint32_t subscribers;
  uint32_t reserved;
  uint64_t cut_off;       /* subscribers cut off for falling behind */
  uint64_t buffer_events; /* --kv-events-buffer */
} flexkv_kv_events_status;
typedef struct flexkv_cluster_status {
  uint32_t present;   /* 0: the daemon runs no cluster tier (no --etcd-endpoints); the rest is zero */
  uint32_t reserved;
  uint64_t epoch;     /* this node's membership epoch */
  char state[160];    /* "joined" | "joining: <why not yet>" | "stopped", NUL-terminated, cut to fit */
  char node_id[72];   /* --node-id, NUL-terminated */
  char endpoint[72];  /* the transfer endpoint, NUL-terminated */
} flexkv_cluster_status;
typedef struct flexkv_cluster_member {
  uint64_t epoch;
  uint32_t self;      /* 1: this daemon */
  uint32_t reserved;
  char node_id[72];   /* NUL-terminated */
  char endpoint[72];  /* NUL-terminated */
} flexkv_cluster_member;
/* One GetStatus: fills *status (may be NULL), *events and *cluster, writes min(count, capacity) members to `members`
 * (the cluster's current members as this daemon sees them) and their number to *count (0 without a cluster tier). */
int flexkv_get_status_routing(flexkv_client* client, flexkv_daemon_status* status, flexkv_kv_events_status* events,
                              flexkv_cluster_status* cluster, flexkv_cluster_member* members, size_t capacity,
                              size_t* count);
/* Admin calls: *state_out (may be NULL, at least 16 bytes) receives the state after the call. */
int flexkv_drain(flexkv_client* client, char* state_out, size_t state_len);
int flexkv_resume(flexkv_client* client, char* state_out, size_t state_len);
/* 0 when the daemon is SERVING, FLEXKV_UNAVAILABLE otherwise. */
int flexkv_check_health(flexkv_client* client);

/* ---- KV buffers ---- */

/* Host backend: creates num_blocks blocks of KV buffers in `layout` in memory shared with the daemon.
 * *data is valid until flexkv_detach / flexkv_close; *bytes is its size. */
int flexkv_create_host_kv(flexkv_client* client, int layout, uint32_t num_blocks, void** data, uint64_t* bytes);
/* Hybrid models: the host KV buffers of one component, in its copy geometry (for a state component each "block"
 * is one state slot: num_layers x state_bytes_per_layer bytes); once per component. flexkv_create_host_kv is
 * component 0. FLEXKV_INVALID_ARGUMENT for a component the geometry does not have, FLEXKV_ALREADY_EXISTS when that
 * component is already registered. */
int flexkv_create_host_kv_component(flexkv_client* client, uint32_t component, int layout, uint32_t num_blocks,
                                    void** data, uint64_t* bytes);

/* CUDA backend: describes one rank's GPU KV buffers at device pointers (CUDA IPC handles for cudaMalloc
 * memory, shareable fds for cuMem/VMM memory such as PyTorch's expandable segments). LAYER_FIRST and
 * LAYER_BLOCK_REGIONS: one pointer per layer; otherwise one. region_bytes: bytes of each region. On success *out
 * must be freed with flexkv_gpu_kv_free. Fails with UNIMPLEMENTED in a libflexkv built without CUDA. */
int flexkv_describe_gpu_kv(int layout, void* const* regions, size_t n_regions, uint64_t region_bytes,
                           uint32_t num_blocks, uint32_t tp_rank, flexkv_gpu_kv** out);
/* The GPU's UUID ("GPU-…") the description names; valid while `kv` lives. */
const char* flexkv_gpu_kv_uuid(const flexkv_gpu_kv* kv);
/* Hybrid models: the geometry component the described buffers hold (0, the full-attention layers, unless set);
 * describe and register each component's buffers of a rank separately. */
int flexkv_gpu_kv_set_component(flexkv_gpu_kv* kv, uint32_t component);
int flexkv_register_gpu_kv(flexkv_client* client, const flexkv_gpu_kv* kv);
void flexkv_gpu_kv_free(flexkv_gpu_kv* kv);
/* TP engines: one process registers every TP rank's GPU KV (Load/Store need all tp_size ranks), so rank r's
 * description travels to it as bytes. flexkv_gpu_kv_export writes `kv` as those bytes (the RegisterKvRequest
 * message of proto/flexkv/v1/control.proto without its session fields) to buf (cap bytes) and their size to *len;
 * with buf NULL it only sets *len; FLEXKV_OUT_OF_RANGE when cap is too small. FLEXKV_FAILED_PRECONDITION for cuMem/VMM
 * memory (PyTorch's expandable segments), whose file descriptors cannot travel as bytes. The bytes carry CUDA IPC
 * handles: they are usable on this node only, and only while the describing process keeps the memory.
 * flexkv_gpu_kv_import makes a description of such bytes for flexkv_register_gpu_kv (*out freed with
 * flexkv_gpu_kv_free); FLEXKV_INVALID_ARGUMENT, naming what is wrong, for bytes that are not one. */
int flexkv_gpu_kv_export(const flexkv_gpu_kv* kv, void* buf, size_t cap, size_t* len);
int flexkv_gpu_kv_import(const void* buf, size_t len, flexkv_gpu_kv** out);

/* ---- Data plane (after attach). Each submission writes a ticket; every ticket ends exactly once. ---- */

int flexkv_match(flexkv_client* client, const flexkv_block_key* keys, size_t n_keys, int pin, flexkv_ticket* ticket);
/* Client::Prefetch: keys (a prompt's chain from its first block) → matched_blocks cached here, then done_blocks
 * pulled from peer daemons (cluster tier) and cached here, bytes pulled, source. Pins nothing (flexkv_match after
 * it); OK even when nothing was pulled; a daemon without a cluster tier answers with the local hits only. A hybrid
 * geometry's pull is a whole hit or nothing (done_blocks: its FULL blocks; bytes: every component's). */
int flexkv_prefetch(flexkv_client* client, const flexkv_block_key* keys, size_t n_keys, flexkv_ticket* ticket);
int flexkv_load(flexkv_client* client, uint64_t match_handle, const uint32_t* dst_block_ids, size_t n_blocks,
                int layerwise, flexkv_ticket* ticket);
/* Stores keys[i] from KV block src_block_ids[i], keys[0] under `parent`: the key of the block before keys[0] in
 * its prompt, or NULL when keys[0] is the prompt's first block (root). A store of keys[20..30) of a prompt
 * passes &keys[19]. The request ends with FLEXKV_FAILED_PRECONDITION, nothing stored, when the parent is not
 * cached, and FLEXKV_ABORTED when the parent's own store has not completed yet (Client::Store). */
int flexkv_store(flexkv_client* client, const flexkv_block_key* parent, const flexkv_block_key* keys,
                 const uint32_t* src_block_ids, size_t n, flexkv_ticket* ticket);
/* Hybrid models (Client::Load / Client::Store with per-component spans): component_ids[i] points at counts[i]
 * block ids of component i, for every component of the geometry (n_components = 1 + the geometry's
 * n_components). A load gives the handle's whole prefix end e: e FULL ids, min(window_blocks, e) ids of a sliding-
 * window component (blocks [e - n, e)), 1 id of a state component. A store of n_keys keys: n_keys FULL ids,
 * min(window_blocks, n_keys) ids of a sliding-window component (its last keys), one id of a state component per
 * state boundary (each in 1..n_keys, strictly increasing; boundary b = the snapshot after keys[b - 1]). Wrong
 * counts or boundaries: FLEXKV_INVALID_ARGUMENT naming the component, its kind and the count expected, nothing
 * sent. The single-span flexkv_load / flexkv_store refuse a hybrid session (FLEXKV_INVALID_ARGUMENT). */
int flexkv_load_components(flexkv_client* client, uint64_t match_handle, const uint32_t* const* component_ids,
                           const size_t* counts, size_t n_components, flexkv_ticket* ticket);
int flexkv_store_components(flexkv_client* client, const flexkv_block_key* parent, const flexkv_block_key* keys,
                            size_t n_keys, const uint32_t* const* component_ids, const size_t* counts,
                            size_t n_components, const uint32_t* state_boundaries, size_t n_boundaries,
                            flexkv_ticket* ticket);
/* Added within ABI 6 (ring layout 5): loads past the engine's own prefix, and stores of more window blocks.
 * flexkv_load_from: as flexkv_load (event_set 0) or flexkv_load_with_events (event_set not 0, layerwise 0), of the
 * match's blocks [first_block, first_block + n_blocks): the engine holds the first first_block blocks already.
 * flexkv_load_components_from: as flexkv_load_components, for a hybrid prefix end e = first_block + counts[0] (k =
 * first_block, 0..e): e - k FULL ids (blocks [k, e)), min(window_blocks, e - k) ids of a sliding-window component
 * (blocks [max(k, e - w), e)), 1 id of a state component. flexkv_store_components_windows: as
 * flexkv_store_components, each sliding-window component giving the ids of the last window_keys keys (0: min(
 * window_blocks, n_keys), as flexkv_store_components; else at least every window's min(window_blocks, n_keys) and at
 * most n_keys). first_block or window_keys above 0 to a flexkvd of ring layout 4: FLEXKV_FAILED_PRECONDITION,
 * nothing sent. The op result's bytes count a load's copied bytes. */
int flexkv_load_from(flexkv_client* client, uint64_t match_handle, uint32_t first_block, const uint32_t* dst_block_ids,
                     size_t n_blocks, int layerwise, uint32_t event_set, flexkv_ticket* ticket);
int flexkv_load_components_from(flexkv_client* client, uint64_t match_handle, uint32_t first_block,
                                const uint32_t* const* component_ids, const size_t* counts, size_t n_components,
                                flexkv_ticket* ticket);
int flexkv_store_components_windows(flexkv_client* client, const flexkv_block_key* parent,
                                    const flexkv_block_key* keys, size_t n_keys, const uint32_t* const* component_ids,
                                    const size_t* counts, size_t n_components, const uint32_t* state_boundaries,
                                    size_t n_boundaries, uint32_t window_keys, flexkv_ticket* ticket);
/* Added within ABI 6 (ring layout 6): loads with a launch deadline (Client::Load, "Launch deadline").
 * flexkv_load_by / flexkv_load_components_by: as flexkv_load_from / flexkv_load_components_from, and flexkvd starts
 * none of the load's copies after launch_deadline_ns, an absolute CLOCK_MONOTONIC time in ns (0: none): the load
 * then ends FLEXKV_DEADLINE_EXCEEDED with nothing copied. A negative deadline: FLEXKV_INVALID_ARGUMENT; a deadline to
 * a flexkvd of ring layout 4 or 5: FLEXKV_FAILED_PRECONDITION; nothing sent either way. */
int flexkv_load_by(flexkv_client* client, uint64_t match_handle, uint32_t first_block, const uint32_t* dst_block_ids,
                   size_t n_blocks, int layerwise, uint32_t event_set, int64_t launch_deadline_ns,
                   flexkv_ticket* ticket);
int flexkv_load_components_by(flexkv_client* client, uint64_t match_handle, uint32_t first_block,
                              const uint32_t* const* component_ids, const size_t* counts, size_t n_components,
                              int64_t launch_deadline_ns, flexkv_ticket* ticket);
/* Added within ABI 6: layer-wise loads of a hybrid geometry (Client::Load's component overload, docs/hybrid.md
 * "Layer-wise loads"). As flexkv_load_components_by, and with layerwise (not 0) flexkv_wait_layers counts every
 * component's layers together in the geometry's layer order (flexkv_layer_order), or with event_set (not 0, layerwise
 * 0) the set's event i is recorded after the copies of entry i of that order. Both: FLEXKV_INVALID_ARGUMENT. A
 * flexkvd older than hybrid layer-wise loads ends the request FLEXKV_INVALID_ARGUMENT. */
int flexkv_load_components_layered(flexkv_client* client, uint64_t match_handle, uint32_t first_block,
                                   const uint32_t* const* component_ids, const size_t* counts, size_t n_components,
                                   int layerwise, uint32_t event_set, int64_t launch_deadline_ns,
                                   flexkv_ticket* ticket);
/* The layer order of a layer-wise load of this geometry (flexkv::Geometry::LayerOrder): for i < *n (the geometry's
 * layers of every component together), component[i] and layer[i] say which component's layer is the load's layer
 * i. `capacity` entries fit in each array; FLEXKV_OUT_OF_RANGE (with *n set) when they are too few, and
 * FLEXKV_INVALID_ARGUMENT for a geometry that does not validate. */
int flexkv_layer_order(const flexkv_geometry* geometry, uint32_t* component, uint32_t* layer, size_t capacity,
                       size_t* n);
int flexkv_release(flexkv_client* client, uint64_t match_handle, flexkv_ticket* ticket);
/* The unary gRPC match (slow path, diagnostics). */
int flexkv_match_via_control(flexkv_client* client, const flexkv_block_key* keys, size_t n_keys, uint32_t* matched);

/* Waits up to timeout_us for the request to end. The result of a request is handed out once.
 *   0                           it ended and *out holds its result (whose own status_code may be an error)
 *   FLEXKV_DEADLINE_EXCEEDED    not ended yet; the ticket stays valid
 *   FLEXKV_FAILED_PRECONDITION  not attached, or a ticket of another session (ended, another client's, or a
 *                               generation never issued), or the session was detached while waiting
 *   FLEXKV_NOT_FOUND            a ticket of this session that it never issued, or whose result an earlier
 *                               wait already took (the message says which)
 *   FLEXKV_UNAVAILABLE          the daemon went away (attach again) */
int flexkv_wait(flexkv_client* client, flexkv_ticket ticket, int64_t timeout_us, flexkv_op_result* out);
/* flexkv_wait without waiting: FLEXKV_DEADLINE_EXCEEDED means "not ended yet"; the other codes as there. */
int flexkv_try_wait(flexkv_client* client, flexkv_ticket ticket, flexkv_op_result* out);
/* Layer-wise load: waits until at least `layers` layers have landed or the request ended (also when a wait
 * took its result); *landed gets how many have. FLEXKV_DEADLINE_EXCEEDED on timeout; other codes as
 * flexkv_wait's. */
int flexkv_wait_layers(flexkv_client* client, flexkv_ticket ticket, uint32_t layers, int64_t timeout_us,
                       uint32_t* landed);

/* KV events (flexkv/kv_events.h, docs/kv_events.md): a subscription of its own connection. Added without an ABI
 * bump (new functions and structs only). */
typedef struct flexkv_kv_subscription flexkv_kv_subscription;
enum { FLEXKV_KV_STORED = 0, FLEXKV_KV_REMOVED = 1, FLEXKV_KV_CLEARED = 2 };
enum { FLEXKV_KV_TIER_DRAM = 0, FLEXKV_KV_TIER_SSD = 1 };
typedef struct flexkv_kv_event {
  uint64_t seq;              /* 0 in a snapshot */
  flexkv_block_key key;
  flexkv_block_key parent;   /* stored: the parent (zero: a prompt's first block) */
  uint32_t tokens_per_block; /* the domain's (0: unknown) */
  uint8_t kind;              /* FLEXKV_KV_STORED, _REMOVED, _CLEARED */
  uint8_t tier;              /* FLEXKV_KV_TIER_DRAM, _SSD */
  uint8_t component;         /* hybrid geometries: the entry's component (0: full attention; vLLM's group_idx) */
  uint8_t reserved;
  char model_namespace[260]; /* NUL-terminated (namespaces are at most 256 bytes) */
  char cause[20];            /* "store", "promoted", ..., NUL-terminated */
} flexkv_kv_event;
typedef struct flexkv_kv_batch {
  uint64_t instance_id, started_unix_ms, snapshot_seq, head_seq, position;
  uint8_t snapshot, snapshot_end;
  uint8_t reserved[6];
  size_t n_events;           /* events of this batch; the first min(n_events, capacity) were written */
} flexkv_kv_batch;
/* Subscribes (socket_path NULL or "": $FLEXKV_SOCKET or the default; max_batch_events 0: the daemon's default). */
int flexkv_kv_subscribe(const char* socket_path, int timeout_ms, uint32_t max_batch_events, int skip_snapshot,
                        flexkv_kv_subscription** out);
/* Blocks for the next batch (KvEventSubscription::Next): its header in *batch and its events in events[0..capacity);
 * a batch with more events than capacity keeps the rest for the next calls (same header, snapshot_end and position
 * only on its last part). INVALID_ARGUMENT when capacity is 0 (it must be >= 1). The stream's end is the status: RESOURCE_EXHAUSTED (fell behind: subscribe again),
 * UNAVAILABLE (the daemon stopped), CANCELLED. */
int flexkv_kv_next(flexkv_kv_subscription* sub, flexkv_kv_batch* batch, flexkv_kv_event* events, size_t capacity);
/* Makes a flexkv_kv_next blocked in another thread return CANCELLED. */
void flexkv_kv_cancel(flexkv_kv_subscription* sub);
/* Cancels and frees. NULL is ignored. */
void flexkv_kv_close(flexkv_kv_subscription* sub);

/* ---- Layer-wise loads completed by CUDA events (Client::LoadWithEvents; the ordering contract is in
 * flexkv/client.h and docs/protocol.md "Layer events"). ----
 * flexkv_layer_events_create makes num_layers interprocess events (cudaEventInterprocess |
 * cudaEventDisableTiming) on the calling thread's current CUDA device for TP rank tp_rank; *out is freed (and the
 * events destroyed) by flexkv_layer_events_free, after the last load naming a set of them ended. UNIMPLEMENTED in
 * a libflexkv built without CUDA.
 * flexkv_register_layer_events registers the events of every TP rank (ranks[0..n_ranks), each rank once) as one
 * set; *event_set gets its id (never 0). flexkv_load_with_events loads as flexkv_load, the daemon recording
 * event[layer] after each layer's copies; the set is busy until the load ends (a second load naming it ends with
 * FLEXKV_FAILED_PRECONDITION). flexkv_wait_launched returns 0 once every copy and record is enqueued (or the load
 * ended OK), the load's error when it ended with one. Only then may flexkv_layer_events_stream_wait make `stream`
 * (a cudaStream_t, NULL = the legacy default stream) wait for a layer. */
typedef struct flexkv_layer_events flexkv_layer_events;
int flexkv_layer_events_create(uint32_t num_layers, uint32_t tp_rank, flexkv_layer_events** out);
int flexkv_layer_events_stream_wait(const flexkv_layer_events* events, uint32_t layer, void* stream);
void flexkv_layer_events_free(flexkv_layer_events* events);
int flexkv_register_layer_events(flexkv_client* client, const flexkv_layer_events* const* ranks, size_t n_ranks,
                                 uint32_t* event_set);
int flexkv_release_layer_events(flexkv_client* client, uint32_t event_set);
int flexkv_load_with_events(flexkv_client* client, uint64_t match_handle, const uint32_t* dst_block_ids,
                            size_t n_blocks, uint32_t event_set, flexkv_ticket* ticket);
int flexkv_wait_launched(flexkv_client* client, flexkv_ticket ticket, int64_t timeout_us);

/* The calling thread's last failure message ("" after a success). */
const char* flexkv_last_error(void);
/* Detaches and frees. NULL is ignored. */
void flexkv_close(flexkv_client* client);

#ifdef __cplusplus
}
#endif

#endif /* FLEXKV_C_H_ */

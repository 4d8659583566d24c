// C ABI over flexkv::Client; see flexkv/c.h. Over 700 lines: one thin, checked wrapper per exported function (each
// validates its pointers and sizes and copies into the C structs); they share only the handle and error helpers.
#include "flexkv/c.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "common/version.h"
#include "flexkv/client.h"
#include "flexkv/cuda.h"
#include "flexkv/kv_events.h"
#include "flexkv/v1/control.pb.h"

struct flexkv_client {
  explicit flexkv_client(std::unique_ptr<flexkv::Client> c) : client(std::move(c)) {}
  std::unique_ptr<flexkv::Client> client;
  flexkv::Mutex mu;
  // What the last successful attach answered (flexkv_session_component).
  flexkv::SessionInfo session ABSL_GUARDED_BY(mu);
};

struct flexkv_gpu_kv {
  flexkv::GpuKvRegistration registration;
};

struct flexkv_layer_events {
  flexkv::CudaLayerEvents events;
};

namespace {

// The calling thread's last failure; see flexkv_last_error.
thread_local std::string last_error;

int Record(const flexkv::Status& s) {
  last_error = s.ok() ? std::string() : s.ToString();
  return static_cast<int>(s.code());
}

int NullArgument(const char* what) {
  return Record(flexkv::Status::InvalidArgument(std::string(what) + " must not be NULL"));
}

// flexkv_block_key and flexkv::BlockKey have the same layout (two little-endian u64, lo first).
static_assert(sizeof(flexkv_block_key) == sizeof(flexkv::BlockKey));
static_assert(FLEXKV_LAYOUT_LAYER_FIRST == static_cast<int>(flexkv::KvLayout::kLayerFirst) &&
              FLEXKV_LAYOUT_BLOCK_FIRST == static_cast<int>(flexkv::KvLayout::kBlockFirst) &&
              FLEXKV_LAYOUT_LAYER_BLOCK == static_cast<int>(flexkv::KvLayout::kLayerBlock) &&
              FLEXKV_LAYOUT_LAYER_BLOCK_REGIONS == static_cast<int>(flexkv::KvLayout::kLayerBlockRegions));
std::span<const flexkv::BlockKey> Keys(const flexkv_block_key* keys, size_t n) {
  return {reinterpret_cast<const flexkv::BlockKey*>(keys), n};
}

void CopyText(const std::string& text, char* out, size_t len) {
  if (out != nullptr && len > 0) std::snprintf(out, len, "%s", text.c_str());
}

void FillStatus(const flexkv::DaemonStatus& s, flexkv_daemon_status* out) {
  *out = flexkv_daemon_status{};
  CopyText(s.state, out->state, sizeof(out->state));
  CopyText(s.version, out->version, sizeof(out->version));
  out->pid = s.pid;
  out->uptime_s = s.uptime_s;
  out->block_bytes = s.pool.block_bytes;
  out->capacity_blocks = s.pool.capacity_blocks;
  out->used_blocks = s.pool.used_blocks;
  out->pinned_blocks = s.pool.pinned_blocks;
  out->index_blocks = s.index_blocks;
  out->sessions = s.sessions;
}

int FillResult(const flexkv::OpResult& r, flexkv_op_result* out) {
  *out = flexkv_op_result{};
  out->status_code = static_cast<int32_t>(r.status.code());
  out->matched_blocks = r.matched_blocks;
  out->done_blocks = r.done_blocks;
  out->match_handle = r.match_handle;
  CopyText(r.status.ok() ? std::string() : r.status.message(), out->message, sizeof(out->message));
  out->bytes = r.bytes;
  CopyText(r.source, out->source, sizeof(out->source));
  return Record(flexkv::Status::Ok());
}

int Submitted(const flexkv::Result<flexkv::Ticket>& t, flexkv_ticket* ticket) {
  if (!t.ok()) return Record(t.status());
  *ticket = flexkv_ticket{t->id, t->generation};
  return Record(flexkv::Status::Ok());
}

flexkv::Ticket FromC(flexkv_ticket t) { return flexkv::Ticket{t.id, t.generation}; }

// The geometry of a flexkv_geometry, components included; INVALID_ARGUMENT for what cannot be read (the daemon
// validates the values).
flexkv::Result<flexkv::Geometry> GeometryFromC(const flexkv_geometry& g) {
  flexkv::Geometry out;
  out.tokens_per_block = g.tokens_per_block;
  out.num_layers = g.num_layers;
  out.kv_planes = g.kv_planes;
  out.kv_heads_per_rank = g.kv_heads_per_rank;
  out.head_dim = g.head_dim;
  out.dtype_bytes = g.dtype_bytes;
  out.tp_size = g.tp_size;
  if (g.n_components == 0) return out;
  if (g.n_components > flexkv::Geometry::kMaxComponents - 1) {
    return flexkv::Status::InvalidArgument("geometry.n_components is " + std::to_string(g.n_components) +
                                           "; expected at most " +
                                           std::to_string(flexkv::Geometry::kMaxComponents - 1));
  }
  if (g.components == nullptr) {
    return flexkv::Status::InvalidArgument("geometry.components is NULL but n_components is " +
                                           std::to_string(g.n_components));
  }
  for (uint32_t i = 0; i < g.n_components; ++i) {
    const flexkv_component& c = g.components[i];
    if (c.reserved != 0) {
      return flexkv::Status::InvalidArgument("geometry.components[" + std::to_string(i) + "].reserved is " +
                                             std::to_string(c.reserved) + "; expected 0");
    }
    flexkv::ComponentSpec spec;
    spec.kind = static_cast<flexkv::ComponentKind>(c.kind);
    spec.num_layers = c.num_layers;
    spec.kv_planes = c.kv_planes;
    spec.kv_heads_per_rank = c.kv_heads_per_rank;
    spec.head_dim = c.head_dim;
    spec.dtype_bytes = c.dtype_bytes;
    spec.window_tokens = c.window_tokens;
    spec.state_bytes_per_layer = c.state_bytes_per_layer;
    out.components.push_back(spec);
  }
  return out;
}

// Per-component id spans of flexkv_load_components / flexkv_store_components; nullopt (and the error recorded)
// when an array is NULL with a non-zero size.
std::optional<std::vector<std::span<const uint32_t>>> ComponentSpans(const uint32_t* const* ids, const size_t* counts,
                                                                     size_t n, int* rc) {
  if ((ids == nullptr || counts == nullptr) && n > 0) {
    *rc = NullArgument("component_ids and counts");
    return std::nullopt;
  }
  std::vector<std::span<const uint32_t>> spans;
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] == nullptr && counts[i] > 0) {
      *rc = NullArgument(("component_ids[" + std::to_string(i) + "]").c_str());
      return std::nullopt;
    }
    spans.emplace_back(ids[i], counts[i]);
  }
  return spans;
}

bool ValidLayout(int layout) {
  return layout == FLEXKV_LAYOUT_LAYER_FIRST || layout == FLEXKV_LAYOUT_BLOCK_FIRST ||
         layout == FLEXKV_LAYOUT_LAYER_BLOCK || layout == FLEXKV_LAYOUT_LAYER_BLOCK_REGIONS;
}

int BadLayout(int layout) {
  return Record(flexkv::Status::InvalidArgument("layout " + std::to_string(layout) + " is not valid; expected " +
                                                flexkv::KvLayoutsAccepted()));
}

// Every entry point runs inside this: no C++ exception (e.g. std::bad_alloc for a huge key count) may cross
// the C ABI into the engine.
template <typename F>
int Guarded(F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Record(flexkv::Status::ResourceExhausted("out of memory in libflexkv"));
  } catch (const std::exception& e) {
    return Record(flexkv::Status::Internal(std::string("libflexkv: ") + e.what()));
  } catch (...) {
    return Record(flexkv::Status::Internal("libflexkv: unknown exception"));
  }
}

// Waits longer than a year are taken as a year (the C idiom INT64_MAX for "forever" would overflow the clock).
std::chrono::microseconds WaitTimeout(int64_t timeout_us) {
  constexpr int64_t kYearUs = 365LL * 24 * 3600 * 1000000;
  return std::chrono::microseconds(std::clamp<int64_t>(timeout_us, 0, kYearUs));
}

}  // namespace

extern "C" {

uint32_t flexkv_abi_version(void) { return FLEXKV_ABI_VERSION; }

size_t flexkv_struct_size(const char* name) {
  if (name == nullptr) return 0;
  const std::string_view n(name);
  if (n == "flexkv_geometry") return sizeof(flexkv_geometry);
  if (n == "flexkv_component") return sizeof(flexkv_component);
  if (n == "flexkv_component_status") return sizeof(flexkv_component_status);
  if (n == "flexkv_daemon_status") return sizeof(flexkv_daemon_status);
  if (n == "flexkv_block_key") return sizeof(flexkv_block_key);
  if (n == "flexkv_op_result") return sizeof(flexkv_op_result);
  if (n == "flexkv_ticket") return sizeof(flexkv_ticket);
  if (n == "flexkv_kv_event") return sizeof(flexkv_kv_event);
  if (n == "flexkv_kv_batch") return sizeof(flexkv_kv_batch);
  if (n == "flexkv_kv_events_status") return sizeof(flexkv_kv_events_status);
  if (n == "flexkv_cluster_status") return sizeof(flexkv_cluster_status);
  if (n == "flexkv_cluster_member") return sizeof(flexkv_cluster_member);
  return 0;
}

const char* flexkv_version(void) { return flexkv::kVersion; }

int flexkv_compute_block_keys(const char* model_namespace, size_t namespace_len, const int32_t* tokens,
                              size_t n_tokens, uint32_t tokens_per_block, flexkv_block_key* out, size_t capacity,
                              size_t* count) {
  return flexkv_compute_block_keys_extra(model_namespace, namespace_len, tokens, n_tokens, tokens_per_block, nullptr,
                                         0, out, capacity, count);
}

int flexkv_compute_block_keys_extra(const char* model_namespace, size_t namespace_len, const int32_t* tokens,
                                    size_t n_tokens, uint32_t tokens_per_block, const uint8_t* extras,
                                    size_t n_extras, flexkv_block_key* out, size_t capacity, size_t* count) {
  return Guarded([&]() -> int {
    if (count == nullptr) return NullArgument("count");
    if (model_namespace == nullptr && namespace_len > 0) return NullArgument("model_namespace");
    if (tokens == nullptr && n_tokens > 0) return NullArgument("tokens");
    if (extras == nullptr && n_extras > 0) return NullArgument("extras");
    if (out == nullptr && capacity > 0) return NullArgument("out");
    if (tokens_per_block == 0) return Record(flexkv::Status::InvalidArgument("tokens_per_block is 0; expected > 0"));
    std::vector<flexkv::BlockExtra> per_block(n_extras);
    if (n_extras > 0) std::memcpy(per_block.data(), extras, n_extras * sizeof(flexkv::BlockExtra));
    const auto keys = flexkv::ComputeBlockKeys(std::string_view(model_namespace == nullptr ? "" : model_namespace, namespace_len),
                                               std::span<const int32_t>(tokens, n_tokens), tokens_per_block, per_block);
    *count = keys.size();
    for (size_t i = 0; i < keys.size() && i < capacity; ++i) out[i] = {keys[i].lo, keys[i].hi};
    return Record(flexkv::Status::Ok());
  });
}

uint64_t flexkv_namespace_hash(const char* model_namespace, size_t namespace_len) {
  if (model_namespace == nullptr) namespace_len = 0;
  return flexkv::NamespaceHash(std::string_view(model_namespace == nullptr ? "" : model_namespace, namespace_len));
}

int flexkv_connect(const char* socket_path, int timeout_ms, flexkv_client** out, char* error_buf, size_t error_len) {
  return Guarded([&]() -> int {
    if (out == nullptr) return NullArgument("out");
    *out = nullptr;
    flexkv::ConnectOptions options;
    if (socket_path != nullptr) options.socket_path = socket_path;
    if (timeout_ms >= 0) options.connect_timeout = std::chrono::milliseconds(timeout_ms);
    auto client = flexkv::Client::Connect(options);
    if (!client.ok()) {
      CopyText(client.status().ToString(), error_buf, error_len);
      return Record(client.status());
    }
    *out = new flexkv_client(std::move(*client));
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_attach(flexkv_client* c, const char* client_name, const char* model_namespace, uint32_t dp_rank,
                  uint32_t tp_rank, const flexkv_geometry* g, uint64_t* session_id) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (g == nullptr) return NullArgument("geometry");
    if (model_namespace == nullptr) return NullArgument("model_namespace");
    flexkv::AttachOptions o;
    o.client_name = client_name != nullptr ? client_name : "";
    o.model_namespace = model_namespace;
    o.dp_rank = dp_rank;
    o.tp_rank = tp_rank;
    auto geometry = GeometryFromC(*g);
    if (!geometry.ok()) return Record(geometry.status());
    o.geometry = std::move(*geometry);
    auto info = c->client->Attach(o);
    if (!info.ok()) return Record(info.status());
    if (session_id != nullptr) *session_id = info->session_id;
    flexkv::MutexLock lock(&c->mu);
    c->session = std::move(*info);
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_detach(flexkv_client* c) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    return Record(c->client->Detach());
  });
}

int flexkv_session_component(flexkv_client* c, uint32_t component, uint64_t* slot_bytes, uint64_t* capacity) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (slot_bytes == nullptr) return NullArgument("slot_bytes");
    if (capacity == nullptr) return NullArgument("capacity");
    if (!c->client->attached()) {
      return Record(flexkv::Status::FailedPrecondition("not attached: call flexkv_attach first"));
    }
    flexkv::MutexLock lock(&c->mu);
    const size_t n = std::min(c->session.component_slot_bytes.size(), c->session.component_capacity.size());
    if (component >= n) {
      return Record(flexkv::Status::InvalidArgument("component " + std::to_string(component) +
                                                    " is not in this session's geometry; expected 0.." +
                                                    std::to_string(n == 0 ? 0 : n - 1)));
    }
    *slot_bytes = c->session.component_slot_bytes[component];
    *capacity = c->session.component_capacity[component];
    return Record(flexkv::Status::Ok());
  });
}


int flexkv_get_status(flexkv_client* c, flexkv_daemon_status* out) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (out == nullptr) return NullArgument("out");
    auto s = c->client->GetStatus();
    if (!s.ok()) return Record(s.status());
    FillStatus(*s, out);
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_get_status_routing(flexkv_client* c, flexkv_daemon_status* status, flexkv_kv_events_status* events,
                              flexkv_cluster_status* cluster, flexkv_cluster_member* members, size_t capacity,
                              size_t* count) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (events == nullptr) return NullArgument("events");
    if (cluster == nullptr) return NullArgument("cluster");
    if (members == nullptr && capacity > 0) return NullArgument("members");
    if (count == nullptr) return NullArgument("count");
    auto s = c->client->GetStatus();
    if (!s.ok()) return Record(s.status());
    if (status != nullptr) FillStatus(*s, status);
    const auto& ev = s->kv_events;
    *events = flexkv_kv_events_status{ev.instance_id, ev.last_seq, ev.subscribers, 0, ev.cut_off, ev.buffer_events};
    *cluster = flexkv_cluster_status{};
    *count = 0;
    if (s->cluster) {
      cluster->present = 1;
      cluster->epoch = s->cluster->epoch;
      CopyText(s->cluster->state, cluster->state, sizeof(cluster->state));
      CopyText(s->cluster->node_id, cluster->node_id, sizeof(cluster->node_id));
      CopyText(s->cluster->endpoint, cluster->endpoint, sizeof(cluster->endpoint));
      const auto& list = s->cluster->members;
      *count = list.size();
      for (size_t i = 0; i < list.size() && i < capacity; ++i) {
        members[i] = flexkv_cluster_member{};
        members[i].epoch = list[i].epoch;
        members[i].self = list[i].self ? 1 : 0;
        CopyText(list[i].node_id, members[i].node_id, sizeof(members[i].node_id));
        CopyText(list[i].endpoint, members[i].endpoint, sizeof(members[i].endpoint));
      }
    }
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_get_status_components(flexkv_client* c, flexkv_component_status* out, size_t capacity, size_t* count) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (out == nullptr && capacity > 0) return NullArgument("out");
    if (count == nullptr) return NullArgument("count");
    auto s = c->client->GetStatus();
    if (!s.ok()) return Record(s.status());
    const auto& components = s->pool.components;
    *count = components.size();
    for (size_t i = 0; i < components.size() && i < capacity; ++i) {
      const auto& p = components[i];
      out[i] = flexkv_component_status{static_cast<uint32_t>(p.kind), 0, p.slot_bytes, p.capacity, p.used, p.pinned,
                                       p.evicted, p.unanchored};
    }
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_drain(flexkv_client* c, char* state_out, size_t state_len) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    auto state = c->client->Drain();
    if (!state.ok()) return Record(state.status());
    CopyText(*state, state_out, state_len);
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_resume(flexkv_client* c, char* state_out, size_t state_len) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    auto state = c->client->Resume();
    if (!state.ok()) return Record(state.status());
    CopyText(*state, state_out, state_len);
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_check_health(flexkv_client* c) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    return Record(c->client->CheckHealth());
  });
}

int flexkv_create_host_kv(flexkv_client* c, int layout, uint32_t num_blocks, void** data, uint64_t* bytes) {
  return flexkv_create_host_kv_component(c, 0, layout, num_blocks, data, bytes);
}

int flexkv_create_host_kv_component(flexkv_client* c, uint32_t component, int layout, uint32_t num_blocks,
                                    void** data, uint64_t* bytes) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (data == nullptr) return NullArgument("data");
    if (bytes == nullptr) return NullArgument("bytes");
    if (!ValidLayout(layout)) return BadLayout(layout);
    auto kv = c->client->CreateHostKv(component, static_cast<flexkv::KvLayout>(layout), num_blocks);
    if (!kv.ok()) return Record(kv.status());
    *data = kv->data;
    *bytes = kv->bytes;
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_describe_gpu_kv(int layout, void* const* regions, size_t n_regions, uint64_t region_bytes,
                           uint32_t num_blocks, uint32_t tp_rank, flexkv_gpu_kv** out) {
  return Guarded([&]() -> int {
    if (out == nullptr) return NullArgument("out");
    *out = nullptr;
    if (regions == nullptr && n_regions > 0) return NullArgument("regions");
    if (!ValidLayout(layout)) return BadLayout(layout);
    auto reg = flexkv::DescribeGpuKv(static_cast<flexkv::KvLayout>(layout), std::span<void* const>(regions, n_regions),
                                     region_bytes, num_blocks, tp_rank);
    if (!reg.ok()) return Record(reg.status());
    *out = new flexkv_gpu_kv{std::move(*reg)};
    return Record(flexkv::Status::Ok());
  });
}

const char* flexkv_gpu_kv_uuid(const flexkv_gpu_kv* kv) { return kv == nullptr ? "" : kv->registration.gpu_uuid.c_str(); }

int flexkv_gpu_kv_set_component(flexkv_gpu_kv* kv, uint32_t component) {
  return Guarded([&]() -> int {
    if (kv == nullptr) return NullArgument("kv");
    kv->registration.component = component;  // checked against the session's geometry by register
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_register_gpu_kv(flexkv_client* c, const flexkv_gpu_kv* kv) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (kv == nullptr) return NullArgument("kv");
    return Record(c->client->RegisterGpuKv(kv->registration));
  });
}

void flexkv_gpu_kv_free(flexkv_gpu_kv* kv) { delete kv; }

int flexkv_gpu_kv_export(const flexkv_gpu_kv* kv, void* buf, size_t cap, size_t* len) {
  return Guarded([&]() -> int {
    if (kv == nullptr) return NullArgument("kv");
    if (len == nullptr) return NullArgument("len");
    const flexkv::GpuKvRegistration& r = kv->registration;
    if (!r.vmm_allocations.empty()) {
      return Record(flexkv::Status::FailedPrecondition(
          "this GPU KV description holds cuMem/VMM memory (PyTorch's expandable segments), whose file descriptors "
          "cannot travel as bytes; register it from the process that described it, or allocate the KV cache "
          "without expandable segments"));
    }
    // The format is RegisterKvRequest (proto/flexkv/v1/control.proto) without its session fields.
    flexkv::v1::RegisterKvRequest req;
    req.set_layout(static_cast<flexkv::v1::KvLayout>(static_cast<int>(r.layout)));
    req.set_num_blocks(r.num_blocks);
    req.set_component(r.component);
    auto* cuda = req.mutable_cuda();
    cuda->set_gpu_uuid(r.gpu_uuid);
    cuda->set_tp_rank(r.tp_rank);
    for (const auto& region : r.regions) {
      auto* out = cuda->add_regions();
      out->set_ipc_handle(region.ipc_handle);
      out->set_offset(region.offset);
      out->set_bytes(region.bytes);
    }
    std::string bytes;
    if (!req.SerializeToString(&bytes)) return Record(flexkv::Status::Internal("cannot serialize a GPU KV description"));
    *len = bytes.size();
    if (buf == nullptr) return Record(flexkv::Status::Ok());
    if (cap < bytes.size()) {
      return Record(flexkv::Status::OutOfRange("a buffer of " + std::to_string(cap) + " bytes; the description needs " +
                                               std::to_string(bytes.size())));
    }
    std::memcpy(buf, bytes.data(), bytes.size());
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_gpu_kv_import(const void* buf, size_t len, flexkv_gpu_kv** out) {
  return Guarded([&]() -> int {
    if (out == nullptr) return NullArgument("out");
    *out = nullptr;
    if (buf == nullptr && len > 0) return NullArgument("buf");
    constexpr size_t kMaxDescriptionBytes = 1 << 20;
    if (len > kMaxDescriptionBytes) {
      return Record(flexkv::Status::InvalidArgument("a GPU KV description of " + std::to_string(len) +
                                                    " bytes; expected at most " + std::to_string(kMaxDescriptionBytes)));
    }
    flexkv::v1::RegisterKvRequest req;
    if (len == 0 || !req.ParseFromArray(buf, static_cast<int>(len)) || !req.has_cuda()) {
      return Record(flexkv::Status::InvalidArgument(
          "these " + std::to_string(len) + " bytes are not a GPU KV description; expected flexkv_gpu_kv_export's"));
    }
    if (!ValidLayout(static_cast<int>(req.layout()))) return BadLayout(static_cast<int>(req.layout()));
    const auto& cuda = req.cuda();
    if (cuda.regions_size() == 0) {
      return Record(flexkv::Status::InvalidArgument("a GPU KV description without regions; expected at least one"));
    }
    flexkv::GpuKvRegistration reg;
    reg.gpu_uuid = cuda.gpu_uuid();
    reg.layout = static_cast<flexkv::KvLayout>(static_cast<int>(req.layout()));
    reg.num_blocks = req.num_blocks();
    reg.tp_rank = cuda.tp_rank();
    reg.component = req.component();
    for (int i = 0; i < cuda.regions_size(); ++i) {
      const auto& region = cuda.regions(i);
      if (region.vmm_allocations_size() > 0 || region.ipc_handle().size() != 64) {
        return Record(flexkv::Status::InvalidArgument(
            "region " + std::to_string(i) + " of the GPU KV description has a " +
            std::to_string(region.ipc_handle().size()) + "-byte IPC handle" +
            (region.vmm_allocations_size() > 0 ? " and cuMem/VMM allocations" : "") +
            "; expected a 64-byte cudaIpcMemHandle_t"));
      }
      reg.regions.push_back({region.ipc_handle(), region.offset(), region.bytes(), {}});
    }
    *out = new flexkv_gpu_kv{std::move(reg)};
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_match(flexkv_client* c, const flexkv_block_key* keys, size_t n_keys, int pin, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (keys == nullptr && n_keys > 0) return NullArgument("keys");
    if (ticket == nullptr) return NullArgument("ticket");
    return Submitted(c->client->Match(Keys(keys, n_keys), pin != 0), ticket);
  });
}

int flexkv_prefetch(flexkv_client* c, const flexkv_block_key* keys, size_t n_keys, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (keys == nullptr && n_keys > 0) return NullArgument("keys");
    if (ticket == nullptr) return NullArgument("ticket");
    return Submitted(c->client->Prefetch(Keys(keys, n_keys)), ticket);
  });
}

int flexkv_load(flexkv_client* c, uint64_t match_handle, const uint32_t* dst_block_ids, size_t n_blocks, int layerwise,
                flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (dst_block_ids == nullptr && n_blocks > 0) return NullArgument("dst_block_ids");
    if (ticket == nullptr) return NullArgument("ticket");
    return Submitted(c->client->Load(match_handle, std::span<const uint32_t>(dst_block_ids, n_blocks), layerwise != 0),
                     ticket);
  });
}

int flexkv_store(flexkv_client* c, const flexkv_block_key* parent, const flexkv_block_key* keys,
                 const uint32_t* src_block_ids, size_t n, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if ((keys == nullptr || src_block_ids == nullptr) && n > 0) return NullArgument("keys and src_block_ids");
    if (ticket == nullptr) return NullArgument("ticket");
    const flexkv::BlockKey parent_key = parent == nullptr ? flexkv::kRootParent : Keys(parent, 1)[0];
    return Submitted(c->client->Store(flexkv::BlockKeyChain(parent_key, Keys(keys, n)),
                                      std::span<const uint32_t>(src_block_ids, n)),
                     ticket);
  });
}

int flexkv_load_components(flexkv_client* c, uint64_t match_handle, const uint32_t* const* component_ids,
                           const size_t* counts, size_t n_components, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (ticket == nullptr) return NullArgument("ticket");
    int rc = 0;
    auto spans = ComponentSpans(component_ids, counts, n_components, &rc);
    if (!spans) return rc;
    return Submitted(c->client->Load(match_handle, *spans), ticket);
  });
}

int flexkv_store_components(flexkv_client* c, const flexkv_block_key* parent, const flexkv_block_key* keys,
                            size_t n_keys, const uint32_t* const* component_ids, const size_t* counts,
                            size_t n_components, const uint32_t* state_boundaries, size_t n_boundaries,
                            flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (keys == nullptr && n_keys > 0) return NullArgument("keys");
    if (state_boundaries == nullptr && n_boundaries > 0) return NullArgument("state_boundaries");
    if (ticket == nullptr) return NullArgument("ticket");
    int rc = 0;
    auto spans = ComponentSpans(component_ids, counts, n_components, &rc);
    if (!spans) return rc;
    const flexkv::BlockKey parent_key = parent == nullptr ? flexkv::kRootParent : Keys(parent, 1)[0];
    return Submitted(c->client->Store(flexkv::BlockKeyChain(parent_key, Keys(keys, n_keys)), *spans,
                                      std::span<const uint32_t>(state_boundaries, n_boundaries)),
                     ticket);
  });
}

int flexkv_load_from(flexkv_client* c, uint64_t match_handle, uint32_t first_block, const uint32_t* dst_block_ids,
                     size_t n_blocks, int layerwise, uint32_t event_set, flexkv_ticket* ticket) {
  return flexkv_load_by(c, match_handle, first_block, dst_block_ids, n_blocks, layerwise, event_set, 0, ticket);
}

int flexkv_load_components_from(flexkv_client* c, uint64_t match_handle, uint32_t first_block,
                                const uint32_t* const* component_ids, const size_t* counts, size_t n_components,
                                flexkv_ticket* ticket) {
  return flexkv_load_components_by(c, match_handle, first_block, component_ids, counts, n_components, 0, ticket);
}

int flexkv_load_by(flexkv_client* c, uint64_t match_handle, uint32_t first_block, const uint32_t* dst_block_ids,
                   size_t n_blocks, int layerwise, uint32_t event_set, int64_t launch_deadline_ns,
                   flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (dst_block_ids == nullptr && n_blocks > 0) return NullArgument("dst_block_ids");
    if (ticket == nullptr) return NullArgument("ticket");
    const std::span<const uint32_t> ids(dst_block_ids, n_blocks);
    if (event_set == 0) {
      return Submitted(c->client->Load(match_handle, ids, layerwise != 0, first_block, launch_deadline_ns), ticket);
    }
    if (layerwise != 0) {
      return Record(flexkv::Status::InvalidArgument(
          "a load with event_set " + std::to_string(event_set) +
          " and layerwise; expected one completion kind: the set's events or layer progress"));
    }
    return Submitted(c->client->LoadWithEvents(match_handle, ids, event_set, first_block, launch_deadline_ns), ticket);
  });
}

int flexkv_load_components_by(flexkv_client* c, uint64_t match_handle, uint32_t first_block,
                              const uint32_t* const* component_ids, const size_t* counts, size_t n_components,
                              int64_t launch_deadline_ns, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (ticket == nullptr) return NullArgument("ticket");
    int rc = 0;
    auto spans = ComponentSpans(component_ids, counts, n_components, &rc);
    if (!spans) return rc;
    return Submitted(c->client->Load(match_handle, *spans, first_block, launch_deadline_ns), ticket);
  });
}

int flexkv_load_components_layered(flexkv_client* c, uint64_t match_handle, uint32_t first_block,
                                   const uint32_t* const* component_ids, const size_t* counts, size_t n_components,
                                   int layerwise, uint32_t event_set, int64_t launch_deadline_ns,
                                   flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (ticket == nullptr) return NullArgument("ticket");
    if (layerwise != 0 && event_set != 0) {
      return Record(flexkv::Status::InvalidArgument(
          "a load with event_set " + std::to_string(event_set) +
          " and layerwise; expected one completion kind: the set's events or layer progress"));
    }
    int rc = 0;
    auto spans = ComponentSpans(component_ids, counts, n_components, &rc);
    if (!spans) return rc;
    if (event_set != 0) {
      return Submitted(c->client->LoadWithEvents(match_handle, *spans, event_set, first_block, launch_deadline_ns),
                       ticket);
    }
    return Submitted(c->client->Load(match_handle, *spans, first_block, launch_deadline_ns, layerwise != 0), ticket);
  });
}

int flexkv_layer_order(const flexkv_geometry* geometry, uint32_t* component, uint32_t* layer, size_t capacity,
                       size_t* n) {
  return Guarded([&]() -> int {
    if (geometry == nullptr) return NullArgument("geometry");
    if (n == nullptr) return NullArgument("n");
    if (capacity > 0 && (component == nullptr || layer == nullptr)) return NullArgument("component or layer");
    auto g = GeometryFromC(*geometry);
    if (!g.ok()) return Record(g.status());
    if (flexkv::Status valid = g->Validate(); !valid.ok()) return Record(valid);
    const std::vector<flexkv::LayerStep> order = g->LayerOrder();
    *n = order.size();
    if (order.size() > capacity) {
      return Record(flexkv::Status::OutOfRange("the layer order has " + std::to_string(order.size()) +
                                               " entries; capacity is " + std::to_string(capacity)));
    }
    for (size_t i = 0; i < order.size(); ++i) {
      component[i] = order[i].component;
      layer[i] = order[i].layer;
    }
    return FLEXKV_OK;
  });
}

int flexkv_store_components_windows(flexkv_client* c, const flexkv_block_key* parent, const flexkv_block_key* keys,
                                    size_t n_keys, const uint32_t* const* component_ids, const size_t* counts,
                                    size_t n_components, const uint32_t* state_boundaries, size_t n_boundaries,
                                    uint32_t window_keys, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (keys == nullptr && n_keys > 0) return NullArgument("keys");
    if (state_boundaries == nullptr && n_boundaries > 0) return NullArgument("state_boundaries");
    if (ticket == nullptr) return NullArgument("ticket");
    int rc = 0;
    auto spans = ComponentSpans(component_ids, counts, n_components, &rc);
    if (!spans) return rc;
    const flexkv::BlockKey parent_key = parent == nullptr ? flexkv::kRootParent : Keys(parent, 1)[0];
    return Submitted(c->client->Store(flexkv::BlockKeyChain(parent_key, Keys(keys, n_keys)), *spans,
                                      std::span<const uint32_t>(state_boundaries, n_boundaries), window_keys),
                     ticket);
  });
}

int flexkv_release(flexkv_client* c, uint64_t match_handle, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (ticket == nullptr) return NullArgument("ticket");
    return Submitted(c->client->Release(match_handle), ticket);
  });
}

int flexkv_match_via_control(flexkv_client* c, const flexkv_block_key* keys, size_t n_keys, uint32_t* matched) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (keys == nullptr && n_keys > 0) return NullArgument("keys");
    if (matched == nullptr) return NullArgument("matched");
    auto m = c->client->MatchViaControl(Keys(keys, n_keys));
    if (!m.ok()) return Record(m.status());
    *matched = *m;
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_wait(flexkv_client* c, flexkv_ticket ticket, int64_t timeout_us, flexkv_op_result* out) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (out == nullptr) return NullArgument("out");
    auto r = c->client->Wait(FromC(ticket), WaitTimeout(timeout_us));
    if (!r.ok()) return Record(r.status());
    return FillResult(*r, out);
  });
}

int flexkv_try_wait(flexkv_client* c, flexkv_ticket ticket, flexkv_op_result* out) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (out == nullptr) return NullArgument("out");
    auto r = c->client->TryWait(FromC(ticket));
    if (!r.ok()) return Record(r.status());
    if (!r->has_value()) {
      return Record(flexkv::Status::DeadlineExceeded("request " + std::to_string(ticket.id) + " has not ended yet"));
    }
    return FillResult(**r, out);
  });
}

int flexkv_layer_events_create(uint32_t num_layers, uint32_t tp_rank, flexkv_layer_events** out) {
  return Guarded([&]() -> int {
    if (out == nullptr) return NullArgument("out");
    *out = nullptr;
    auto events = flexkv::CudaLayerEvents::Create(num_layers, tp_rank);
    if (!events.ok()) return Record(events.status());
    *out = new flexkv_layer_events{std::move(*events)};
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_layer_events_stream_wait(const flexkv_layer_events* events, uint32_t layer, void* stream) {
  return Guarded([&]() -> int {
    if (events == nullptr) return NullArgument("events");
    return Record(events->events.StreamWait(layer, stream));
  });
}

void flexkv_layer_events_free(flexkv_layer_events* events) { delete events; }

int flexkv_register_layer_events(flexkv_client* c, const flexkv_layer_events* const* ranks, size_t n_ranks,
                                 uint32_t* event_set) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (ranks == nullptr && n_ranks > 0) return NullArgument("ranks");
    if (event_set == nullptr) return NullArgument("event_set");
    std::vector<flexkv::LayerEventHandles> handles;
    for (size_t i = 0; i < n_ranks; ++i) {
      if (ranks[i] == nullptr) return NullArgument("ranks[i]");
      handles.push_back(ranks[i]->events.handles());
    }
    auto id = c->client->RegisterLayerEvents(handles);
    if (!id.ok()) return Record(id.status());
    *event_set = *id;
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_release_layer_events(flexkv_client* c, uint32_t event_set) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    return Record(c->client->ReleaseLayerEvents(event_set));
  });
}

int flexkv_load_with_events(flexkv_client* c, uint64_t match_handle, const uint32_t* dst_block_ids, size_t n_blocks,
                            uint32_t event_set, flexkv_ticket* ticket) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (dst_block_ids == nullptr && n_blocks > 0) return NullArgument("dst_block_ids");
    if (ticket == nullptr) return NullArgument("ticket");
    return Submitted(
        c->client->LoadWithEvents(match_handle, std::span<const uint32_t>(dst_block_ids, n_blocks), event_set), ticket);
  });
}

int flexkv_wait_launched(flexkv_client* c, flexkv_ticket ticket, int64_t timeout_us) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    return Record(c->client->WaitLaunched(FromC(ticket), WaitTimeout(timeout_us)));
  });
}

int flexkv_wait_layers(flexkv_client* c, flexkv_ticket ticket, uint32_t layers, int64_t timeout_us,
                       uint32_t* landed) {
  return Guarded([&]() -> int {
    if (c == nullptr) return NullArgument("client");
    if (landed == nullptr) return NullArgument("landed");
    auto r = c->client->WaitLayers(FromC(ticket), layers, WaitTimeout(timeout_us));
    if (!r.ok()) return Record(r.status());
    *landed = *r;
    return Record(flexkv::Status::Ok());
  });
}

struct flexkv_kv_subscription {
  std::unique_ptr<flexkv::KvEventSubscription> sub;
  std::optional<flexkv::KvEventBatch> pending;  // a batch larger than the caller's capacity
  size_t offset = 0;                           // its events already handed out
};

int flexkv_kv_subscribe(const char* socket_path, int timeout_ms, uint32_t max_batch_events, int skip_snapshot,
                        flexkv_kv_subscription** out) {
  return Guarded([&]() -> int {
    if (out == nullptr) return NullArgument("out");
    *out = nullptr;
    flexkv::ConnectOptions connect;
    if (socket_path != nullptr) connect.socket_path = socket_path;
    if (timeout_ms >= 0) connect.connect_timeout = std::chrono::milliseconds(timeout_ms);
    flexkv::KvSubscribeOptions options;
    options.max_batch_events = max_batch_events;
    options.skip_snapshot = skip_snapshot != 0;
    auto sub = flexkv::KvEventSubscription::Open(connect, options);
    if (!sub.ok()) return Record(sub.status());
    *out = new flexkv_kv_subscription{std::move(*sub), std::nullopt, 0};
    return Record(flexkv::Status::Ok());
  });
}

int flexkv_kv_next(flexkv_kv_subscription* s, flexkv_kv_batch* batch, flexkv_kv_event* events, size_t capacity) {
  return Guarded([&]() -> int {
    if (s == nullptr) return NullArgument("subscription");
    if (batch == nullptr) return NullArgument("batch");
    // With no room for an event a batch with events could never be handed out, and the caller would get the same
    // empty part forever.
    if (capacity == 0) {
      return Record(flexkv::Status::InvalidArgument(
          "flexkv_kv_next: capacity is 0; expected capacity >= 1 (the number of flexkv_kv_event in events)"));
    }
    if (events == nullptr) return NullArgument("events");
    if (!s->pending) {
      auto b = s->sub->Next();
      if (!b.ok()) return Record(b.status());
      s->pending = std::move(*b);
      s->offset = 0;
    }
    const flexkv::KvEventBatch& b = *s->pending;
    const size_t n = std::min(capacity, b.events.size() - s->offset);
    const bool last = s->offset + n == b.events.size();
    *batch = flexkv_kv_batch{};
    batch->instance_id = b.instance_id;
    batch->started_unix_ms = b.started_unix_ms;
    batch->snapshot_seq = b.snapshot_seq;
    batch->head_seq = b.head_seq;
    batch->position = last ? b.position : 0;
    batch->snapshot = b.snapshot ? 1 : 0;
    batch->snapshot_end = (b.snapshot_end && last) ? 1 : 0;
    batch->n_events = n;
    for (size_t i = 0; i < n; ++i) {
      const flexkv::KvBlockEvent& e = b.events[s->offset + i];
      flexkv_kv_event& o = events[i];
      o = flexkv_kv_event{};
      o.seq = e.seq;
      o.key = flexkv_block_key{e.key.lo, e.key.hi};
      o.parent = flexkv_block_key{e.parent.lo, e.parent.hi};
      o.tokens_per_block = e.tokens_per_block;
      o.kind = static_cast<uint8_t>(e.kind);
      o.tier = static_cast<uint8_t>(e.tier);
      o.component = static_cast<uint8_t>(e.component);
      CopyText(e.model_namespace, o.model_namespace, sizeof(o.model_namespace));
      CopyText(e.cause, o.cause, sizeof(o.cause));
    }
    s->offset += n;
    if (last) s->pending.reset();
    return Record(flexkv::Status::Ok());
  });
}

void flexkv_kv_cancel(flexkv_kv_subscription* s) {
  if (s != nullptr) s->sub->Cancel();
}

void flexkv_kv_close(flexkv_kv_subscription* s) { delete s; }

const char* flexkv_last_error(void) { return last_error.c_str(); }

void flexkv_close(flexkv_client* c) { delete c; }

}  // extern "C"

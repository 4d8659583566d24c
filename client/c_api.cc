// C ABI over flexkv::Client; see flexkv/c.h.
#include "flexkv/c.h"

#include <cstdio>
#include <memory>
#include <string>

#include "flexkv/client.h"

struct flexkv_client {
  std::unique_ptr<flexkv::Client> client;
  std::string last_error;
};

namespace {

int Record(flexkv_client* c, const flexkv::Status& s) {
  c->last_error = s.ok() ? std::string() : s.ToString();
  return static_cast<int>(s.code());
}

}  // namespace

extern "C" {

int flexkv_connect(const char* socket_path, int timeout_ms, flexkv_client** out, char* error_buf, size_t error_len) {
  if (out == nullptr) return static_cast<int>(flexkv::StatusCode::kInvalidArgument);
  *out = nullptr;
  flexkv::ConnectOptions options;
  if (socket_path != nullptr) options.socket_path = socket_path;
  if (timeout_ms >= 0) options.connect_timeout = std::chrono::milliseconds(timeout_ms);
  auto client = flexkv::Client::Connect(options);
  if (!client.ok()) {
    if (error_buf != nullptr && error_len > 0) std::snprintf(error_buf, error_len, "%s", client.status().ToString().c_str());
    return static_cast<int>(client.status().code());
  }
  *out = new flexkv_client{std::move(*client), {}};
  return 0;
}

int flexkv_attach(flexkv_client* c, const char* client_name, const char* model_namespace, uint32_t dp_rank,
                  uint32_t tp_rank, const flexkv_geometry* g, uint64_t* session_id) {
  if (c == nullptr) return static_cast<int>(flexkv::StatusCode::kInvalidArgument);
  if (g == nullptr || model_namespace == nullptr) {
    return Record(c, flexkv::Status::InvalidArgument("geometry and model_namespace must not be NULL"));
  }
  flexkv::AttachOptions o;
  o.client_name = client_name != nullptr ? client_name : "";
  o.model_namespace = model_namespace;
  o.dp_rank = dp_rank;
  o.tp_rank = tp_rank;
  o.geometry = flexkv::Geometry{g->tokens_per_block, g->num_layers,  g->kv_planes, g->kv_heads_per_rank,
                                g->head_dim,         g->dtype_bytes, g->tp_size};
  auto info = c->client->Attach(o);
  if (!info.ok()) return Record(c, info.status());
  if (session_id != nullptr) *session_id = info->session_id;
  return Record(c, flexkv::Status::Ok());
}

int flexkv_detach(flexkv_client* c) {
  if (c == nullptr) return static_cast<int>(flexkv::StatusCode::kInvalidArgument);
  return Record(c, c->client->Detach());
}

int flexkv_get_status(flexkv_client* c, flexkv_daemon_status* out) {
  if (c == nullptr) return static_cast<int>(flexkv::StatusCode::kInvalidArgument);
  if (out == nullptr) return Record(c, flexkv::Status::InvalidArgument("out must not be NULL"));
  auto s = c->client->GetStatus();
  if (!s.ok()) return Record(c, s.status());
  *out = flexkv_daemon_status{};
  std::snprintf(out->state, sizeof(out->state), "%s", s->state.c_str());
  std::snprintf(out->version, sizeof(out->version), "%s", s->version.c_str());
  out->pid = s->pid;
  out->uptime_s = s->uptime_s;
  out->block_bytes = s->pool.block_bytes;
  out->capacity_blocks = s->pool.capacity_blocks;
  out->used_blocks = s->pool.used_blocks;
  out->pinned_blocks = s->pool.pinned_blocks;
  out->index_blocks = s->index_blocks;
  out->sessions = s->sessions;
  return Record(c, flexkv::Status::Ok());
}

const char* flexkv_last_error(const flexkv_client* c) { return c == nullptr ? "null client" : c->last_error.c_str(); }

void flexkv_close(flexkv_client* c) { delete c; }

}  // extern "C"

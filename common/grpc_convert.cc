// See grpc_convert.h.
#include "common/grpc_convert.h"

#include <algorithm>

namespace flexkv {

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return Status::Ok();
  return Status(static_cast<StatusCode>(status.error_code()), status.error_message());
}

Geometry FromProto(const v1::Geometry& g) {
  Geometry out;
  out.tokens_per_block = g.tokens_per_block();
  out.num_layers = g.num_layers();
  out.kv_planes = g.kv_planes();
  out.kv_heads_per_rank = g.kv_heads_per_rank();
  out.head_dim = g.head_dim();
  out.dtype_bytes = g.dtype_bytes();
  out.tp_size = g.tp_size();
  // Untrusted: keep one more than the most Validate accepts, so that too many is still refused by name.
  const int n = std::min<int>(g.components_size(), static_cast<int>(Geometry::kMaxComponents));
  for (int i = 0; i < n; ++i) {
    const v1::Component& c = g.components(i);
    ComponentSpec spec;
    spec.kind = static_cast<ComponentKind>(c.kind());
    spec.num_layers = c.num_layers();
    spec.kv_planes = c.kv_planes();
    spec.kv_heads_per_rank = c.kv_heads_per_rank();
    spec.head_dim = c.head_dim();
    spec.dtype_bytes = c.dtype_bytes();
    spec.window_tokens = c.window_tokens();
    spec.state_bytes_per_layer = c.state_bytes_per_layer();
    out.components.push_back(spec);
  }
  return out;
}

void ToProto(const Geometry& g, v1::Geometry* out) {
  out->set_tokens_per_block(g.tokens_per_block);
  out->set_num_layers(g.num_layers);
  out->set_kv_planes(g.kv_planes);
  out->set_kv_heads_per_rank(g.kv_heads_per_rank);
  out->set_head_dim(g.head_dim);
  out->set_dtype_bytes(g.dtype_bytes);
  out->set_tp_size(g.tp_size);
  out->clear_components();
  for (const ComponentSpec& spec : g.components) {
    v1::Component* c = out->add_components();
    c->set_kind(static_cast<v1::ComponentKind>(spec.kind));
    c->set_num_layers(spec.num_layers);
    c->set_kv_planes(spec.kv_planes);
    c->set_kv_heads_per_rank(spec.kv_heads_per_rank);
    c->set_head_dim(spec.head_dim);
    c->set_dtype_bytes(spec.dtype_bytes);
    c->set_window_tokens(spec.window_tokens);
    c->set_state_bytes_per_layer(spec.state_bytes_per_layer);
  }
}

}  // namespace flexkv
